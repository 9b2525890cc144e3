"""Fuzz an `epp serve` process with 100,000+ seeded random ext_proc streams; report outcomes and RSS.

    python bench/fuzz.py                         # 100,000 streams, seed 18
    python bench/fuzz.py --streams 5000 --seed 3

The picker runs as its own process (so its RSS is its own), with the prefix producers and
scorers configured, scraping four loopback `/metrics` pages shaped like vLLM's. The streams are
the CI fuzz test's (tests/fuzz; both run bench/support/fuzz_harness.py): valid and invalid phase
orders, bodies split at random bytes, hostile headers, non-UTF-8, deep nesting, huge numbers and
strings, wrong field types, cancellations, idle streams, garbage protobuf and hostile response
bodies, every invariant checked per stream. Prints a markdown table of outcome counts and the server's RSS and open
file descriptors after start, after a warm-up and at the end; exits 1 on any violation.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import grpc  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402

from bench.support.fuzz_harness import PREFIX_CONFIG, Fuzzer, Target  # noqa: E402
from bench.support.metrics_server import MetricsServer  # noqa: E402
from bench.support.vllm_page import VllmState, vllm_metrics_page  # noqa: E402
from epp.netutil import free_ports  # noqa: E402

IDLE_TIMEOUT_S = 2.0
WARMUP_STREAMS = 2_000


def process_usage(pid: int) -> tuple[float, int]:
    """(RSS in MiB, open file descriptors) of a process."""
    with open(f"/proc/{pid}/status") as fh:
        rss_kb = next(int(line.split()[1]) for line in fh if line.startswith("VmRSS:"))
    return rss_kb / 1024, len(os.listdir(f"/proc/{pid}/fd"))


async def wait_serving(port: int, proc: subprocess.Popen, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"epp serve exited with {proc.returncode}")
            try:
                reply = await stub.Check(health_pb2.HealthCheckRequest(service="readiness"), timeout=1)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.aio.AioRpcError:
                pass
            await asyncio.sleep(0.2)
    raise TimeoutError("epp serve not SERVING")


async def main_async(args: argparse.Namespace) -> int:
    pages = [VllmState(waiting=i, running=2, kv_usage=0.1 * (i + 1)) for i in range(4)]
    backends = [await MetricsServer(vllm_metrics_page(state)).start() for state in pages]
    pool = tuple(b.hostport for b in backends)
    grpc_port, health_port, metrics_port = free_ports(3)
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as cfg:
        cfg.write(PREFIX_CONFIG)
    command = [sys.executable, "-m", "epp.cli", "serve", "--bind-address", "127.0.0.1",
               "--grpc-port", str(grpc_port), "--grpc-health-port", str(health_port),
               "--metrics-port", str(metrics_port), "--endpoints", ",".join(pool),
               "--config-file", cfg.name, "--stream-idle-timeout", str(IDLE_TIMEOUT_S)]
    log_path = Path(tempfile.gettempdir()) / f"epp-fuzz-{os.getpid()}.log"
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, cwd=REPO)
    rows: list[tuple[str, float, int]] = []
    try:
        await wait_serving(health_port, proc)
        rows.append(("after start", *process_usage(proc.pid)))
        target = Target(grpc_port, health_port, metrics_port, pool, IDLE_TIMEOUT_S)
        warm = Fuzzer(target, seed=args.seed + 1_000_003, concurrency=args.concurrency)
        warm_report = await warm.run(WARMUP_STREAMS)
        await warm.close()
        rows.append((f"after {WARMUP_STREAMS:,}-stream warm-up", *process_usage(proc.pid)))

        began = time.monotonic()

        def progress(done: int, report) -> None:
            if done % 10_000 == 0:
                rss, fds = process_usage(proc.pid)
                if done % 50_000 == 0 and done != args.streams:
                    rows.append((f"after {done:,} streams", rss, fds))
                print(f"  {done:>7,} streams  {time.monotonic() - began:5.0f} s  violations {len(report.violations)}  "
                      f"rss {rss:.1f} MiB  fds {fds}", flush=True)

        fuzzer = Fuzzer(target, seed=args.seed, concurrency=args.concurrency)
        report = await fuzzer.run(args.streams, progress=progress)
        await fuzzer.close()
        rows.append((f"after {args.streams:,} streams", *process_usage(proc.pid)))
        alive = proc.poll() is None
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
        for b in backends:
            await b.stop()
        os.unlink(cfg.name)
    violations = warm_report.violations + report.violations
    log_lines = log_path.read_text(errors="replace").splitlines()
    tracebacks = sum(1 for line in log_lines if line.startswith("Traceback"))
    print(f"\n`python bench/fuzz.py --streams {args.streams} --seed {args.seed}`: {report.streams:,} streams in "
          f"{report.elapsed_s:.0f} s ({report.streams / report.elapsed_s:.0f}/s), concurrency {args.concurrency}, "
          f"server alive at the end: {alive}, violations: {len(violations)}, slowest answer "
          f"{report.slowest_answer_s:.2f} s, server checks (health + /metrics): {report.health_checks}, "
          f"server log: {len(log_lines)} lines, {tracebacks} tracebacks\n")
    print("| outcome | streams |\n|---|---:|")
    for outcome, count in sorted(report.outcomes.items(), key=lambda kv: (-kv[1], kv[0])):
        print(f"| {outcome} | {count:,} |")
    print("\n| picker process | RSS (MiB) | open fds |\n|---|---:|---:|")
    for label, rss, fds in rows:
        print(f"| {label} | {rss:.1f} | {fds} |")
    # The server's log at its default level, one row per distinct message (timestamps dropped).
    messages = Counter(line.split(" ", 2)[2] if line[:4].isdigit() and line.count(" ") >= 2 else line
                       for line in log_lines)
    print("\n| server log line (default level) | times |\n|---|---:|")
    for message, count in messages.most_common(10):
        print(f"| {message[:160]} | {count} |")
    for violation in violations[:20]:
        print("VIOLATION", violation)
    if args.json:
        Path(args.json).write_text(json.dumps({
            "streams": report.streams, "seed": args.seed, "elapsed_s": report.elapsed_s,
            "outcomes": dict(report.outcomes), "violations": violations, "rss_fds": rows,
            "slowest_answer_s": report.slowest_answer_s, "alive": alive, "log_lines": len(log_lines),
            "tracebacks": tracebacks}, indent=1))
    log_path.unlink()
    return 0 if alive and not violations else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=100_000)
    parser.add_argument("--seed", type=int, default=18)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--json", help="also write the results here")
    # SIGTERM unwinds like Ctrl-C, so the picker process this started is stopped too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    return asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
