"""CPU cost of one routed request inside the picker process, against a do-nothing ext_proc floor.

A gRPC client (its own process) plays Envoy: per request one ext_proc stream with request
headers + a 4 KB JSON body, and (full mode) response headers + body. The server's CPU time
(/proc/<pid>/stat, all threads) is read around N requests at concurrency C, so the number does
not depend on what else runs on the machine. Three servers in the same run:
  floor        a grpc.aio servicer that answers each phase with an empty message (on uvloop)
  epp full     `epp serve` (default config: queue + kv-cache + approximate prefix), all phases
  epp request  the same picker with Envoy's request-only mode (no response phases)

    python bench/extproc_cpu.py --requests 3000
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


def _headers(pairs) -> base_pb2.HeaderMap:
    return base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs])


def _messages(full: bool) -> tuple[list[pb.ProcessingRequest], list[pb.ProcessingRequest]]:
    body = json.dumps({"model": "m", "prompt": ("The quick brown fox jumps over the lazy dog. " * 92)[:4096]})
    request = [
        pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=_headers(
            [(":method", "POST"), (":path", "/v1/completions"), ("content-type", "application/json"),
             ("x-request-id", "r")]))),
        pb.ProcessingRequest(request_body=pb.HttpBody(body=body.encode(), end_of_stream=True)),
    ]
    response = [
        pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=_headers(
            [(":status", "200"), ("content-type", "application/json")]))),
        pb.ProcessingRequest(response_body=pb.HttpBody(
            body=b'{"usage":{"prompt_tokens":900,"completion_tokens":1}}', end_of_stream=True)),
    ] if full else []
    return request, response


async def _drive(port: int, n: int, concurrency: int, full: bool) -> float:
    request, response = _messages(full)
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


def _measure(argv: list[str], port: int, n: int, concurrency: int, full: bool) -> dict:
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                asyncio.run(_drive(port, 50, 4, full))  # warm-up, and proof the server is up
                break
            except grpc.aio.AioRpcError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        before = _cpu_seconds(proc.pid)
        rps = asyncio.run(_drive(port, n, concurrency, full))
        cpu = _cpu_seconds(proc.pid) - before
        return {"cpu_us_per_request": cpu / n * 1e6, "requests_per_cpu_second": n / cpu, "rps_here": rps}
    finally:
        proc.terminate()
        proc.wait(10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=16)
    args = parser.parse_args()
    port, health, metrics = free_ports(3)
    epp = [sys.executable, "-m", "epp.cli", "serve", "--grpc-port", str(port), "--grpc-health-port", str(health),
           "--metrics-port", str(metrics), "--bind-address", "127.0.0.1",
           "--endpoints", ",".join(f"127.0.0.1:{8000 + i}" for i in range(16)),
           # No model servers listen here; scraping them would only add failed connects.
           "--refresh-metrics-interval", "3600"]
    rows = [
        ("floor: empty grpc.aio servicer, all phases", [sys.executable, "-c", FLOOR_SERVER, str(port)], True),
        ("epp serve, all phases", epp, True),
        ("floor: empty grpc.aio servicer, request phases", [sys.executable, "-c", FLOOR_SERVER, str(port)], False),
        ("epp serve, request-only Envoy mode", epp, False),
    ]
    results = []
    for label, argv, full in rows:
        print(f"measuring {label} ...", file=sys.stderr, flush=True)
        results.append((label, _measure(argv, port, args.requests, args.concurrency, full)))
    print(f"\n{args.requests} requests at concurrency {args.concurrency}, 16 endpoints, 4 KB prompts\n")
    print("| server | CPU µs / request | routed requests per CPU-second |")
    print("|---|---|---|")
    for label, r in results:
        print(f"| {label} | {r['cpu_us_per_request']:.0f} | {r['requests_per_cpu_second']:.0f} |")


if __name__ == "__main__":
    main()
