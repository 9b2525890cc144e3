"""Throughput of the vLLM simulator: closed-loop aiohttp clients against a fleet of replicas.

Usage: ``python bench/sim_throughput.py [--replicas 8] [--processes 1,2] [--concurrency 64]
[--duration 10] [--stream]``. Prints one table row per fleet layout: requests/s, latency
percentiles and errors. The simulator uses the ``fast`` profile, so request latency is mostly
the machine's own HTTP cost; the number says how much load the simulator can absorb before it,
rather than the router under test, becomes the bottleneck. The last column sums the replicas'
clock resyncs (/sim/state): 0 means every simulated step kept its planned timing.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import statistics
import time

import aiohttp

from epp.engine.sim import FleetConfig, SimFleet

PROMPTS = [
    f"System: you answer questions about table {t}. User: select the customer invoices of order {i} please."
    for t in range(8) for i in range(32)
]


async def _worker(session: aiohttp.ClientSession, urls: itertools.cycle, prompts: itertools.cycle,
                  deadline: float, lat: list[float], errors: list[int], stream: bool, max_tokens: int) -> None:
    while time.perf_counter() < deadline:
        url = next(urls)
        body = {"prompt": next(prompts), "max_tokens": max_tokens, "stream": stream}
        t = time.perf_counter()
        try:
            async with session.post(url, json=body) as resp:
                await resp.read()
                if resp.status != 200:
                    errors[0] += 1
                    continue
        except aiohttp.ClientError:
            errors[0] += 1
            continue
        lat.append(time.perf_counter() - t)


async def measure(fleet: SimFleet, concurrency: int, duration: float, stream: bool, max_tokens: int) -> dict:
    """Run closed-loop clients for `duration` seconds; returns rate and latency stats."""
    urls = itertools.cycle([f"http://{e}/v1/completions" for e in fleet.endpoints])
    prompts = itertools.cycle(PROMPTS)
    lat: list[float] = []
    errors = [0]
    conn = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=conn) as session:
        warm = time.perf_counter() + 1.0  # open connections, warm caches; not counted
        await asyncio.gather(*(_worker(session, urls, prompts, warm, [], [0], stream, max_tokens)
                               for _ in range(concurrency)))
        start = time.perf_counter()
        await asyncio.gather(*(_worker(session, urls, prompts, start + duration, lat, errors, stream, max_tokens)
                               for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
        lag = 0
        for e in fleet.endpoints:
            async with session.get(f"http://{e}/sim/state") as resp:
                lag += (await resp.json())["lag_resyncs"]
    lat.sort()
    q = statistics.quantiles(lat, n=100) if len(lat) > 1 else [0.0] * 99
    return {"rps": len(lat) / elapsed, "n": len(lat), "errors": errors[0], "p50_ms": q[49] * 1e3,
            "p99_ms": q[98] * 1e3, "lag_resyncs": lag}


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--processes", default="1,2", help="comma list of fleet process counts to try")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--stream", action="store_true", help="SSE streaming requests")
    parser.add_argument("--time-scale", type=float, default=1.0, help="wall seconds per simulated second")
    args = parser.parse_args()
    rows = []
    for procs in [int(p) for p in args.processes.split(",")]:
        # The fleet always runs in worker processes of its own, apart from the load clients.
        config = FleetConfig(replicas=args.replicas, processes=procs, profile="fast", time_scale=args.time_scale)
        async with SimFleet(config) as fleet:
            r = await measure(fleet, args.concurrency, args.duration, args.stream, args.max_tokens)
        rows.append((procs, r))
    print(f"\nsimulator throughput: {args.replicas} replicas, profile fast, max_tokens {args.max_tokens}, "
          f"{'SSE' if args.stream else 'JSON'}, concurrency {args.concurrency}, {args.duration:g} s, "
          f"time scale {args.time_scale:g}")
    print(f"{'fleet processes':>15} | {'req/s':>8} | {'p50 ms':>7} | {'p99 ms':>7} | {'requests':>8} | {'errors':>6} | "
          "clock resyncs")
    print("-" * 84)
    for procs, r in rows:
        print(f"{procs:>15} | {r['rps']:>8.0f} | {r['p50_ms']:>7.1f} | {r['p99_ms']:>7.1f} | {r['n']:>8} | "
              f"{r['errors']:>6} | {r['lag_resyncs']}")
    print("clock resyncs: times a replica's simulated clock fell > 50 ms behind the wall clock (0: the "
          "simulator kept its timing; otherwise raise --time-scale)")


if __name__ == "__main__":
    asyncio.run(main())
