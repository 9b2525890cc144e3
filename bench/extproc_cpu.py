"""CPU cost of one routed request inside the picker process, against a do-nothing ext_proc floor.

A gRPC client (its own process) plays Envoy: per request one ext_proc stream with request
headers + a 4 KB JSON body, then what the response mode sends (`epp envoy-config --responses`):
"full" response headers + body, "headers" response headers and the stream's close, "none"
nothing. The first message carries Envoy's `protocol_config`, as Envoy 1.40 sends it. The server's CPU time
(/proc/<pid>/stat, all threads) is read around N requests at concurrency C, so the number does
not depend on what else runs on the machine. Three servers in the same run:
  floor        a grpc.aio servicer that answers each phase with an empty message (on uvloop)
  minimal      `bench/minimal_picker.py`: routes at random and re-emits the bodies, the least a
               working picker sends in GIE's full-duplex body mode (the empty floor drops the body)
  epp serve    `epp serve` (default config: queue + kv-cache + approximate prefix)
Optional rows: `--sync-floor` adds the same empty servicer on grpc's sync server (thread pool),
`--before DIR` adds `epp serve` run from another checkout (e.g. `git worktree add DIR <commit>`),
`--epp-config FILE` (repeatable) adds `epp serve --config-file FILE`: with a config of only
`random-picker`, the row is the framework around any pipeline (transport, parsing, booking, metrics).
With `--repeat N` every row is measured N times, rows taking turns, and the minimum is shown
(other tenants of a shared machine only ever add CPU time). `--sse-chunks N` answers the
all-phases requests as a streamed completion of N token chunks (each an ext_proc message in and
out, as through Envoy): the difference to a run without it, divided by N, is the cost per chunk.

    python bench/extproc_cpu.py --requests 3000
    python bench/extproc_cpu.py --requests 2000 --repeat 3 --modes full,headers
    python bench/extproc_cpu.py --requests 2000 --repeat 3 --sync-floor --before /tmp/epp-before
    python bench/extproc_cpu.py --requests 300 --repeat 3 --sse-chunks 64
    python bench/extproc_cpu.py --requests 2000 --repeat 3 --modes headers --epp-config bench/random-picker.yaml
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from epp.netutil import free_ports  # noqa: E402

FLOOR_SERVER = """
import asyncio, grpc, sys, uvloop
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb, external_processor_pb2_grpc as pb_grpc
class Floor(pb_grpc.ExternalProcessorServicer):
    async def Process(self, it, ctx):
        while (req := await ctx.read()) is not grpc.aio.EOF:
            kind = req.WhichOneof("request")
            if kind == "request_body":
                await ctx.write(pb.ProcessingResponse(request_headers=pb.HeadersResponse()))
                await ctx.write(pb.ProcessingResponse(request_body=pb.BodyResponse()))
            elif kind == "response_headers":
                await ctx.write(pb.ProcessingResponse(response_headers=pb.HeadersResponse()))
            elif kind == "response_body":
                await ctx.write(pb.ProcessingResponse(response_body=pb.BodyResponse()))
async def main():
    server = grpc.aio.server(); pb_grpc.add_ExternalProcessorServicer_to_server(Floor(), server)
    server.add_insecure_port("127.0.0.1:" + sys.argv[1]); await server.start(); await server.wait_for_termination()
uvloop.run(main())
"""

# The same empty servicer on grpc's sync server: a thread pool instead of the asyncio loop.
SYNC_FLOOR_SERVER = """
import grpc, sys
from concurrent import futures
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb, external_processor_pb2_grpc as pb_grpc
class Floor(pb_grpc.ExternalProcessorServicer):
    def Process(self, it, ctx):
        for req in it:
            kind = req.WhichOneof("request")
            if kind == "request_body":
                yield pb.ProcessingResponse(request_headers=pb.HeadersResponse())
                yield pb.ProcessingResponse(request_body=pb.BodyResponse())
            elif kind == "response_headers":
                yield pb.ProcessingResponse(response_headers=pb.HeadersResponse())
            elif kind == "response_body":
                yield pb.ProcessingResponse(response_body=pb.BodyResponse())
server = grpc.server(futures.ThreadPoolExecutor(max_workers=32))
pb_grpc.add_ExternalProcessorServicer_to_server(Floor(), server)
server.add_insecure_port("127.0.0.1:" + sys.argv[1]); server.start(); server.wait_for_termination()
"""


def _headers(pairs) -> base_pb2.HeaderMap:
    return base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs])


def _sse_response(chunks: int) -> list[pb.ProcessingRequest]:
    """A streamed completion as vLLM sends it: one SSE event per token, then the usage and [DONE]."""
    def token(i: int) -> bytes:
        event = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",
                 "choices": [{"index": 0, "text": f" tok{i}", "logprobs": None, "finish_reason": None}]}
        return f"data: {json.dumps(event)}\n\n".encode()

    last = (b'data: {"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":[],'
            b'"usage":{"prompt_tokens":900,"completion_tokens":%d}}\n\ndata: [DONE]\n\n' % chunks)
    return ([pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=_headers(
                [(":status", "200"), ("content-type", "text/event-stream")])))]
            + [pb.ProcessingRequest(response_body=pb.HttpBody(body=token(i))) for i in range(chunks)]
            + [pb.ProcessingRequest(response_body=pb.HttpBody(body=last, end_of_stream=True))])


# What each `--responses` mode sends of a response, and how the tables name it.
MODES = {"full": "all phases", "headers": "request phases + response headers", "none": "request phases"}


def _messages(mode: str, sse_chunks: int = 0) -> tuple[list[pb.ProcessingRequest], list[pb.ProcessingRequest]]:
    """The request messages and the response messages of one stream in `mode` (a key of MODES)."""
    body = json.dumps({"model": "m", "prompt": ("The quick brown fox jumps over the lazy dog. " * 92)[:4096]})
    first = pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=_headers(
        [(":method", "POST"), (":path", "/v1/completions"), ("content-type", "application/json"),
         ("x-request-id", "r")])))
    first.protocol_config.request_body_mode = ProcessingMode.FULL_DUPLEX_STREAMED
    if mode == "full":
        first.protocol_config.response_body_mode = ProcessingMode.FULL_DUPLEX_STREAMED
    request = [first, pb.ProcessingRequest(request_body=pb.HttpBody(body=body.encode(), end_of_stream=True))]
    if mode == "none":
        return request, []
    if mode == "headers":
        return request, [pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=_headers(
            [(":status", "200"), ("content-type", "text/event-stream")])))]
    if sse_chunks:
        return request, _sse_response(sse_chunks)
    return request, [
        pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=_headers(
            [(":status", "200"), ("content-type", "application/json")]))),
        pb.ProcessingRequest(response_body=pb.HttpBody(
            body=b'{"usage":{"prompt_tokens":900,"completion_tokens":1}}', end_of_stream=True)),
    ]


async def _drive(port: int, n: int, concurrency: int, mode: str, sse_chunks: int = 0) -> float:
    request, response = _messages(mode, sse_chunks)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.ExternalProcessorStub(channel)
        remaining = n

        async def one() -> None:
            call = stub.Process()
            for msg in request:
                await call.write(msg)
            await call.read()
            await call.read()
            for msg in response:
                await call.write(msg)
                await call.read()
            await call.done_writing()

        async def worker() -> None:
            nonlocal remaining
            while remaining > 0:
                remaining -= 1
                await one()

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return n / (time.perf_counter() - t0)


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _measure(loop: asyncio.AbstractEventLoop, argv: list[str], port: int, n: int, concurrency: int, mode: str,
             cwd: Path = REPO, sse_chunks: int = 0) -> dict:
    proc = subprocess.Popen(argv, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                loop.run_until_complete(_drive(port, 50, 4, mode, sse_chunks))  # warm-up; the server is up
                break
            except grpc.aio.AioRpcError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise
                time.sleep(0.2)
        before = _cpu_seconds(proc.pid)
        rps = loop.run_until_complete(_drive(port, n, concurrency, mode, sse_chunks))
        cpu = _cpu_seconds(proc.pid) - before
        return {"cpu_us_per_request": cpu / n * 1e6, "requests_per_cpu_second": n / cpu, "rps_here": rps}
    finally:
        proc.terminate()
        proc.wait(10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=1, help="measure every row this many times; show the minimum")
    parser.add_argument("--sync-floor", action="store_true", help="also measure the floor on grpc's sync server")
    parser.add_argument("--before", type=Path, help="also measure `epp serve` run from this checkout")
    parser.add_argument("--epp-config", type=Path, action="append", default=[],
                        help="also measure `epp serve --config-file FILE` (repeatable)")
    parser.add_argument("--sse-chunks", type=int, default=0,
                        help="all phases: answer as a stream of this many SSE token chunks (one ext_proc message each)")
    parser.add_argument("--modes", default="full,none",
                        help=f"response modes to measure, comma-separated, of: {', '.join(MODES)} (default full,none)")
    args = parser.parse_args()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or not set(modes) <= set(MODES):
        parser.error(f"--modes takes a comma-separated list of {', '.join(MODES)}")
    port, health, metrics = free_ports(3)
    endpoints = ",".join(f"127.0.0.1:{8000 + i}" for i in range(16))
    epp = [sys.executable, "-m", "epp.cli", "serve", "--grpc-port", str(port), "--grpc-health-port", str(health),
           "--metrics-port", str(metrics), "--bind-address", "127.0.0.1",
           "--endpoints", endpoints,
           # No model servers listen here; scraping them would only add failed connects.
           "--refresh-metrics-interval", "3600"]
    floor = [sys.executable, "-c", FLOOR_SERVER, str(port)]
    minimal = [sys.executable, str(REPO / "bench" / "minimal_picker.py"), str(port), endpoints]
    sync_floor = [sys.executable, "-c", SYNC_FLOOR_SERVER, str(port)]
    rows: list[tuple[str, list[str], str, Path]] = []
    for mode in modes:
        phases = MODES[mode] + (f", {args.sse_chunks} SSE chunks" if args.sse_chunks and mode == "full" else "")
        rows.append((f"floor: empty grpc.aio servicer, {phases}", floor, mode, REPO))
        if args.sync_floor:
            rows.append((f"floor on grpc's sync server (thread pool), {phases}", sync_floor, mode, REPO))
        rows.append((f"minimal picker (routes at random, re-emits bodies), {phases}", minimal, mode, REPO))
        if args.before is not None:
            rows.append((f"epp serve from {args.before}, {phases}", epp, mode, args.before.resolve()))
        rows.append((f"epp serve, {phases}", epp, mode, REPO))
        for config in args.epp_config:
            rows.append((f"epp serve --config-file {config.name}, {phases}",
                         epp + ["--config-file", str(config.resolve())], mode, REPO))
    cpu: dict[str, list[float]] = {label: [] for label, *_ in rows}
    # One event loop for every measurement: grpc.aio's poller keeps calling into the loop it first
    # met, and one that asyncio.run closed makes it print tracebacks.
    loop = asyncio.new_event_loop()
    for round_ in range(args.repeat):
        for label, argv, mode, cwd in rows:
            print(f"measuring {label} ({round_ + 1}/{args.repeat}) ...", file=sys.stderr, flush=True)
            cpu[label].append(_measure(loop, argv, port, args.requests, args.concurrency, mode, cwd,
                                       args.sse_chunks)["cpu_us_per_request"])
    print(f"\n{args.requests} requests at concurrency {args.concurrency}, 16 endpoints, 4 KB prompts"
          f"{f', minimum of {args.repeat} runs' if args.repeat > 1 else ''}\n")
    print("| server | CPU µs / request | routed requests per CPU-second | × the floor of its mode "
          "| × the minimal picker |")
    print("|---|---|---|---|---|")
    floor_us = minimal_us = 0.0
    for label, argv, _mode, _cwd in rows:
        us = min(cpu[label])
        if argv is floor:  # each mode's rows start with its floor
            floor_us, minimal_us = us, 0.0
        if argv is minimal:
            minimal_us = us
        versus_minimal = f"{us / minimal_us:.2f}" if minimal_us else "–"
        print(f"| {label} | {us:.0f} | {1e6 / us:.0f} | {us / floor_us:.2f} | {versus_minimal} |")


if __name__ == "__main__":
    main()
