"""Floors under every router's TTFT percentiles on a workload: each request's own unavoidable prefill.

A request can at best find cached the longest prefix it shares with any earlier request (an
unbounded cache, in the right place, with no queue in front of it); the rest it must prefill.
At a replica's prefill cost per token and its fixed cost per request (what the self-calibrating
`predicted-ttft-scorer` learned: `epp calibration`, or `epp_ttft_calibration` in a run's report;
never the simulator's profile), that gives each request a least TTFT, and their percentiles
bound what any router can reach on the same requests: a target below the floor cannot be met.

Two floors, each optimistic in its own way (neither is a proof for every request):

- **with queueing** (`queued_ttft_floor`): every replica holds every prefix ever sent (an unbounded
  cache everywhere), and prefills queue first come first served on one-at-a-time replicas;
- **with finite KV capacity** (`capacity_ttft_floor`): no queue, but the fleet's caches are finite:
  the requests are replayed in order against one pooled cache of `replicas x blocks` blocks evicted
  with Belady's MIN (perfect placement and the best eviction schedule, bench/routing/oracle.py), a
  request reuses only the blocks present from its prompt's start, and at most one replica's blocks
  (one replica serves it).

`tail_causes` says which requests make up a floor's p90: cold ones (nothing earlier shared), long
prompts (the longest tenth), ones whose shared prefix the finite caches lost, ones that waited.

    python -m bench.routing.ttft_floor multi-turn --requests 256 --prefill-s-per-token 1.6e-4 --base-s 0.04
    python -m bench.routing.ttft_floor trace --trace T.jsonl --trace-window 1800 --trace-fraction 0.1 ...
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Iterable

from bench.routing.measure import percentile
from bench.routing.oracle import belady_hits, block_keys, prompt_token_ids
from bench.routing.scenarios import get_scenario
from bench.routing.workloads import BenchRequest


def reusable_tokens(requests: Iterable[BenchRequest], block_size: int = 16,
                    tokenizer_dir: str | None = None) -> list[tuple[int, int]]:
    """Per request (prompt tokens, most tokens any router could serve it from cache)."""
    seen: set[int] = set()
    out = []
    for req in requests:
        ids = prompt_token_ids(req, tokenizer_dir)
        keys = block_keys(ids, block_size)
        shared = next((i for i, k in enumerate(keys) if k not in seen), len(keys))
        seen.update(keys)
        out.append((len(ids), min(shared, (len(ids) - 1) // block_size) * block_size))
    return out


def ttft_floor(requests: Iterable[BenchRequest], prefill_s_per_token: float, base_s: float,
               block_size: int = 16, tokenizer_dir: str | None = None) -> list[float]:
    """Each request's least TTFT: base + prefill cost x tokens no earlier request shared."""
    return [base_s + prefill_s_per_token * (n - hit)
            for n, hit in reusable_tokens(requests, block_size, tokenizer_dir)]


def queued_ttft_floor(requests: Iterable[BenchRequest], replicas: int, prefill_s_per_token: float, base_s: float,
                      block_size: int = 16, tokenizer_dir: str | None = None) -> list[float]:
    """Each request's TTFT when bursts must queue: the floor's prefills on `replicas` one-at-a-time servers.

    Every replica holds every prefix (no request loses reuse to placement), serves prefills
    first come first served, and each request goes where its prefill finishes first (least work
    left). Decode steps, chunked-prefill interleaving and cache capacity are ignored, so this is an
    optimistic estimate of the best a router can do on a bursty trace, not a proof.
    """
    reqs = list(requests)
    return queued_floor([(req.at or 0.0, n - hit) for req, (n, hit) in
                         zip(reqs, reusable_tokens(reqs, block_size, tokenizer_dir))],
                        replicas, prefill_s_per_token, base_s)


def capacity_reusable(requests: Iterable[BenchRequest], replicas: int, blocks_per_replica: int, block_size: int = 16,
                      tokenizer_dir: str | None = None) -> list[tuple[int, int]]:
    """Per request (prompt tokens, tokens served from cache) under finite capacity and perfect placement.

    One pooled cache of `replicas x blocks_per_replica` blocks with Belady's MIN; a request counts the
    blocks present consecutively from its first, at most one replica's worth, and never its last token.
    """
    prompts, accesses = [], []
    for req in requests:
        ids = prompt_token_ids(req, tokenizer_dir)
        keys = block_keys(ids, block_size)
        prompts.append((len(ids), len(accesses), len(keys)))
        accesses.extend(keys)
    hit = belady_hits(accesses, replicas * max(0, blocks_per_replica - 1))  # vLLM keeps one null block
    out = []
    for n, start, count in prompts:
        lead = next((j for j in range(count) if not hit[start + j]), count)
        lead = min(lead, (n - 1) // block_size, max(0, blocks_per_replica - 1))
        out.append((n, lead * block_size))
    return out


def capacity_ttft_floor(requests: Iterable[BenchRequest], replicas: int, blocks_per_replica: int,
                        prefill_s_per_token: float, base_s: float, block_size: int = 16,
                        tokenizer_dir: str | None = None) -> list[float]:
    """Each request's TTFT with no queue and finite KV capacity: base + prefill of what the best cache misses."""
    return [base_s + prefill_s_per_token * (n - hit)
            for n, hit in capacity_reusable(requests, replicas, blocks_per_replica, block_size, tokenizer_dir)]


def tail_causes(floor: list[float], prompts: list[int], unbounded_hits: list[int], capacity_hits: list[int] | None = None,
                own_s: list[float] | None = None, q: float = 90) -> dict[str, float]:
    """What makes up the requests at or above a floor's p`q`: shares of them (a request may have several causes).

    cold: less than a tenth of its prompt shared with any earlier request; long: its prompt among the
    longest tenth; evicted: its shared prefix lost to the finite caches (at least a block); queued: it
    waited longer than its own prefill took (with `own_s`, each request's floor without a queue).
    """
    cut = percentile(floor, q)
    if cut is None:
        return {}
    tail = [i for i, v in enumerate(floor) if v >= cut]
    long_cut = percentile([float(n) for n in prompts], 90) or 0.0
    causes = {"requests": float(len(tail)),
              "cold": sum(unbounded_hits[i] < 0.1 * prompts[i] for i in tail) / len(tail),
              "long": sum(prompts[i] >= long_cut for i in tail) / len(tail)}
    if capacity_hits is not None:
        causes["evicted"] = sum(capacity_hits[i] + 16 <= unbounded_hits[i] for i in tail) / len(tail)
    if own_s is not None:
        causes["queued"] = sum(floor[i] - own_s[i] > own_s[i] for i in tail) / len(tail)
    return causes


def queued_floor(arrivals: Iterable[tuple[float, int]], replicas: int, prefill_s_per_token: float,
                 base_s: float) -> list[float]:
    """`queued_ttft_floor` of `(arrival seconds, tokens to prefill)` in arrival order."""
    free_at = [0.0] * replicas
    out = []
    for arrival, tokens in arrivals:
        i = min(range(replicas), key=lambda k: free_at[k])
        free_at[i] = max(free_at[i], arrival) + prefill_s_per_token * tokens
        out.append(free_at[i] - arrival + base_s)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("scenario")
    p.add_argument("--scale", default="small")
    p.add_argument("--requests", type=int, help="how many of the workload's requests (default: a trace's all)")
    p.add_argument("--prefill-s-per-token", type=float, required=True, help="learned prefill cost (wall s/token)")
    p.add_argument("--base-s", type=float, default=0.0, help="learned fixed cost per request (wall s)")
    p.add_argument("--replicas", type=int, help="also the floor with queueing on this many replicas (timed traces)")
    p.add_argument("--blocks", type=int, help="also the floor with finite KV capacity: blocks per replica (with --replicas)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    p.add_argument("--trace")
    p.add_argument("--trace-window", type=float)
    p.add_argument("--trace-fraction", type=float)
    args = p.parse_args(argv)
    scenario = get_scenario(args.scenario, args.scale, args.trace, window_s=args.trace_window,
                            fraction=args.trace_fraction)
    requests = scenario.workload.requests()
    if args.requests:
        requests = itertools.islice(requests, args.requests)
    elif scenario.name != "trace":
        p.error("--requests is needed for a workload that never runs dry")
    requests = list(requests)
    floor = ttft_floor(requests, args.prefill_s_per_token, args.base_s)
    print(f"{len(floor)} requests: TTFT floor p50 {percentile(floor, 50):.3f} s, p90 {percentile(floor, 90):.3f} s, "
          f"p99 {percentile(floor, 99):.3f} s")
    if args.replicas:
        if any(r.at is None for r in requests):
            p.error("--replicas needs a timed workload (the trace scenario)")
        queued = queued_ttft_floor(requests, args.replicas, args.prefill_s_per_token, args.base_s,
                                   block_size=args.block_size)
        print(f"with queueing on {args.replicas} replicas (least work left, every prefix everywhere): "
              f"p50 {percentile(queued, 50):.3f} s, p90 {percentile(queued, 90):.3f} s, p99 {percentile(queued, 99):.3f} s")
    if args.replicas and args.blocks:
        capacity = capacity_ttft_floor(requests, args.replicas, args.blocks, args.prefill_s_per_token, args.base_s,
                                       block_size=args.block_size)
        print(f"with finite KV capacity ({args.replicas} x {args.blocks} blocks of {args.block_size}, perfect placement, "
              f"no queue): p50 {percentile(capacity, 50):.3f} s, p90 {percentile(capacity, 90):.3f} s, "
              f"p99 {percentile(capacity, 99):.3f} s")


if __name__ == "__main__":
    main()
