"""The KV index on Redis against the in-memory index, one run: event application, lookups, memory.

For each size (entries = (block, endpoint) pairs) and endpoint count, in a fresh process per
backend (the in-memory `InMemoryKVIndex`, then `RedisKVIndex` on a redis-server started here on
loopback, maxmemory 4 GB allkeys-lru, no persistence):
- apply: BlockStored events of 8 chained blocks of 16 tokens (msgpack-decoded beforehand), each
  applied for `--copies` endpoints (2: a key has two holders), in blocks/s. Redis: the picker's local part
  (engine map, queued writes) and end to end (until Redis has every entry: Lua writes of 2,000
  operations per call), with Redis's own CPU per block (INFO cpu);
- lookups of a 64-block prompt two endpoints hold 48 blocks of (hit) and of one nobody holds
  (miss): latency p50/p99 one at a time, and for Redis also lookups/s with 16 in flight, the
  picker's CPU per lookup then (the in-memory lookup's CPU is its latency) and Redis's;
- memory: the picker's RSS growth per entry (in-memory: the whole index; Redis: the writer's
  engine map) and Redis's used_memory growth per entry (INFO memory).

Run: `python bench/kv_index_redis.py --sizes 100000,1000000 --endpoints 4,64`
(needs redis-server on PATH: Debian's `redis-server` package).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import multiprocessing
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as `python bench/kv_index_redis.py` too

import msgspec  # noqa: E402

from bench.support.redis_server import RedisServer  # noqa: E402
from epp.kvevents.backend import InMemoryKVIndex  # noqa: E402
from epp.kvevents.decoding import decode_batch  # noqa: E402
from epp.kvevents.redis_index import RedisKVIndex  # noqa: E402

BLOCK = 16
BLOCKS_PER_EVENT = 8
PROMPT_BLOCKS = 64
IN_FLIGHT = 16
_encode = msgspec.msgpack.Encoder().encode


def _stored(hashes: list[int], tokens: list[int], parent: int | None):
    """A decoded vLLM batch with one map-form BlockStored event."""
    event = {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
             "block_size": BLOCK, "lora_id": None, "medium": "GPU", "lora_name": None, "group_idx": 0}
    return decode_batch(_encode([time.time(), [event], 0]))


def _batches(n_events: int, seed: int) -> list:
    """Chains of 8 events (64 blocks): a new prompt every 8 events."""
    rng = random.Random(seed)
    out = []
    for e in range(n_events):
        tokens = [rng.randrange(50_000) for _ in range(BLOCK * BLOCKS_PER_EVENT)]
        hashes = [(seed << 40) + e * BLOCKS_PER_EVENT + i for i in range(BLOCKS_PER_EVENT)]
        parent = None if e % 8 == 0 else (seed << 40) + e * BLOCKS_PER_EVENT - 1
        out.append(_stored(hashes, tokens, parent))
    return out


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def _redis_info(index: RedisKVIndex) -> tuple[float, float]:
    """Redis used_memory (bytes) and CPU seconds (user + sys) so far."""
    info = await index._redis.info("memory", "cpu")
    return float(info["used_memory"]), float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


async def _run(backend: str, size: int, n_endpoints: int, copies: int) -> dict:
    endpoints = [f"10.0.{i // 250}.{i % 250}:8000" for i in range(n_endpoints)]
    n_events = size // (BLOCKS_PER_EVENT * copies)
    batches = _batches(n_events, seed=1)
    server = None
    if backend == "redis":
        server = RedisServer(maxmemory="4gb").start()
        index = RedisKVIndex(server.url, BLOCK, engine_capacity_per_endpoint=10 * size, timeout_s=1.0,
                             max_pending_writes=10 * size)
        await index.start()
        mem0, cpu0 = await _redis_info(index)
    else:
        index = InMemoryKVIndex(BLOCK, size, engine_capacity_per_endpoint=10 * size)
    out: dict = {"backend": backend, "size": size, "endpoints": n_endpoints}
    try:
        gc.collect()
        rss0 = _rss_mb()
        t0 = time.perf_counter()
        for i, batch in enumerate(batches):
            prompt = i // 8  # a prompt's 8 events go to the same two endpoints
            for c in range(copies):
                index.apply_batch(endpoints[(prompt + c) % n_endpoints], batch, "m")
            if i % 64 == 0:
                await asyncio.sleep(0)  # let the writer task run, as the subscriber's loop does
        local_s = time.perf_counter() - t0
        blocks = copies * n_events * BLOCKS_PER_EVENT
        out["apply_blocks_s"] = blocks / local_s
        if isinstance(index, RedisKVIndex):
            await index.flush()
            total_s = time.perf_counter() - t0
            out["end_to_end_blocks_s"] = blocks / total_s
            mem1, cpu1 = await _redis_info(index)
            out["redis_bytes_per_entry"] = (mem1 - mem0) / blocks
            out["redis_cpu_us_per_block"] = (cpu1 - cpu0) / blocks * 1e6
            out["redis_keys"] = await index._redis.dbsize()
        out["picker_bytes_per_entry"] = (_rss_mb() - rss0) * 2**20 / blocks
        # the probe prompt: two endpoints hold its first 48 blocks
        rng = random.Random(3)
        prompt = [rng.randrange(50_000) for _ in range(BLOCK * PROMPT_BLOCKS)]
        parent = None
        for e in range(6):
            toks = prompt[e * BLOCK * BLOCKS_PER_EVENT:(e + 1) * BLOCK * BLOCKS_PER_EVENT]
            hashes = [(9 << 50) + e * BLOCKS_PER_EVENT + i for i in range(BLOCKS_PER_EVENT)]
            batch = _stored(hashes, toks, parent)
            index.apply_batch(endpoints[0], batch, "m")
            index.apply_batch(endpoints[-1], batch, "m")
            parent = hashes[-1]
        if isinstance(index, RedisKVIndex):
            await index.flush()
        keys = index.keyer.request_keys(prompt, "m")
        miss_keys = index.keyer.request_keys(prompt, "other-model")
        result = await index.lookup_async(keys, endpoints)
        assert len(result[endpoints[0]]) == 48, result
        hit, miss = [], []
        for _ in range(1000):
            t0 = time.perf_counter()
            await index.lookup_async(keys, endpoints)
            hit.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            await index.lookup_async(miss_keys, endpoints)
            miss.append(time.perf_counter() - t0)
        out.update(hit_p50_us=_pct(hit, 0.5) * 1e6, hit_p99_us=_pct(hit, 0.99) * 1e6,
                   miss_p50_us=_pct(miss, 0.5) * 1e6, miss_p99_us=_pct(miss, 0.99) * 1e6)
        if isinstance(index, RedisKVIndex):
            _, cpu0 = await _redis_info(index)
            n = 2000
            t0 = time.perf_counter()
            cpu_t0 = time.process_time()

            async def worker(count: int) -> None:
                for _ in range(count):
                    await index.lookup_async(keys, endpoints)

            await asyncio.gather(*(worker(n // IN_FLIGHT) for _ in range(IN_FLIGHT)))
            out["hit_lookups_s_16_in_flight"] = n / (time.perf_counter() - t0)
            out["picker_cpu_us_per_hit_lookup"] = (time.process_time() - cpu_t0) / n * 1e6
            _, cpu1 = await _redis_info(index)
            out["redis_cpu_us_per_hit_lookup"] = (cpu1 - cpu0) / n * 1e6
            assert index.healthy, "a lookup timed out during the benchmark"
    finally:
        if isinstance(index, RedisKVIndex):
            await index.stop()
        if server is not None:
            server.stop()
    return out


def _child(backend: str, size: int, n_endpoints: int, copies: int, queue) -> None:
    queue.put(asyncio.run(_run(backend, size, n_endpoints, copies)))


def measure(backend: str, size: int, n_endpoints: int, copies: int = 2) -> dict:
    """One backend at one size, in a fresh process (clean RSS)."""
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(backend, size, n_endpoints, copies, queue))
    proc.start()
    result = queue.get()
    proc.join()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="100000", help="comma-separated entry counts")
    parser.add_argument("--endpoints", default="4", help="comma-separated endpoint counts")
    parser.add_argument("--rounds", type=int, default=1, help="alternating runs per backend (medians reported)")
    parser.add_argument("--copies", type=int, default=2, help="endpoints each event is applied for (holders a key)")
    args = parser.parse_args()
    print("| entries | endpoints | backend | apply blocks/s (picker) | to Redis blocks/s | Redis CPU µs/block "
          "| picker B/entry | Redis B/entry | lookup hit p50/p99 µs | miss p50/p99 µs "
          "| hit lookups/s (16 in flight) | picker CPU µs/lookup | Redis CPU µs/lookup |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for size in [int(s) for s in args.sizes.split(",")]:
        for n_endpoints in [int(e) for e in args.endpoints.split(",")]:
            runs: dict[str, list[dict]] = {"memory": [], "redis": []}
            for _ in range(args.rounds):
                for backend in ("memory", "redis"):
                    runs[backend].append(measure(backend, size, n_endpoints, args.copies))
            for backend, results in runs.items():
                med = {k: statistics.median(r[k] for r in results) for k in results[0]
                       if isinstance(results[0][k], (int, float))}

                def cell(key: str, fmt: str = "{:,.0f}") -> str:
                    return fmt.format(med[key]) if key in med else "–"  # noqa: B023

                print(f"| {size:,} | {n_endpoints} | {backend} | {cell('apply_blocks_s')} | "
                      f"{cell('end_to_end_blocks_s')} | {cell('redis_cpu_us_per_block', '{:.2f}')} | "
                      f"{cell('picker_bytes_per_entry')} | {cell('redis_bytes_per_entry')} | "
                      f"{cell('hit_p50_us', '{:.0f}')} / {cell('hit_p99_us', '{:.0f}')} | "
                      f"{cell('miss_p50_us', '{:.0f}')} / {cell('miss_p99_us', '{:.0f}')} | "
                      f"{cell('hit_lookups_s_16_in_flight')} | {cell('picker_cpu_us_per_hit_lookup', '{:.0f}')} | "
                      f"{cell('redis_cpu_us_per_hit_lookup', '{:.1f}')} |",
                      flush=True)


if __name__ == "__main__":
    main()
