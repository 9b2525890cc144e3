"""Benchmark the KV block index and in-process tokenization; prints markdown tables.

Index: for index sizes (entries = (block, endpoint) pairs) 1e4 → 1e6 and 4 → 64 endpoints,
- fill rate: BlockStored events (8 blocks of 16 tokens each, msgpack-decoded beforehand) applied
  per second while filling the index (per wall-clock second, and per second of this process's CPU
  time, which other processes on a shared machine do not inflate), and at capacity (every new
  entry evicts an old one);
- lookup latency (p50/p99) of a 64-block prompt against all endpoints, when a prefix is held
  (two endpoints hold 48 of its blocks) and when nothing is held; the cost of computing the
  prompt's 64 request keys is reported separately.
Tokenization (tiny local byte-level BPE tokenizer, `epp.engine.tinymodel`): 4 KB, 64 KB and
256 KB prompts cold (empty cache), repeated (full hit) and extended by a new 1 KB turn.

Run: `python bench/kv_index_bench.py` (add `--quick` for a small grid).
Before/after in one run: `python bench/kv_index_bench.py --compare-with REF [--sizes 1000000 --endpoints 4]`
measures the index as it is at git REF and as it is now, alternating in fresh processes, with ratios
(the whole epp/kvevents package is taken from REF: the index, its engine map, decoding and keys).
"""

from __future__ import annotations

import argparse
import gc
import importlib
import multiprocessing
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import msgspec

from epp.engine.tinymodel import _WORDS, write_tiny_model
from epp.kvevents.decoding import decode_batch
from epp.kvevents.index import KVBlockIndex
from epp.tokenization.pool import ModelTokenizer
from epp.tokenization.prefix_cache import TokenizationCache

BLOCK = 16
BLOCKS_PER_EVENT = 8
PROMPT_BLOCKS = 64


_encode = msgspec.msgpack.Encoder().encode


def _stored_event(hashes: list[int], tokens: list[int], parent: int | None) -> dict:
    """A vLLM 0.33 map-form BlockStored event on GPU."""
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
            "block_size": BLOCK, "lora_id": None, "medium": "GPU", "lora_name": None, "group_idx": 0}


def _stored_payload(hashes: list[int], tokens: list[int], parent: int | None) -> bytes:
    """A vLLM 0.33 batch with one map-form BlockStored event."""
    return _encode([time.time(), [_stored_event(hashes, tokens, parent)], 0])


def _event_batches(n_events: int, seed: int, decode: Callable = decode_batch) -> list:
    """Decoded batches of one BlockStored each: chains of 8 blocks, new prompts every 8 events."""
    rng = random.Random(seed)
    out = []
    hash_base = seed << 40
    for e in range(n_events):
        part = e % 8
        tokens = [rng.randrange(50_000) for _ in range(BLOCK * BLOCKS_PER_EVENT)]
        hashes = [hash_base + e * BLOCKS_PER_EVENT + i for i in range(BLOCKS_PER_EVENT)]
        parent = None if part == 0 else hash_base + e * BLOCKS_PER_EVENT - 1
        out.append(decode(_stored_payload(hashes, tokens, parent)))
    return out


def _percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def _index_class(source: str | None) -> tuple[type, Callable]:
    """KVBlockIndex and the decoder its events come from: now, or from the `epp/kvevents` package
    under the folder `source` (an older version, for before/after runs: only in a fresh worker)."""
    if source is None:
        return KVBlockIndex, decode_batch
    import epp

    for name in [n for n in sys.modules if n == "epp.kvevents" or n.startswith("epp.kvevents.")]:
        del sys.modules[name]
    epp.__path__.insert(0, source)  # epp.kvevents is found there first
    return (importlib.import_module("epp.kvevents.index").KVBlockIndex,
            importlib.import_module("epp.kvevents.decoding").decode_batch)


def bench_index(size: int, n_endpoints: int, source: str | None = None) -> dict:
    endpoints = [f"10.0.{i // 250}.{i % 250}:8000" for i in range(n_endpoints)]
    index_class, decode = _index_class(source)
    index = index_class(BLOCK, size, engine_capacity_per_endpoint=10 * size)
    # Each event goes to two endpoints, so a key has two holders (shared prefixes across replicas).
    n_events = size // (BLOCKS_PER_EVENT * 2)
    batches = _event_batches(n_events, seed=1, decode=decode)
    gc.collect()
    rss0 = _rss_mb()
    t0, c0 = time.perf_counter(), time.process_time()
    for i, batch in enumerate(batches):
        prompt = i // 8  # a prompt's 8 chained events go to the same two endpoints
        index.apply_batch(endpoints[prompt % n_endpoints], batch, "m")
        index.apply_batch(endpoints[(prompt + 1) % n_endpoints], batch, "m")
    fill_s = time.perf_counter() - t0
    # CPU time too: on a shared machine the wall clock also counts the time other processes ran.
    fill_cpu_s = time.process_time() - c0
    fill_rate = 2 * n_events / fill_s
    filled = index.entries
    index_mb = _rss_mb() - rss0
    # At capacity: each new entry evicts the least recently used one.
    extra = _event_batches(2000, seed=2, decode=decode)
    t0 = time.perf_counter()
    for i, batch in enumerate(extra):
        index.apply_batch(endpoints[(i // 8) % n_endpoints], batch, "m")
    steady_rate = len(extra) / (time.perf_counter() - t0)
    # A prompt whose first 48 blocks two endpoints hold (one event chain = 64 blocks: store 6 events).
    rng = random.Random(3)
    prompt = [rng.randrange(50_000) for _ in range(BLOCK * PROMPT_BLOCKS)]
    parent = None
    for e in range(6):
        toks = prompt[e * BLOCK * BLOCKS_PER_EVENT:(e + 1) * BLOCK * BLOCKS_PER_EVENT]
        hashes = [(9 << 50) + e * BLOCKS_PER_EVENT + i for i in range(BLOCKS_PER_EVENT)]
        batch = decode(_stored_payload(hashes, toks, parent))
        index.apply_batch(endpoints[0], batch, "m")
        index.apply_batch(endpoints[-1], batch, "m")
        parent = hashes[-1]
    t0 = time.perf_counter()
    for _ in range(200):
        keys = index.keyer.request_keys(prompt, "m")
    keying_us = (time.perf_counter() - t0) / 200 * 1e6
    hit_lat, miss_lat = [], []
    miss_keys = index.keyer.request_keys(prompt, "other-model")
    for _ in range(2000):
        t0 = time.perf_counter()
        result = index.lookup(keys, endpoints)
        hit_lat.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        index.lookup(miss_keys, endpoints)
        miss_lat.append(time.perf_counter() - t0)
    assert len(result[endpoints[0]]) == 48, result.keys()
    return {
        "size": size, "endpoints": n_endpoints, "entries": filled, "index_mb": index_mb,
        "fill_events_s": fill_rate, "fill_blocks_s": fill_rate * BLOCKS_PER_EVENT,
        "fill_blocks_cpu_s": 2 * n_events * BLOCKS_PER_EVENT / fill_cpu_s,
        "steady_events_s": steady_rate,
        "hit_p50_us": _percentile(hit_lat, 0.5) * 1e6, "hit_p99_us": _percentile(hit_lat, 0.99) * 1e6,
        "miss_p50_us": _percentile(miss_lat, 0.5) * 1e6, "keying_us": keying_us,
    }


# One agentic turn's engine steps, in blocks stored a step: 16 prefill chunks of 2,048 tokens, then 64
# decode steps that fill a block each (1,024 tokens out).
TURN_STEPS = [128] * 16 + [1] * 64
TURN_BLOCKS = sum(TURN_STEPS)
VLLM_TURN_EVENTS = TURN_BLOCKS + len(TURN_STEPS)  # a removal per block stored, and a store a step


def _vllm_turn_payloads(first_hash: int, parent: int, oldest: int, seed: int) -> list[bytes]:
    """One agentic turn's batches (`TURN_STEPS`) as vLLM publishes them into a full cache: every new
    block evicts the oldest one with a BlockRemoved of its own, as vLLM's block pool does."""
    rng = random.Random(seed)
    payloads = []
    next_hash, victim = first_hash, oldest
    for blocks in TURN_STEPS:
        hashes = list(range(next_hash, next_hash + blocks))
        stored = _stored_event(hashes, [rng.randrange(50_000) for _ in range(BLOCK * blocks)], parent)
        removed = [{"type": "BlockRemoved", "block_hashes": [h], "medium": "GPU", "group_idx": 0}
                   for h in range(victim, victim + blocks)]
        payloads.append(_encode([time.time(), [*removed, stored], 0]))
        parent, next_hash, victim = hashes[-1], next_hash + blocks, victim + blocks
    return payloads


def bench_vllm_stream(turns: int, source: str | None = None) -> dict:
    """CPU per engine event to decode and apply vLLM's stream of agentic turns into a full cache
    (16,384 blocks of 16 tokens, one endpoint), `turns` turns of `_vllm_turn_payloads`."""
    index_class, decode = _index_class(source)
    index = index_class(BLOCK, 1 << 22, engine_capacity_per_endpoint=1 << 20)
    cache_blocks = 16_384
    rng = random.Random(5)
    parent = None
    for start in range(0, cache_blocks, 128):  # the full cache, untimed
        hashes = list(range(start, start + 128))
        tokens = [rng.randrange(50_000) for _ in range(BLOCK * 128)]
        index.apply_batch("ep", decode(_stored_payload(hashes, tokens, parent)), "m")
        parent = hashes[-1]
    payloads = [p for t in range(turns) for p in _vllm_turn_payloads(
        cache_blocks + t * TURN_BLOCKS, cache_blocks - 1 + t * TURN_BLOCKS, t * TURN_BLOCKS, seed=t)]
    gc.collect()
    c0 = time.process_time()
    for payload in payloads:
        index.apply_batch("ep", decode(payload), "m")
    cpu_s = time.process_time() - c0
    assert index.engine_blocks("ep") == cache_blocks, index.engine_blocks("ep")
    events = turns * VLLM_TURN_EVENTS
    return {"event_us": cpu_s / events * 1e6, "turn_ms": cpu_s / turns * 1e3, "events_cpu_s": events / cpu_s}


def _text(n_bytes: int, seed: int) -> str:
    rng = random.Random(seed)
    words = []
    size = 0
    while size < n_bytes:
        w = rng.choice(_WORDS)
        words.append(w)
        size += len(w) + 1
    return " ".join(words)[:n_bytes]


def bench_tokenization(model_dir: Path) -> list[dict]:
    rows = []
    for label, n in (("4 KB", 4 * 1024), ("64 KB", 64 * 1024), ("256 KB", 256 * 1024)):
        text = _text(n, seed=n)
        turn = " " + _text(1024, seed=n + 1)
        reps = 20 if n <= 64 * 1024 else 5
        cold, hit, ext = [], [], []
        for r in range(reps):
            tok = ModelTokenizer(model_dir, TokenizationCache(10_000_000))
            t0 = time.perf_counter()
            ids = tok.encode_text(text, True)
            cold.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            tok.encode_text(text, True)
            hit.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            ext_ids = tok.encode_text(text + turn, True)
            ext.append(time.perf_counter() - t0)
            if r == 0:
                full = tok.tokenizer.encode(text + turn, add_special_tokens=True).ids
                assert ext_ids == full, "cached extension differs from full tokenization"
        rows.append({"prompt": label, "tokens": len(ids), "cold_ms": statistics.median(cold) * 1e3,
                     "hit_ms": statistics.median(hit) * 1e3, "ext_ms": statistics.median(ext) * 1e3,
                     "stats": tok.cache.stats})
    return rows


def compare(ref: str, sizes: list[int], endpoint_counts: list[int], rounds: int) -> None:
    """The index at git `ref` against the index now, alternating in fresh processes; medians of `rounds`."""
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(["git", "archive", ref, "epp/kvevents"], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        _compare(ref, str(Path(tmp) / "epp"), sizes, endpoint_counts, rounds)


def _compare(ref: str, baseline: str, sizes: list[int], endpoint_counts: list[int], rounds: int) -> None:
    print(f"## KV block index: git {ref} (before) against the working tree (after), medians of {rounds}\n")
    print("| entries | endpoints | bytes/entry before | after | ratio | fill blocks/s before | after | ratio | "
          "fill blocks/CPU-s before | after | ratio | "
          "at-capacity events/s before | after | ratio | lookup hit p50 µs before | after | ratio |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for size in sizes:
        for n_endpoints in endpoint_counts:
            runs: dict[str, list[dict]] = {"before": [], "after": []}
            for _ in range(rounds):
                for label, source in (("before", baseline), ("after", None)):
                    with multiprocessing.get_context("fork").Pool(1) as worker:  # fresh heap: honest RSS growth
                        runs[label].append(worker.apply(bench_index, (size, n_endpoints, source)))

            def med(label: str, key: str, runs: dict[str, list[dict]] = runs) -> float:
                return statistics.median(r[key] for r in runs[label])

            b_bytes = med("before", "index_mb") * 2**20 / med("before", "entries")
            a_bytes = med("after", "index_mb") * 2**20 / med("after", "entries")
            cells = [f"{med('before', 'entries'):,.0f}", str(n_endpoints), f"{b_bytes:.0f}", f"{a_bytes:.0f}",
                     f"{a_bytes / b_bytes:.2f}x"]
            for key, fmt in (("fill_blocks_s", ",.0f"), ("fill_blocks_cpu_s", ",.0f"), ("steady_events_s", ",.0f"),
                             ("hit_p50_us", ".1f")):
                before, after = med("before", key), med("after", key)
                cells += [format(before, fmt), format(after, fmt), f"{after / before:.2f}x"]
            print("| " + " | ".join(cells) + " |", flush=True)
    stream: dict[str, list[dict]] = {"before": [], "after": []}
    for _ in range(rounds):
        for label, source in (("before", baseline), ("after", None)):
            with multiprocessing.get_context("fork").Pool(1) as worker:
                stream[label].append(worker.apply(bench_vllm_stream, (20, source)))
    before, after = (statistics.median(r["event_us"] for r in stream[k]) for k in ("before", "after"))
    before_turn, after_turn = (statistics.median(r["turn_ms"] for r in stream[k]) for k in ("before", "after"))
    print(f"\n## vLLM's event stream of an agentic turn into a full cache ({VLLM_TURN_EVENTS:,} engine events a turn: "
          f"{TURN_BLOCKS:,} blocks stored, each evicting one), decoded and applied\n")
    print("| | before | after | ratio |\n|---|---:|---:|---:|")
    print(f"| CPU µs per engine event | {before:.2f} | {after:.2f} | {after / before:.2f}x |")
    print(f"| CPU ms per turn | {before_turn:.2f} | {after_turn:.2f} | {after_turn / before_turn:.2f}x |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="sizes 1e4 and 1e5 only")
    parser.add_argument("--compare-with", metavar="REF", help="before/after: the index at this git ref against now")
    parser.add_argument("--sizes", default="100000,1000000", help="--compare-with: index sizes")
    parser.add_argument("--endpoints", default="4,64", help="--compare-with: endpoint counts")
    parser.add_argument("--rounds", type=int, default=1, help="--compare-with: alternating rounds (medians)")
    args = parser.parse_args()
    if args.compare_with:
        compare(args.compare_with, [int(x) for x in args.sizes.split(",")],
                [int(x) for x in args.endpoints.split(",")], args.rounds)
        return
    sizes = [10_000, 100_000] if args.quick else [10_000, 100_000, 1_000_000]
    print("## KV block index (block 16 tokens, events of 8 blocks, prompt of 64 blocks)\n")
    print("| entries | endpoints | fill events/s | fill blocks/s | fill blocks/CPU-s | at-capacity events/s | "
          "lookup hit p50 µs | hit p99 µs | lookup miss p50 µs | keys for 1024 tokens µs | RSS growth MB |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for size in sizes:
        for n_endpoints in (4, 16, 64):
            with multiprocessing.get_context("fork").Pool(1) as worker:  # fresh heap: honest RSS growth
                r = worker.apply(bench_index, (size, n_endpoints))
            print(f"| {r['entries']:,} | {n_endpoints} | {r['fill_events_s']:,.0f} | {r['fill_blocks_s']:,.0f} | "
                  f"{r['fill_blocks_cpu_s']:,.0f} | "
                  f"{r['steady_events_s']:,.0f} | {r['hit_p50_us']:.1f} | {r['hit_p99_us']:.1f} | "
                  f"{r['miss_p50_us']:.1f} | {r['keying_us']:.1f} | {r['index_mb']:.0f} |", flush=True)
            gc.collect()
    payloads = [_stored_payload(list(range(i, i + BLOCKS_PER_EVENT)), list(range(BLOCK * BLOCKS_PER_EVENT)), i)
                for i in range(20_000)]
    t0 = time.perf_counter()
    for payload in payloads:
        decode_batch(payload)
    decode_s = (time.perf_counter() - t0) / len(payloads)
    print(f"\nDecoding one batch (1 BlockStored of {BLOCKS_PER_EVENT} blocks, {len(payloads[0])} bytes): "
          f"{decode_s * 1e6:.1f} µs ({1 / decode_s:,.0f} batches/s)")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_tiny_model(Path(tmp) / "tiny", weights=False)
        print("\n## Tokenization (tiny byte-level BPE, 2k vocab; median ms)\n")
        print("| prompt | tokens | cold | repeated (cache hit) | extended by a 1 KB turn (cached prefix) |")
        print("|---|---:|---:|---:|---:|")
        for r in bench_tokenization(model_dir):
            print(f"| {r['prompt']} | {r['tokens']:,} | {r['cold_ms']:.2f} | {r['hit_ms']:.2f} | {r['ext_ms']:.2f} |")


if __name__ == "__main__":
    main()
