"""Scheduling latency of the default pipeline against the number of endpoints and the prompt size.

Times, in process, what the director runs per request: the data producers (approximate prefix
hashing and matching), the scheduler (queue 2 + kv-cache-utilization 2 + prefix-cache 3,
max-score picker) and the pre-request hooks (optimistic insert into the prefix index).
Prompts come from a fixed number of shared-prefix groups, so the prefix index is warm and
matches are found, as in a real prefix-heavy workload.

    python bench/scheduling_bench.py [--iterations 400] [--endpoints 4,16,64,256] [--sizes 1,4,16,64,256]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import random
import statistics
import sys
import time
from collections.abc import Sequence
from types import MappingProxyType

from epp.config import LoadedConfig, load_default_config
from epp.framework import ApiKind, CycleState, Endpoint, EndpointMetrics, InferenceRequest
from epp.scorers.prefix_hashing import block_hashes, chain_seed
from epp.scorers.prompt_text import user_input_bytes

PREFIX_GROUPS = 32


def make_endpoints(count: int, rng: random.Random) -> list[Endpoint]:
    """`count` endpoints with varied queue and KV metrics (as a scrape would give)."""
    return [Endpoint(f"10.{i // 250}.{i % 250}.1", 8000, MappingProxyType({}),
                     EndpointMetrics(waiting_queue_size=rng.randint(0, 20), running_requests_size=rng.randint(0, 50),
                                     kv_cache_usage=rng.random(), cache_block_size=16, cache_num_blocks=20000,
                                     update_time=time.monotonic()))
            for i in range(count)]


def make_prefixes(size_bytes: int, rng: random.Random) -> list[str]:
    """One long shared prefix per group (a random 4 KB text repeated, led by the group's name)."""
    words = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex jolly".split()
    base = " ".join(rng.choice(words) for _ in range(1000))[:4096]
    body = base * (size_bytes // len(base) + 1)
    return [(f"system prompt {group}: " + body)[: max(0, size_bytes - 64)] for group in range(PREFIX_GROUPS)]


def make_prompt(prefixes: list[str], size_bytes: int, i: int) -> str:
    """Prompt `i`: its group's prefix plus a short unique question, `size_bytes` long."""
    return (prefixes[i % PREFIX_GROUPS] + f" question {i}: " + "x" * 64)[:size_bytes]


def make_request(prompt: str, i: int) -> InferenceRequest:
    return InferenceRequest(request_id=f"r{i}", api=ApiKind.COMPLETIONS, model="llama", target_model="llama",
                            body={"model": "llama", "prompt": prompt, "max_tokens": 16})


async def schedule_once(loaded: LoadedConfig, request: InferenceRequest, endpoints: Sequence[Endpoint]) -> None:
    state = CycleState()
    for producer in loaded.data_producers:
        await producer.prepare(state, request, endpoints)
    result = loaded.scheduler.schedule(state, request, endpoints)
    for hook in loaded.pre_request_hooks:
        hook.pre_request(state, request, result)


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def measure(endpoint_count: int, size_kb: int, iterations: int, seed: int) -> tuple[float, float, float]:
    """p50, p99 and mean latency in microseconds for one (endpoints, prompt size) cell."""
    rng = random.Random(seed)
    loaded = load_default_config()
    endpoints = make_endpoints(endpoint_count, rng)
    warmup = max(PREFIX_GROUPS * 2, 64)
    size = size_kb * 1024
    prefixes = make_prefixes(size, rng)
    for i in range(warmup):
        await schedule_once(loaded, make_request(make_prompt(prefixes, size, i), i), endpoints)
    samples = []
    gc.collect()
    for i in range(warmup, warmup + iterations):
        req = make_request(make_prompt(prefixes, size, i), i)
        t0 = time.perf_counter()
        await schedule_once(loaded, req, endpoints)
        samples.append((time.perf_counter() - t0) * 1e6)
    return percentile(samples, 0.50), percentile(samples, 0.99), statistics.fmean(samples)


def hashing_cost(size_kb: int, max_blocks: int, api: ApiKind, repeats: int = 50) -> float:
    """Median microseconds to get the user-input bytes and hash up to `max_blocks` 64-byte blocks."""
    text = ("lorem ipsum dolor sit amet " * (size_kb * 1024 // 27 + 1))[: size_kb * 1024]
    body = ({"model": "m", "prompt": text} if api is ApiKind.COMPLETIONS else
            {"model": "m", "messages": [{"role": "system", "content": text[: len(text) // 2]},
                                        {"role": "user", "content": text[len(text) // 2:]}]})
    req = InferenceRequest("h", api, "m", "m", body)
    block_chars = 64
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        data = user_input_bytes(req, limit=block_chars * max_blocks)
        block_hashes(data, block_chars, max_blocks, chain_seed("m", None))
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iterations", type=int, default=400, help="timed requests per cell")
    parser.add_argument("--endpoints", default="4,16,64,256", help="comma-separated endpoint counts")
    parser.add_argument("--sizes", default="1,4,16,64,256", help="comma-separated prompt sizes in KB")
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args(argv)
    endpoint_counts = [int(x) for x in args.endpoints.split(",")]
    sizes = [int(x) for x in args.sizes.split(",")]

    print(f"Default pipeline (approx prefix producer + queue 2 / kv 2 / prefix 3 + max-score picker + "
          f"prefix-index insert), {args.iterations} timed requests per cell, {PREFIX_GROUPS} prefix groups, "
          f"Python {sys.version.split()[0]}.\n")
    print("| endpoints | prompt | p50 (µs) | p99 (µs) | mean (µs) |")
    print("|---:|---:|---:|---:|---:|")
    for count in endpoint_counts:
        for size in sizes:
            p50, p99, mean = asyncio.run(measure(count, size, args.iterations, args.seed))
            print(f"| {count} | {size} KB | {p50:.0f} | {p99:.0f} | {mean:.0f} |", flush=True)

    print("\nPrompt hashing alone (user-input bytes + xxhash64 chain of 64-byte blocks), median µs:\n")
    print("| prompt | API | blocks hashed (cap) | µs |")
    print("|---:|---|---:|---:|")
    for size in (1, 16, 256):
        for api in (ApiKind.COMPLETIONS, ApiKind.CHAT_COMPLETIONS):
            for cap in (256, 4096):
                print(f"| {size} KB | {api.value} | {min(cap, size * 16)} ({cap}) | "
                      f"{hashing_cost(size, cap, api):.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
