"""A conversation's next turn continues its previous turn's KV-index match: the same runs as a full walk, or a full walk."""

from __future__ import annotations

import itertools
import random

from prometheus_client import CollectorRegistry

from epp.kvevents.backend import InMemoryKVIndex
from epp.kvevents.decoding import BlockRemoved, BlockStored, DecodedBatch, Tier
from epp.kvevents.match_memo import MatchMemo, MatchMemoMetrics

BS = 4
ENDPOINTS = ["a", "b", "c"]
_hashes = itertools.count(1)


class Replica:
    """What one replica stored, as KV events into the index (engine hashes are any distinct ints)."""

    def __init__(self, index: InMemoryKVIndex, name: str) -> None:
        self.index, self.name, self.held, self.hashes = index, name, 0, []

    def store(self, tokens: list[int]) -> None:
        end = len(tokens) // BS * BS
        if end <= self.held:
            return
        new = [next(_hashes) for _ in range(self.held // BS, end // BS)]
        event = BlockStored(tuple(new), self.hashes[-1] if self.hashes else None, tuple(tokens[self.held:end]), BS,
                            Tier.GPU)
        self.index.apply_batch(self.name, DecodedBatch(0.0, [event]), "m")
        self.hashes += new
        self.held = end

    def evict_tail(self, blocks: int) -> None:
        gone, self.hashes = self.hashes[-blocks:], self.hashes[:-blocks]
        self.index.apply_batch(self.name, DecodedBatch(0.0, [BlockRemoved(tuple(gone), Tier.GPU)]), "m")
        self.held = len(self.hashes) * BS


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def setup(max_age_s: float = 10.0, capacity: int = 1 << 20):
    index = InMemoryKVIndex(BS, speculative_ttl_s=0)
    registry = CollectorRegistry()
    clock = Clock()
    memo = MatchMemo(capacity, max_age_s, metrics=MatchMemoMetrics(registry), clock=clock)
    return index, memo, registry, clock


async def full(index: InMemoryKVIndex, keys) -> dict[str, bytes]:
    return {ep: bytes(t) for ep, t in (await index.lookup_async(keys, ENDPOINTS)).items()}


async def test_turns_walk_only_their_new_blocks_and_match_as_a_full_walk_does():
    index, memo, registry, _ = setup()
    replica = Replica(index, "a")
    rng = random.Random(2)
    tokens = [rng.randrange(100) for _ in range(400)]
    previous = None
    for _turn in range(10):
        keys = index.keyer.request_keys(tokens, "m")
        shared = 0 if previous is None else next(
            (i for i, (x, y) in enumerate(zip(previous, keys)) if x != y), min(len(previous), len(keys)))
        runs = await memo.match(index.lookup_async, keys, ENDPOINTS, previous[-1] if previous else None, shared)
        assert runs == await full(index, keys)
        replica.store(tokens)  # the replica prefilled this turn
        previous = keys
        tokens = tokens + [rng.randrange(100) for _ in range(rng.randint(1, 40))]
    assert registry.get_sample_value("epp_kv_match_memo_lookups_total", {"walk": "incremental"}) == 9
    assert registry.get_sample_value("epp_kv_match_memo_lookups_total", {"walk": "full"}) == 1
    assert len(memo) == 1  # a turn's entry replaces its previous turn's


async def test_an_endpoint_that_lost_its_tail_or_newly_holds_the_head_is_walked_in_full():
    index, memo, _, _ = setup()
    a, b = Replica(index, "a"), Replica(index, "b")
    tokens = list(range(200))
    a.store(tokens)
    keys = index.keyer.request_keys(tokens, "m")
    await memo.match(index.lookup_async, keys, ENDPOINTS, None, 0)
    a.evict_tail(10)  # vLLM frees a request's blocks tail first
    b.store(tokens[:120])  # another replica got the head meanwhile
    tokens2 = tokens + list(range(300, 340))
    keys2 = index.keyer.request_keys(tokens2, "m")
    runs = await memo.match(index.lookup_async, keys2, ENDPOINTS, keys[-1], len(keys))
    assert runs == await full(index, keys2)
    assert len(runs["a"]) == 40 and len(runs["b"]) == 30


async def test_a_remembered_match_older_than_its_age_bound_is_walked_again():
    index, memo, registry, clock = setup(max_age_s=5.0)
    Replica(index, "a").store(list(range(100)))
    keys = index.keyer.request_keys(list(range(100)), "m")
    await memo.match(index.lookup_async, keys, ENDPOINTS, None, 0)
    clock.now = 4.0
    keys2 = index.keyer.request_keys(list(range(104)), "m")
    await memo.match(index.lookup_async, keys2, ENDPOINTS, keys[-1], len(keys))
    clock.now = 6.0  # 6 s after the full walk that the last match continued
    keys3 = index.keyer.request_keys(list(range(108)), "m")
    await memo.match(index.lookup_async, keys3, ENDPOINTS, keys2[-1], len(keys2))
    assert registry.get_sample_value("epp_kv_match_memo_lookups_total", {"walk": "full"}) == 2


async def test_the_memo_stays_within_its_byte_budget():
    index, memo, registry, _ = setup(capacity=2_000)
    replica = Replica(index, "a")
    for i in range(20):
        tokens = [i] * 4 + list(range(400))  # 101 blocks each, one endpoint: ~300 bytes an entry
        replica.store(tokens)
        await memo.match(index.lookup_async, index.keyer.request_keys(tokens, "m"), ENDPOINTS, None, 0)
    assert memo.bytes <= 2_000
    assert registry.get_sample_value("epp_kv_match_memo_bytes") == memo.bytes
    assert registry.get_sample_value("epp_kv_match_memo_evictions_total") >= 10
