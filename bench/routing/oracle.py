"""The oracle: an upper bound on the prefix-cache hit rate any router can reach on a trace.

Replay the requests that were actually sent, in order, against ONE pooled cache holding
`replicas x blocks_per_replica` blocks, evicted with Belady's MIN (evict the block whose next
use is farthest in the future; a block never used again is not kept at all), and count every
block present when a request asks for it. Why this bounds every router:
- whatever the router does, the blocks cached anywhere in the fleet at any instant fit in the
  pooled capacity (duplicates on two replicas only waste room), so the fleet's contents are one
  possible schedule of the pooled cache, and MIN maximises hits over every such schedule;
- a replica only counts hits consecutive from the prompt's first block on itself, and holds
  running requests' private blocks and generated tokens too: all of that can only lose hits;
- timing is ignored: requests are served one at a time, so two concurrent requests of a new
  group both count a hit for the second (a real fleet computes that prefix twice).
Tokens and blocks follow the simulator (and vLLM): completions are tokenized with BOS, chats
rendered with the chat template; a request queries all its prompt tokens, and at most
`(n - 1) // block_size` full blocks can hit (the last token is always computed).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from bench.routing.workloads import BenchRequest, tokenizer


@dataclass(frozen=True, slots=True)
class OracleResult:
    """Per-request bound: prompt tokens queried and tokens that could at best hit."""

    queries: list[int]
    hits: list[int]

    def rate(self, indices: range | None = None) -> float:
        idx = indices if indices is not None else range(len(self.queries))
        q = sum(self.queries[i] for i in idx)
        return sum(self.hits[i] for i in idx) / q if q else 0.0


def prompt_token_ids(req: BenchRequest, tokenizer_dir: str | None = None) -> list[int]:
    """The token ids the simulator computes for this request's prompt."""
    tok = tokenizer(tokenizer_dir)
    if "messages" in req.body:
        return tok.encode_chat(req.body["messages"], add_special_tokens=False, add_generation_prompt=True,
                               continue_final_message=False, tools=None, chat_template_kwargs={})
    return tok.encode(req.body["prompt"], add_special_tokens=True)


def block_keys(ids: list[int], block_size: int) -> list[int]:
    """One key per full block, chained so a key names the block and everything before it."""
    keys = []
    parent = 0
    for i in range(len(ids) // block_size):
        parent = hash((parent, tuple(ids[i * block_size:(i + 1) * block_size])))
        keys.append(parent)
    return keys


def belady_hits(accesses: list[int], capacity: int) -> list[bool]:
    """Hit (True) or miss per access under Belady's MIN with bypass, for a cache of `capacity`."""
    never = len(accesses) + 1
    next_use = [never] * len(accesses)
    seen: dict[int, int] = {}
    for i in range(len(accesses) - 1, -1, -1):
        next_use[i] = seen.get(accesses[i], never)
        seen[accesses[i]] = i
    cached: dict[int, int] = {}  # key -> its next use
    heap: list[tuple[int, int]] = []  # (-next use, key); entries whose use changed are stale
    out = [False] * len(accesses)
    for i, key in enumerate(accesses):
        nxt = next_use[i]
        if key in cached:
            out[i] = True
            if nxt == never:
                del cached[key]  # never asked again: keeping it cannot help
            else:
                cached[key] = nxt
                heapq.heappush(heap, (-nxt, key))
            continue
        if nxt == never:
            continue
        if len(cached) >= capacity:
            while cached.get(heap[0][1]) != -heap[0][0]:
                heapq.heappop(heap)
            if -heap[0][0] <= nxt:
                continue  # the newcomer is needed last: bypass it
            del cached[heapq.heappop(heap)[1]]
        cached[key] = nxt
        heapq.heappush(heap, (-nxt, key))
    return out


def oracle_hits(requests: list[BenchRequest], *, block_size: int, capacity_blocks: int,
                tokenizer_dir: str | None = None) -> OracleResult:
    """The upper bound for `requests` sent in this order to a fleet of `capacity_blocks` in total."""
    accesses: list[int] = []
    owner: list[tuple[int, bool]] = []  # (request index, counts as a lookup)
    queries = []
    for r, req in enumerate(requests):
        ids = prompt_token_ids(req, tokenizer_dir)
        queries.append(len(ids))
        keys = block_keys(ids, block_size)
        lookups = (len(ids) - 1) // block_size
        for j, key in enumerate(keys):
            accesses.append(key)
            owner.append((r, j < lookups))
    hit = belady_hits(accesses, capacity_blocks)
    hits = [0] * len(requests)
    for (r, counted), h in zip(owner, hit):
        if counted and h:
            hits[r] += block_size
    return OracleResult(queries, hits)


__all__ = ["OracleResult", "belady_hits", "block_keys", "oracle_hits", "prompt_token_ids"]
