"""Cost of the data layer: parsing vLLM `/metrics` pages, and scraping N endpoints at an interval.

    python bench/scrape_bench.py                      # parse table + scrape table (16, 64, 256)
    python bench/scrape_bench.py --endpoints 64 --interval 0.05 --seconds 5
    python bench/scrape_bench.py --before /tmp/epp-before --repeat 3   # CPU per scrape, before vs now

The `/metrics` servers run in a child process (one aiohttp app on N loopback ports) so the
numbers are the scraper's alone: achieved scrapes/s, scrape latency, CPU share of one core,
and event-loop lag (how late a 5 ms ticker wakes up, the stall other work would see). The
scraper runs on uvloop when it is installed, as `epp serve` does. With `--before DIR`, the scrape
table is measured for this checkout and DIR's in separate processes taking turns, `--repeat`
times, and the least CPU per scrape of each is compared (other tenants only ever add CPU time).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

# The checkout whose scraper is measured: this one, or (for --before) the one the parent names;
# the harness's own page (bench/support) comes from this checkout when that one has none.
_HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path[:0] = [os.environ.get("EPP_BENCH_CHECKOUT") or _HERE, _HERE]

from prometheus_client import CollectorRegistry  # noqa: E402

from bench.support.vllm_page import VllmState, vllm_metrics_page  # noqa: E402
from epp.datalayer.promparse import parse_vllm_metrics  # noqa: E402
from epp.datalayer.registry import EndpointRegistry, EndpointSpec  # noqa: E402
from epp.datalayer.scraper import MetricsScraper  # noqa: E402


def bench_parse() -> list[dict]:
    rows = []
    for engines in (1, 4, 16, 32):
        page = vllm_metrics_page(VllmState(engines=engines, waiting=3, kv_usage=0.4,
                                           lora=[("a,b", "c", 4, 1.7e9)])).encode()
        runs = max(20, 2_000_000 // len(page))
        t0 = time.perf_counter()
        for _ in range(runs):
            parse_vllm_metrics(page)
        per = (time.perf_counter() - t0) / runs
        rows.append({"engines": engines, "page_kb": round(len(page) / 1024, 1),
                     "parse_us": round(per * 1e6, 1), "mb_per_s": round(len(page) / per / 1e6, 1)})
    return rows


def _serve(count: int, page: str, ports, ready) -> None:
    from aiohttp import web

    async def main() -> None:
        async def metrics(request: web.Request) -> web.Response:
            return web.Response(text=page, content_type="text/plain")

        app = web.Application()
        app.router.add_get("/metrics", metrics)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        for _ in range(count):
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            ports.append(site._server.sockets[0].getsockname()[1])
        ready.set()
        await asyncio.Event().wait()

    asyncio.run(main())


async def _measure(ports: list[int], interval: float, seconds: float) -> dict:
    registry = EndpointRegistry()
    registry.set_endpoints(EndpointSpec("127.0.0.1", port) for port in ports)
    metrics = CollectorRegistry()
    lags: list[float] = []
    stop = asyncio.Event()

    async def ticker() -> None:
        loop = asyncio.get_running_loop()
        while not stop.is_set():
            t = loop.time()
            await asyncio.sleep(0.005)
            lags.append(loop.time() - t - 0.005)

    async with MetricsScraper(registry, interval=interval, metrics_registry=metrics) as scraper:
        await asyncio.sleep(1.0)  # warm up: connections open, first phase spread
        count0 = metrics.get_sample_value("epp_metrics_scrape_duration_seconds_count") or 0
        sum0 = metrics.get_sample_value("epp_metrics_scrape_duration_seconds_sum") or 0
        cpu0, wall0 = time.process_time(), time.perf_counter()
        tick = asyncio.create_task(ticker())
        await asyncio.sleep(seconds)
        stop.set()
        await tick
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
        count = (metrics.get_sample_value("epp_metrics_scrape_duration_seconds_count") or 0) - count0
        total = (metrics.get_sample_value("epp_metrics_scrape_duration_seconds_sum") or 0) - sum0
        effective = scraper.effective_interval()
        errors = sum(s.value for fam in metrics.collect() for s in fam.samples
                     if s.name == "epp_metrics_scrape_errors_total")
    lags.sort()
    return {
        "endpoints": len(ports), "interval_ms": interval * 1e3,
        "effective_interval_ms": round(effective * 1e3, 1),
        "target_per_s": round(len(ports) / effective),
        "scrapes_per_s": round(count / wall),
        "mean_scrape_ms": round(total / count * 1e3, 2) if count else None,
        "cpu_core_share": round(cpu / wall, 2),
        "loop_lag_p50_ms": round(statistics.median(lags) * 1e3, 2),
        "loop_lag_p99_ms": round(lags[int(len(lags) * 0.99)] * 1e3, 2),
        "loop_lag_max_ms": round(lags[-1] * 1e3, 2), "errors": int(errors),
    }


def bench_scrape(count: int, interval: float, seconds: float) -> dict:
    page = vllm_metrics_page(VllmState(waiting=3, kv_usage=0.4))
    ctx = multiprocessing.get_context("spawn")
    manager = ctx.Manager()
    ports, ready = manager.list(), manager.Event()
    server = ctx.Process(target=_serve, args=(count, page, ports, ready), daemon=True)
    server.start()
    try:
        if not ready.wait(30):
            raise RuntimeError("metrics servers did not start")
        try:
            import uvloop
        except ImportError:
            return asyncio.run(_measure(list(ports), interval, seconds))
        return uvloop.run(_measure(list(ports), interval, seconds))
    finally:
        server.terminate()
        server.join(5)
        manager.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--endpoints", type=int, nargs="*", default=[16, 64, 256])
    parser.add_argument("--interval", type=float, default=0.05)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--json", action="store_true", help="print JSON rows only")
    parser.add_argument("--before", type=Path, help="compare with the scraper of this checkout (e.g. a git worktree)")
    parser.add_argument("--repeat", type=int, default=1, help="with --before: runs of each, taking turns")
    args = parser.parse_args()
    if args.before is not None:
        compare(args)
        return
    parse_rows = bench_parse()
    scrape_rows = [bench_scrape(n, args.interval, args.seconds) for n in args.endpoints]
    if args.json:
        print(json.dumps({"parse": parse_rows, "scrape": scrape_rows}))
        return
    for title, rows in (("parse", parse_rows), ("scrape", scrape_rows)):
        print(f"\n{title}")
        keys = list(rows[0])
        print(" | ".join(keys))
        for row in rows:
            print(" | ".join(str(row[k]) for k in keys))


def _scrape_rows(checkout: Path, endpoints: int, args: argparse.Namespace) -> dict:
    """The scrape row of `checkout`'s scraper under this harness, run in a process of its own."""
    out = subprocess.run([sys.executable, __file__, "--json", "--endpoints", str(endpoints), "--interval",
                          str(args.interval), "--seconds", str(args.seconds)],
                         cwd=checkout, env={**os.environ, "EPP_BENCH_CHECKOUT": str(checkout)},
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out)["scrape"][0]


def compare(args: argparse.Namespace) -> None:
    """CPU µs per scrape of this checkout against `--before`, the least of `--repeat` runs each."""
    here = Path(__file__).resolve().parents[1]
    print(f"scraping at {args.interval * 1e3:g} ms, {args.seconds:g} s per run, least of {args.repeat} runs\n")
    print("| endpoints | scrapes/s before | now | CPU µs per scrape before | now | now / before |")
    print("|---:|---:|---:|---:|---:|---:|")
    for n in args.endpoints:
        best: dict[str, dict] = {}
        for run in range(args.repeat):
            for label, checkout in (("before", args.before.resolve()), ("now", here)):
                print(f"  {n} endpoints, {label}, run {run + 1}/{args.repeat} ...", file=sys.stderr, flush=True)
                row = _scrape_rows(checkout, n, args)
                row["cpu_us"] = row["cpu_core_share"] / row["scrapes_per_s"] * 1e6
                if label not in best or row["cpu_us"] < best[label]["cpu_us"]:
                    best[label] = row
        b, a = best["before"], best["now"]
        print(f"| {n} | {b['scrapes_per_s']} | {a['scrapes_per_s']} | {b['cpu_us']:.0f} | {a['cpu_us']:.0f} "
              f"| {a['cpu_us'] / b['cpu_us']:.2f}x |")


if __name__ == "__main__":
    main()
