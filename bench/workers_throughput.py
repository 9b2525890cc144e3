"""Routed requests per second of `epp serve --workers N` against N = 1, measured in one run.

A load client (a separate process, many gRPC connections so that the kernel spreads them over
the workers) drives ext_proc streams straight at the picker as Envoy would send them (request
headers, a ~4 KB body of one of 64 tenants' prompts; the picker's two replies), closed-loop at a fixed concurrency, for a fixed
time per row. 16 static endpoints, GIE's default pipeline, no scraping (the endpoints are not
reachable; the scrapers back off). Reported per row: routed requests/s, the picker's CPU (the
supervisor and every worker, from /proc) in cores and per request, and the client's CPU in cores
(on a machine with few cores the client competes with the workers: read the ratio with it).

Run: `python bench/workers_throughput.py [--workers 1,2] [--seconds 10] [--concurrency 32]`
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import resource
import signal
import subprocess
import sys
import time

import grpc

from epp.netutil import free_ports

ENDPOINTS = ",".join(f"127.0.0.1:{20000 + i}" for i in range(16))
CLK_TCK = os.sysconf("SC_CLK_TCK")


def _tree_cpu_s(root: int) -> float:
    """CPU seconds (user + system) of a process and its live children."""
    total = 0.0
    pids = [root]
    try:
        with open(f"/proc/{root}/task/{root}/children") as fh:
            pids += [int(p) for p in fh.read().split()]
    except OSError:
        pass
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / CLK_TCK
        except OSError:
            continue
    return total


def _client(port: int, seconds: float, concurrency: int, connections: int, out: multiprocessing.Queue) -> None:
    """The load client process: closed-loop streams for `seconds`; puts (requests, errors, cpu_s)."""
    from envoy.config.core.v3 import base_pb2
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

    headers = [(":method", "POST"), (":path", "/v1/completions"), ("content-type", "application/json"),
               ("x-request-id", "r")]
    header_message = pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in headers])))
    # 64 tenants, each a ~3.5 KB system prompt of its own, and 8 questions each: prefixes shared
    # within a tenant as in real traffic (one prompt for everything would put every block on every
    # endpoint and measure only the prefix index's worst case).
    bodies = []
    for tenant in range(64):
        system = f"Tenant {tenant:03d}. " + ("The quick brown fox jumps over the lazy dog. " * 80)
        for question in range(8):
            body = json.dumps({"model": "m", "prompt": f"{system} Question {question}: what now?"})
            bodies.append(pb.ProcessingRequest(request_body=pb.HttpBody(body=body.encode(), end_of_stream=True)))

    async def run() -> tuple[int, int]:
        channels = [grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1)])
                    for _ in range(connections)]
        from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

        stubs = [pb_grpc.ExternalProcessorStub(ch) for ch in channels]
        done = errors = 0
        deadline = time.monotonic() + seconds

        async def loop(i: int) -> None:
            nonlocal done, errors
            stub = stubs[i % len(stubs)]
            while time.monotonic() < deadline:
                try:
                    call = stub.Process()
                    await call.write(header_message)
                    await call.write(bodies[(done + errors) % len(bodies)])
                    await call.read()
                    await call.read()
                    await call.done_writing()
                    done += 1
                except grpc.aio.AioRpcError:
                    errors += 1

        await asyncio.gather(*(loop(i) for i in range(concurrency)))
        for ch in channels:
            await ch.close()
        return done, errors

    start = resource.getrusage(resource.RUSAGE_SELF)
    done, errors = asyncio.run(run())
    end = resource.getrusage(resource.RUSAGE_SELF)
    out.put((done, errors, end.ru_utime - start.ru_utime + end.ru_stime - start.ru_stime))


def measure(row: str, seconds: float, concurrency: int) -> dict[str, float]:
    """`row`: a worker count, `N-nolink` for N workers without the peer link."""
    workers, _, variant = row.partition("-")
    extra = ["--no-worker-peer-link"] if variant == "nolink" else []
    grpc_port, health_port, metrics_port = free_ports(3)
    proc = subprocess.Popen(
        [sys.executable, "-m", "epp.cli", "serve", *extra, "--workers", workers, "--grpc-port", str(grpc_port),
         "--grpc-health-port", str(health_port), "--metrics-port", str(metrics_port), "--bind-address",
         "127.0.0.1", "--endpoints", ENDPOINTS, "--refresh-metrics-interval", "60", "--grace-period", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # the start line: every worker serves
        assert "ext_proc on" in line, line
        # Warm-up: connections made, code paths hot.
        ctx = multiprocessing.get_context("spawn")
        queue: multiprocessing.Queue = ctx.Queue()
        warm = ctx.Process(target=_client, args=(grpc_port, 1.0, concurrency, 16, queue))
        warm.start()
        queue.get()
        warm.join()
        cpu0, t0 = _tree_cpu_s(proc.pid), time.monotonic()
        client = ctx.Process(target=_client, args=(grpc_port, seconds, concurrency, 16, queue))
        client.start()
        done, errors, client_cpu = queue.get()
        client.join()
        wall = time.monotonic() - t0
        picker_cpu = _tree_cpu_s(proc.pid) - cpu0
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
    return {"workers": row, "rps": done / seconds, "errors": errors, "picker_cores": picker_cpu / wall,
            "picker_us_per_req": picker_cpu / max(1, done) * 1e6, "client_cores": client_cpu / seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", default="1,2,2-nolink",
                        help="rows in this order: worker counts, N-nolink = N workers without the peer link "
                             "(default 1,2,2-nolink)")
    parser.add_argument("--seconds", type=float, default=10.0, help="measured seconds per row (default 10)")
    parser.add_argument("--concurrency", type=int, default=32, help="streams in flight (default 32)")
    args = parser.parse_args()
    rows = [measure(n, args.seconds, args.concurrency) for n in args.workers.split(",")]
    print(f"## epp serve --workers N ({os.cpu_count()} CPUs, concurrency {args.concurrency}, "
          f"{args.seconds:g} s per row, 4 KB bodies, 16 endpoints)\n")
    print("| workers | routed req/s | vs first row | errors | picker CPU (cores) | picker CPU µs/request | "
          "client CPU (cores) |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    base = rows[0]["rps"] or 1.0
    for r in rows:
        print(f"| {r['workers']} | {r['rps']:,.0f} | {r['rps'] / base:.2f}x | {r['errors']} | "
              f"{r['picker_cores']:.2f} | {r['picker_us_per_req']:,.0f} | {r['client_cores']:.2f} |")


if __name__ == "__main__":
    main()
