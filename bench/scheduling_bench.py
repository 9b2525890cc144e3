"""Scheduling latency of the default pipeline against the number of endpoints and the prompt size.

Times, in process, the real `Director.schedule` per request: candidate selection, the data
producers (approximate prefix hashing and matching), the scheduler (queue 2 +
kv-cache-utilization 2 + prefix-cache 3, max-score picker), the pre-request hooks (optimistic
insert into the prefix index) and the in-flight booking. Each request is completed before the
next (untimed), so bookings do not pile up.
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

from epp.config import load_default_config
from epp.datalayer.registry import EndpointRegistry, EndpointSpec
from epp.framework import (
    CycleState,
    Endpoint,
    EndpointMetrics,
    InferenceRequest,
    PluginContext,
    ResponseInfo,
)
from epp.metrics import EppMetrics
from epp.requestcontrol.director import Director
from epp.scorers.parsers.openai import OpenAIParser
from epp.scorers.prefix_hashing import block_hashes, chain_seed
from epp.scorers.prompt_text import user_input_bytes

# The format the picker's parser gives OpenAI requests (what prefix hashing asks for the prompt's bytes).
OPENAI = OpenAIParser()

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
    return InferenceRequest(request_id=f"r{i}", api="completions", model="llama", target_model="llama",
                            body={"model": "llama", "prompt": prompt, "max_tokens": 16}, format=OPENAI)


def director_over(endpoints: Sequence[Endpoint]) -> Director:
    """The director of the default config over a pool of `endpoints`, wired as `epp serve` wires it."""
    registry = EndpointRegistry()
    registry.set_endpoints(EndpointSpec(ep.address, ep.port) for ep in endpoints)
    for ep in endpoints:
        registry.update(ep.name, metrics=ep.metrics)
    metrics = EppMetrics()
    context = PluginContext(metrics_registry=metrics.registry, endpoints=registry)
    return Director(load_default_config(context=context), registry, metrics, ledger=context.load)


async def schedule_once(director: Director, request: InferenceRequest) -> float:
    """Seconds `director.schedule` took for `request` (then the request is completed, untimed)."""
    state = CycleState()
    t0 = time.perf_counter()
    result = await director.schedule(state, request)
    elapsed = time.perf_counter() - t0
    director.response_complete(state, request, ResponseInfo(status="200", end_of_stream=True), result.targets[0])
    return elapsed


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def measure(endpoint_count: int, size_kb: int, iterations: int, seed: int) -> tuple[float, float, float]:
    """p50, p99 and mean latency in microseconds for one (endpoints, prompt size) cell."""
    rng = random.Random(seed)
    director = director_over(make_endpoints(endpoint_count, rng))
    warmup = max(PREFIX_GROUPS * 2, 64)
    size = size_kb * 1024
    prefixes = make_prefixes(size, rng)
    for i in range(warmup):
        await schedule_once(director, make_request(make_prompt(prefixes, size, i), i))
    samples = []
    gc.collect()
    for i in range(warmup, warmup + iterations):
        samples.append(await schedule_once(director, make_request(make_prompt(prefixes, size, i), i)) * 1e6)
    return percentile(samples, 0.50), percentile(samples, 0.99), statistics.fmean(samples)


def hashing_cost(size_kb: int, max_blocks: int, api: str, repeats: int = 50) -> float:
    """Median microseconds to get the user-input bytes and hash up to `max_blocks` 64-byte blocks."""
    text = ("lorem ipsum dolor sit amet " * (size_kb * 1024 // 27 + 1))[: size_kb * 1024]
    body = ({"model": "m", "prompt": text} if api == "completions" else
            {"model": "m", "messages": [{"role": "system", "content": text[: len(text) // 2]},
                                        {"role": "user", "content": text[len(text) // 2:]}]})
    req = InferenceRequest("h", api, "m", "m", body, format=OPENAI)
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
        for api in ("completions", "chat/completions"):
            for cap in (256, 4096):
                print(f"| {size} KB | {api.value} | {min(cap, size * 16)} ({cap}) | "
                      f"{hashing_cost(size, cap, api):.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
