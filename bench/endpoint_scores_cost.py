"""What `--emit-endpoint-scores` costs per request: the picker's own CPU with it off, `totals` and `scorers`.

The picker runs in-process (`EppServer`, GIE's default pipeline: queue + kv-cache + approximate
prefix, 16 endpoints, no scraping) and each request's ext_proc messages (`bench/extproc_cpu.py`'s,
4 KB prompt, request phases only) go straight to its service, as in `bench/extproc_inproc.py`.
The three settings run interleaved batch by batch in one process, so a shared machine's noise
falls on all of them alike; each reports its minimum over the batches and its ratio to off.

    python bench/endpoint_scores_cost.py --requests 6000
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from extproc_cpu import _messages  # noqa: E402

from epp.datalayer.registry import parse_endpoint_list  # noqa: E402
from epp.server.extproc import ExtProcService, _Stream  # noqa: E402
from epp.server.runner import EppServer, ServeOptions  # noqa: E402

SETTINGS = (None, "totals", "scorers")
BATCHES = 30


async def started(emit: str | None) -> tuple[EppServer, ExtProcService]:
    options = ServeOptions(grpc_port=0, grpc_health_port=0, metrics_port=0, bind_address="127.0.0.1",
                           endpoints=parse_endpoint_list(",".join(f"127.0.0.1:{8000 + i}" for i in range(16))),
                           scrape_metrics=False, emit_endpoint_scores=emit)
    server = EppServer(options)
    await server.start()
    assert server.parser is not None and server.director is not None
    return server, ExtProcService(server.director, server.parser, server.metrics,
                                  emit_endpoint_scores=emit is not None)


async def measure(n: int) -> dict[str | None, float]:
    """CPU µs per request (minimum over batches) for each setting."""
    request, _ = _messages("none")
    sequence = list(request)
    pickers = {emit: await started(emit) for emit in SETTINGS}
    clock = time.process_time

    async def one(service: ExtProcService) -> None:
        stream = _Stream(service)
        for req in sequence:
            await service._dispatch(stream, req)
        stream.on_close()
        stream.life.complete(aborted=True)

    try:
        for _, service in pickers.values():  # warm-up
            for _ in range(200):
                await one(service)
        best = dict.fromkeys(SETTINGS, float("inf"))
        per_batch = max(1, n // BATCHES)
        for _ in range(BATCHES):
            for emit, (_, service) in pickers.items():
                t0 = clock()
                for _ in range(per_batch):
                    await one(service)
                best[emit] = min(best[emit], clock() - t0)
        return {emit: seconds / per_batch * 1e6 for emit, seconds in best.items()}
    finally:
        for server, _ in pickers.values():
            await server.stop(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=6000, help="requests per setting (default 6000)")
    args = parser.parse_args()
    us = asyncio.run(measure(args.requests))
    print(f"\n{args.requests} requests per setting in {BATCHES} interleaved batches, 16 endpoints, 4 KB prompts\n")
    print("| --emit-endpoint-scores | Python CPU µs / request (min batch) | vs off |")
    print("|---|---|---|")
    for emit, value in us.items():
        print(f"| {emit or 'off'} | {value:.0f} | {value / us[None]:.3f} |")


if __name__ == "__main__":
    main()
