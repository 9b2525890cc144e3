"""Overhead of the picker: Envoy → EPP → backend against Envoy → backend round-robin, in one run.

Starts N tiny HTTP backends (one process), the picker (`epp serve`, its own process, default
config: queue + kv-cache + prefix scorers, metrics scraped every 50 ms), the minimal picker
(`bench/minimal_picker.py`: a bare grpc.aio servicer routing at random, its own process), three
Envoys (through the picker, through the minimal picker, and plain round-robin) and drives all
with the same client: latency at concurrency 1 (p50/p99, added = through a picker minus
direct; the three paths take turns in rounds so a busy moment of the machine hits all alike)
and throughput at concurrency C. Each picker's CPU time (/proc, all threads) is read around its
own latency turns: CPU per request through real Envoy, which a busy machine disturbs far less
than latency (the picker's background work, such as scraping, counts in it).

    python bench/overhead.py --endpoints 16 --prompt-bytes 4096
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
from aiohttp import web
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from epp.envoy import RESPONSE_MODES, EnvoyProcess, render_config  # noqa: E402
from epp.netutil import free_ports  # noqa: E402

METRICS_TEXT = (
    "# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{model_name=\"m\"} 0.0\n"
    "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{model_name=\"m\"} 1.0\n"
    "# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{model_name=\"m\"} 0.1\n"
)


def _backends_main(ports: list[int]) -> None:
    async def completion(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response({"id": "x", "object": "text_completion", "model": "m",
                                  "choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}],
                                  "usage": {"prompt_tokens": 1000, "completion_tokens": 1}})

    async def metrics(_request: web.Request) -> web.Response:
        return web.Response(text=METRICS_TEXT)

    async def run() -> None:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/completions", completion)
        app.router.add_get("/metrics", metrics)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        for port in ports:
            await web.TCPSite(runner, "127.0.0.1", port).start()
        await asyncio.Event().wait()

    asyncio.run(run())


async def _wait_http(url: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            try:
                async with session.get(url) as resp:
                    if resp.status < 500:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.2)
    raise TimeoutError(url)


async def _latency(url: str, body: bytes, n: int, label: str) -> list[float]:
    out = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as session:
        for _ in tqdm(range(n), desc=f"latency {label}", leave=False):
            t0 = time.perf_counter()
            async with session.post(url, data=body, headers={"content-type": "application/json"}) as resp:
                await resp.read()
                assert resp.status == 200, resp.status
            out.append(time.perf_counter() - t0)
    return out


async def _throughput(url: str, body: bytes, concurrency: int, seconds: float) -> tuple[float, int]:
    done = errors = 0
    stop_at = time.monotonic() + seconds

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal done, errors
        while time.monotonic() < stop_at:
            async with session.post(url, data=body, headers={"content-type": "application/json"}) as resp:
                await resp.read()
                if resp.status == 200:
                    done += 1
                else:
                    errors += 1

    t0 = time.monotonic()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as session:
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
    return done / (time.monotonic() - t0), errors


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process (all its threads), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


PATHS = (("direct", "Envoy → backend (round-robin)"), ("minimal", "Envoy → minimal picker → backend"),
         ("epp", "Envoy → EPP → backend"))


async def run(args: argparse.Namespace) -> dict:
    ports = free_ports(args.endpoints + 10)
    backend_ports, (grpc, health, metrics, minimal, l_epp, a_epp, l_min, a_min, l_rr, a_rr) = \
        ports[:args.endpoints], ports[args.endpoints:]
    endpoints = [f"127.0.0.1:{p}" for p in backend_ports]
    backends = multiprocessing.get_context("spawn").Process(target=_backends_main, args=(backend_ports,), daemon=True)
    backends.start()
    epp = subprocess.Popen(
        [sys.executable, "-m", "epp.cli", "serve", "--grpc-port", str(grpc), "--grpc-health-port", str(health),
         "--metrics-port", str(metrics), "--bind-address", "127.0.0.1", "--endpoints", ",".join(endpoints),
         *args.epp_arg],
        start_new_session=True)
    picker = subprocess.Popen([sys.executable, str(Path(__file__).with_name("minimal_picker.py")), str(minimal),
                               ",".join(endpoints)], start_new_session=True)
    envoys = {
        "epp": EnvoyProcess(render_config(listen_port=l_epp, admin_port=a_epp, epp_port=grpc,
                                          responses=args.responses), a_epp),
        "minimal": EnvoyProcess(render_config(listen_port=l_min, admin_port=a_min, epp_port=minimal,
                                              responses=args.responses), a_min),
        "direct": EnvoyProcess(render_config(listen_port=l_rr, admin_port=a_rr, round_robin_backends=endpoints), a_rr),
    }
    listen = {"epp": l_epp, "minimal": l_min, "direct": l_rr}
    try:
        await _wait_http(f"http://127.0.0.1:{backend_ports[0]}/metrics")
        await _wait_http(f"http://127.0.0.1:{metrics}/metrics")
        for envoy in envoys.values():
            await envoy.start()
        prompt = ("The quick brown fox jumps over the lazy dog. " * (args.prompt_bytes // 45 + 1))[:args.prompt_bytes]
        body = json.dumps({"model": "m", "prompt": prompt, "max_tokens": 1}).encode()
        urls = {label: f"http://127.0.0.1:{listen[label]}/v1/completions" for label, _ in PATHS}
        latencies: dict[str, list[float]] = {label: [] for label, _ in PATHS}
        pickers = {"epp": epp.pid, "minimal": picker.pid}
        cpu = dict.fromkeys(pickers, 0.0)
        for label, _ in PATHS:
            await _latency(urls[label], body, 50, label + " warm-up")
        rounds = max(1, min(args.rounds, args.requests))
        for r in range(rounds):
            for label, _ in PATHS:
                # The picker's CPU (all threads) while its own path is driven: robust to a busy machine.
                pid = pickers.get(label)
                before = _cpu_seconds(pid) if pid else 0.0
                latencies[label] += await _latency(urls[label], body, args.requests // rounds, f"{label} {r + 1}/{rounds}")
                if pid:
                    cpu[label] += _cpu_seconds(pid) - before
        results = {}
        for label, _ in PATHS:
            lat = latencies[label]
            rps, errors = await _throughput(urls[label], body, args.concurrency, args.seconds) \
                if args.seconds > 0 else (0.0, 0)
            results[label] = {"picker_cpu_us": cpu[label] / len(lat) * 1e6 if label in cpu else 0.0,
                              "p50_ms": _pct(lat, 0.5) * 1e3, "p99_ms": _pct(lat, 0.99) * 1e3,
                              "mean_ms": statistics.fmean(lat) * 1e3, "rps": rps, "errors": errors}
        return results
    finally:
        for envoy in envoys.values():
            await envoy.stop()
        for proc in (epp, picker):
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(15)
        backends.terminate()
        backends.join(5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--endpoints", type=int, default=16)
    parser.add_argument("--prompt-bytes", type=int, default=4096)
    parser.add_argument("--requests", type=int, default=1000, help="sequential requests for latency")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=10.0, help="duration of the throughput run")
    parser.add_argument("--responses", choices=RESPONSE_MODES, default="full",
                        help="how much of each response Envoy shows the pickers (`epp envoy-config --responses`)")
    parser.add_argument("--request-only", dest="responses", action="store_const", const="none",
                        help="the same as --responses none")
    parser.add_argument("--rounds", type=int, default=10,
                        help="latency is measured in this many turns of the three paths")
    parser.add_argument("--epp-arg", action="append", default=[], help="extra argument for `epp serve`")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    res = asyncio.run(run(args))
    d = res["direct"]
    mode = {"full": "all phases", "headers": "request phases and response headers",
            "none": "request phases only"}[args.responses]
    print(f"\n{args.endpoints} endpoints, {args.prompt_bytes}-byte prompts, {mode}, {args.requests} sequential "
          f"requests per path in {args.rounds} rounds, concurrency {args.concurrency} for {args.seconds:.0f}s\n")
    print(f"| path | p50 ms | p99 ms | added p50 ms | added p99 ms | picker CPU µs / request | "
          f"req/s (c={args.concurrency}) | errors |")
    print("|---|---|---|---|---|---|---|---|")
    for label, title in PATHS:
        r = res[label]
        added = "" if label == "direct" else f"{r['p50_ms'] - d['p50_ms']:.2f} | {r['p99_ms'] - d['p99_ms']:.2f}"
        picker_cpu = f"{r['picker_cpu_us']:.0f}" if label != "direct" else ""
        print(f"| {title} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | {added or ' | '} | {picker_cpu} | {r['rps']:.0f} | "
              f"{r['errors']} |")
    m, e = res["minimal"], res["epp"]
    ratios = [(e[k] - d[k]) / (m[k] - d[k]) if m[k] > d[k] else float("nan") for k in ("p50_ms", "p99_ms")]
    print(f"\n**added by the EPP / added by the minimal picker: p50 {ratios[0]:.2f}×, p99 {ratios[1]:.2f}×** "
          f"(target ≤ 1.1×); picker CPU per request {e['picker_cpu_us'] / m['picker_cpu_us']:.2f}× the minimal one's")
    if args.json:
        res["ratio_p50"], res["ratio_p99"] = ratios
        args.json.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
