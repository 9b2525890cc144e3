"""Replay a routing run through the approximate prefix index: did it know what each replica really held?

Takes a run's per-request records (`raw/<contender>.jsonl`: the replica each request went to and
the cached tokens that replica reported) and the scenario's seeded requests, feeds them in the
order sent to a `PrefixIndex` as `approx-prefix-cache-producer` would (every prompt recorded on
the replica it went to), and compares, request by request, the share of the prompt the index
believed the chosen replica held with the share the replica served from cache:

- forgot: the replica served most of the prompt from cache, the index believed it held nothing
  (a router trusting that index would have sent the request elsewhere, to a cold prefill);
- phantom: the index believed most of the prompt was there, the replica had none of it;
- moved: a conversation's next request went to another replica while the index still
  credited the previous one with the prompt (load outweighed affinity), or had forgotten it.

    python -m bench.routing.index_replay bench/results/<run> <contender> --scenario multi-turn \
        --capacity 496 [--head-first]

The capacity is in hash blocks per replica (what the producer would size its LRU to); nothing
here reads the simulator: only what the replicas reported to the client.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from bench.routing.scenarios import get_scenario
from bench.routing.workloads import BenchRequest
from epp.framework.types import InferenceRequest
from epp.scorers.parsers.openai import OpenAIParser
from epp.scorers.prefix_hashing import AVERAGE_CHARACTERS_PER_TOKEN, block_hashes, chain_seed
from epp.scorers.prefix_index import PrefixIndex
from epp.scorers.prompt_text import user_input_bytes

_FORGOT, _PHANTOM = "forgot", "phantom"
# The format the picker's parser gives OpenAI requests (it says what prefix hashing reads of a prompt).
_OPENAI = OpenAIParser()


def request_hashes(req: BenchRequest, block_tokens: int = 16, max_blocks: int = 256) -> list[int]:
    """The block-hash chain `approx-prefix-cache-producer` computes for a benchmark request."""
    api = "chat/completions" if "messages" in req.body else "completions"
    model = str(req.body.get("model", ""))
    ir = InferenceRequest("replay", api, model, model, req.body, format=_OPENAI)
    block_chars = block_tokens * AVERAGE_CHARACTERS_PER_TOKEN
    data = user_input_bytes(ir, limit=block_chars * max_blocks)
    return block_hashes(data, block_chars, max_blocks, chain_seed(model, None))


def replay(records: Iterable[dict[str, Any]], requests: Iterator[BenchRequest], capacity: int, *,
           chain_aware: bool = True, block_tokens: int = 16) -> Counter:
    """Counts of forgot / phantom / moved-while-known / moved-after-forgetting over the records, in send order."""
    index = PrefixIndex(chain_aware=chain_aware)
    last_replica: dict[str, str] = {}
    counts: Counter = Counter()
    for rec in sorted(records, key=lambda r: r["sent"]):
        req = next(requests)
        if req.group != rec["group"]:
            raise ValueError(f"records and workload disagree: {rec['group']!r} sent where {req.group!r} was generated")
        replica = rec.get("replica")
        if rec.get("error") or not replica or not rec.get("prompt_tokens"):
            continue
        hashes = request_hashes(req, block_tokens)
        matched = index.match_longest_prefix(hashes) if hashes else {}
        believed = matched.get(replica, 0) / max(1, len(hashes))
        served = (rec.get("cached_tokens") or 0) / rec["prompt_tokens"]
        counts["requests"] += 1
        if served > 0.3 and believed < 0.1:
            counts[_FORGOT] += 1
        if believed > 0.3 and served < 0.1:
            counts[_PHANTOM] += 1
        previous = last_replica.get(req.group)
        if previous is not None and previous != replica:
            known = matched.get(previous, 0) / max(1, len(hashes)) >= 0.3
            counts["moved while the index credited the previous replica" if known
                   else "moved after the index forgot the previous replica"] += 1
        if hashes:
            index.add(hashes, replica, capacity)
        last_replica[req.group] = replica
    return counts


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run", type=Path, help="a routing run's output directory (with raw/)")
    p.add_argument("contender")
    p.add_argument("--scenario", default="multi-turn")
    p.add_argument("--scale", default="small")
    p.add_argument("--capacity", type=int, required=True, help="hash blocks per replica")
    p.add_argument("--head-first", action="store_true", help="GIE's index (a chain's head evicted first)")
    args = p.parse_args(argv)
    scenario = get_scenario(args.scenario, args.scale)
    with open(args.run / "raw" / f"{args.contender}.jsonl", encoding="utf-8") as fh:
        records = [json.loads(line) for line in fh]
    counts = replay(records, scenario.workload.requests(), args.capacity, chain_aware=not args.head_first)
    print(json.dumps(dict(counts)))


if __name__ == "__main__":
    main()
