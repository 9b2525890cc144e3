"""The picker's own Python work per request, without gRPC: ext_proc messages handed to the service directly.

Starts the picker in-process (`EppServer`, default config: queue + kv-cache + approximate
prefix, 16 endpoints, no scraping) and feeds the same messages `bench/extproc_cpu.py` sends
(request headers + a 4 KB JSON body, then what each response mode sends) to its
ext_proc service, one request after another. Prints process CPU µs per request (the minimum
over batches: other tenants of a shared machine only ever add time) and the share of each
phase. What `bench/extproc_cpu.py` shows above this is gRPC's, the kernel's and contention's.

    python bench/extproc_inproc.py --requests 5000
    python bench/extproc_inproc.py --requests 5000 --epp-config bench/random-picker.yaml   # the framework alone
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from extproc_cpu import MODES, _messages  # noqa: E402

from epp.datalayer.registry import parse_endpoint_list  # noqa: E402
from epp.request.parsing import RequestParser  # noqa: E402
from epp.server.extproc import ExtProcService, _Stream  # noqa: E402
from epp.server.runner import EppServer, ServeOptions  # noqa: E402
from epp.tracing import RequestTracing  # noqa: E402

BATCHES = 20


@contextlib.asynccontextmanager
async def picker_service(config_file: str | None = None,
                         tracing: RequestTracing | None = None) -> AsyncIterator[tuple[EppServer, ExtProcService]]:
    """The picker started in-process (16 endpoints, no scraping) and an ext_proc service on it (tracing into
    `tracing`, if given); stopped on exit."""
    options = ServeOptions(grpc_port=0, grpc_health_port=0, metrics_port=0, bind_address="127.0.0.1",
                           endpoints=parse_endpoint_list(",".join(f"127.0.0.1:{8000 + i}" for i in range(16))),
                           scrape_metrics=False, config_file=config_file)
    server = EppServer(options)
    await server.start()
    try:
        yield server, ExtProcService(server.director, RequestParser(), server.metrics, tracing=tracing)
    finally:
        await server.stop(0)


async def measure(n: int, mode: str, config_file: str | None = None,
                  tracing: RequestTracing | None = None) -> tuple[float, dict[str, float]]:
    """CPU µs per request (minimum over batches) and the share of each phase."""
    async with picker_service(config_file, tracing) as (_server, service):
        request, response = _messages(mode)
        sequence = [(req.WhichOneof("request"), req) for req in request + response]
        spent = dict.fromkeys([kind for kind, _ in sequence], 0.0)
        clock = time.process_time

        async def one() -> None:
            stream = _Stream(service)
            for kind, req in sequence:
                t0 = clock()
                await service._dispatch(stream, req)
                spent[kind] += clock() - t0
            stream.on_close()  # what the end of the gRPC stream does
            stream.life.complete(aborted=True)
            stream.trace.end(stream.life.response)

        for _ in range(200):  # warm-up
            await one()
        spent = dict.fromkeys(spent, 0.0)
        best = float("inf")
        for _ in range(BATCHES):
            t0 = clock()
            for _ in range(max(1, n // BATCHES)):
                await one()
            best = min(best, clock() - t0)
        total = sum(spent.values()) or 1.0
        return best / max(1, n // BATCHES) * 1e6, {kind: s / total for kind, s in spent.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--epp-config", help="the picker's config file (default: GIE's default pipeline)")
    args = parser.parse_args()
    print(f"\n{args.requests} requests in {BATCHES} batches, 16 endpoints, 4 KB prompts, no gRPC, "
          f"config: {args.epp_config or 'default'}\n")
    print("| mode | Python CPU µs / request (min batch) | share by phase |")
    print("|---|---|---|")
    for mode, label in MODES.items():
        us, shares = asyncio.run(measure(args.requests, mode, args.epp_config))
        split = ", ".join(f"{kind} {share * 100:.0f} %" for kind, share in shares.items())
        print(f"| {label} | {us:.0f} | {split} |")


if __name__ == "__main__":
    main()
