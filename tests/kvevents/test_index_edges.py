"""KV index edges the compact layout must keep: LRU order and batch eviction, eviction across tiers,
speculative expiry per endpoint, endpoint removal (and id reuse), many holders, compact blocks."""

from __future__ import annotations

import pytest

from epp.kvevents.decoding import Tier
from epp.kvevents.index import MAX_ENDPOINTS
from tests.kvevents import wire
from tests.kvevents.test_index import TOKENS, Clock, apply, make_index, matched, metric

A, B, C = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"


def prompt(p: int, blocks: int = 2) -> list[int]:
    return [p * 1000 + i for i in range(4 * blocks)]


def store_prompt(index, endpoint, p: int, blocks: int = 2) -> None:
    """Prompt `p` as one chain of `blocks` engine blocks of 4 tokens (engine hashes p*100+j)."""
    apply(index, endpoint, wire.stored([p * 100 + j for j in range(blocks)], prompt(p, blocks)))


def test_a_restored_block_is_touched_like_a_matched_one():
    index, _ = make_index(capacity=4)
    store_prompt(index, A, 0)
    store_prompt(index, A, 1)
    # vLLM announces prompt 0's blocks again (re-cached): prompt 1 is now the least recently used.
    store_prompt(index, A, 0)
    store_prompt(index, A, 2)
    assert matched(index, prompt(1), A) == []
    assert matched(index, prompt(0), A) == [Tier.GPU] * 2
    assert matched(index, prompt(2), A) == [Tier.GPU] * 2


def test_a_lookup_touches_only_the_blocks_it_matched():
    index, _ = make_index(capacity=6)
    store_prompt(index, A, 0, blocks=3)
    store_prompt(index, A, 1, blocks=3)
    # Only the first block of prompt 0 is asked for: its two other blocks stay the oldest.
    assert matched(index, prompt(0)[:4], A) == [Tier.GPU]
    store_prompt(index, A, 2, blocks=2)
    assert matched(index, prompt(0, 3), A) == [Tier.GPU]
    assert matched(index, prompt(1, 3), A) == [Tier.GPU] * 3


@pytest.mark.parametrize("stored_first", [2, 3])
def test_a_lookup_touches_what_it_matched_once_the_index_is_past_half_its_capacity(stored_first):
    """At half the capacity or below a match leaves the order alone (nothing is near eviction); past it, it touches."""
    index, _ = make_index(capacity=8)
    for p in range(stored_first):
        store_prompt(index, A, p)
    assert matched(index, prompt(0), A) == [Tier.GPU] * 2  # at 4 of 8 entries: not touched; at 6: touched
    for p in range(stored_first, 5):
        store_prompt(index, A, p)  # the fifth prompt goes over capacity: the oldest two entries go
    gone = 0 if stored_first == 2 else 1
    assert matched(index, prompt(gone), A) == []
    assert matched(index, prompt(1 - gone), A) == [Tier.GPU] * 2


def test_over_capacity_the_least_recently_used_keys_go_first_a_batch_at_a_time():
    capacity = 512  # large enough for a batch: evicts down to 510 (capacity - capacity // 256)
    index, registry = make_index(capacity=capacity)
    for p in range(capacity // 2):
        store_prompt(index, A, p)
    assert index.entries == capacity
    assert matched(index, prompt(0), A) == [Tier.GPU] * 2  # touched: now the most recently used
    store_prompt(index, A, 999)
    evicted = capacity + 2 - (capacity - capacity // 256)
    assert metric(registry, "epp_kv_index_evictions_total") == evicted == 4
    assert index.entries == capacity - capacity // 256
    assert matched(index, prompt(1), A) == [] and matched(index, prompt(2), A) == []
    assert matched(index, prompt(0), A) == [Tier.GPU] * 2
    assert matched(index, prompt(3), A) == [Tier.GPU] * 2
    assert matched(index, prompt(999), A) == [Tier.GPU] * 2


def test_eviction_takes_a_key_from_every_endpoint_and_tier_and_later_events_still_apply():
    index, registry = make_index(capacity=4)
    index.set_pool(B, "decode")
    apply(index, A, wire.stored([1, 2], TOKENS[:8]))
    apply(index, A, wire.placeholder([1, 2], "CPU"))
    apply(index, B, wire.stored([1, 2], TOKENS[:8], medium="CPU"))
    assert index.entries == 4 and index.pool_entries() == {"both": 2, "decode": 2}
    key0, key1 = index.keyer.request_keys(TOKENS[:8], "m")
    store_prompt(index, C, 5)  # 6 entries: the oldest key (A on GPU+CPU, B on CPU) goes
    assert index.entries == 4 and metric(registry, "epp_kv_index_evictions_total") == 2
    assert index.pool_entries() == {"both": 3, "decode": 1}
    assert index.tiers_of(key0, A) == set() and index.tiers_of(key0, B) == set()
    assert index.tiers_of(key1, A) == {Tier.GPU, Tier.CPU} and index.tiers_of(key1, B) == {Tier.CPU}
    assert matched(index, TOKENS, A) == [] and matched(index, TOKENS, B) == []
    # The engines still hold those blocks: their removals apply cleanly, a re-store indexes them again.
    stats = apply(index, A, wire.removed([1, 2], "GPU"), wire.removed([1, 2], "CPU"))
    assert stats.dropped == {} and index.engine_blocks(A) == 0 and index.tiers_of(key1, A) == set()
    apply(index, B, wire.stored([1, 2], TOKENS[:8], medium="CPU"))
    assert matched(index, TOKENS, B) == [Tier.CPU] * 2
    assert index.pool_entries() == {"both": 2, "decode": 2} and index.entries == 4


def test_speculative_claims_expire_per_endpoint_and_leave_confirmed_blocks():
    clock = Clock()
    index, _ = make_index(clock=clock, speculative_ttl_s=2.0)
    apply(index, A, wire.stored([1], TOKENS[:4]))
    keys = index.keyer.request_keys(TOKENS[:12], "m")
    assert index.add_speculative(A, keys) == 2  # block 0 is held by A already
    assert index.add_speculative(B, keys) == 3
    assert index.lookup(keys, [A, B]) == {A: [Tier.GPU] * 3, B: [Tier.GPU] * 3}
    clock.now += 1.0
    index.add_speculative(B, keys[:1], ttl_s=5.0)  # B's first block claimed again, for longer
    clock.now += 1.5  # the first claims expired
    assert index.speculative_entries() == 1
    assert index.lookup(keys, [A, B]) == {A: [Tier.GPU], B: [Tier.GPU]}
    clock.now += 5.0
    assert index.lookup(keys, [A, B]) == {A: [Tier.GPU]} and index.speculative_entries() == 0


def test_removing_an_endpoint_clears_its_holders_and_its_claims_and_a_newcomer_inherits_nothing():
    index, _ = make_index()
    apply(index, A, wire.stored([1, 2], TOKENS[:8]))
    apply(index, B, wire.stored([7, 8], TOKENS[:8]))
    apply(index, B, wire.placeholder([7], "CPU"))
    keys = index.keyer.request_keys(TOKENS[:12], "m")
    index.add_speculative(B, keys)
    assert index.remove_endpoint(B) == 2
    assert matched(index, TOKENS, B) == [] and index.speculative_entries() == 0
    assert matched(index, TOKENS, A) == [Tier.GPU] * 2 and index.entries == 2
    assert index.tiers_of(keys[0], B) == set()
    # C comes after B left (and may reuse B's slot): it holds only what its own events say.
    apply(index, C, wire.stored([3], TOKENS[:4]))
    assert matched(index, TOKENS, C) == [Tier.GPU]
    assert index.contents() == {keys[0]: {A: frozenset({Tier.GPU}), C: frozenset({Tier.GPU})},
                                keys[1]: {A: frozenset({Tier.GPU})}}


def test_many_endpoints_on_one_key_keep_their_own_tiers():
    index, _ = make_index()
    endpoints = [f"10.0.1.{i}:8000" for i in range(9)]
    for i, ep in enumerate(endpoints):
        apply(index, ep, wire.stored([1, 2], TOKENS[:8], medium="CPU" if i % 3 == 1 else "GPU"))
    key0 = index.keyer.request_keys(TOKENS, "m")[0]
    assert index.entries == 18
    found = index.lookup(index.keyer.request_keys(TOKENS, "m"))
    assert found == {ep: [Tier.CPU if i % 3 == 1 else Tier.GPU] * 2 for i, ep in enumerate(endpoints)}
    apply(index, endpoints[4], wire.removed([2], "CPU"))  # one holder in the middle loses block 1
    apply(index, endpoints[5], wire.placeholder([1], "STORAGE"))
    assert index.tiers_of(key0, endpoints[5]) == {Tier.GPU, Tier.DISK}
    assert matched(index, TOKENS, endpoints[4]) == [Tier.CPU]
    assert matched(index, TOKENS, endpoints[6]) == [Tier.GPU] * 2
    assert sorted(index.pools_holding(key0)["both"]) == sorted(endpoints)


def test_a_block_announced_again_keeps_its_offloaded_copy():
    index, _ = make_index()
    apply(index, A, wire.stored([1, 2], TOKENS[:8]))
    apply(index, A, wire.placeholder([1], "CPU"))
    apply(index, A, wire.removed([1], "GPU"))
    assert matched(index, TOKENS, A) == [Tier.CPU, Tier.GPU]
    apply(index, A, wire.stored([1, 2], TOKENS[:8]))  # recomputed on GPU: both tiers now
    key0 = index.keyer.request_keys(TOKENS, "m")[0]
    assert index.tiers_of(key0, A) == {Tier.GPU, Tier.CPU}
    apply(index, A, wire.removed([1], "CPU"))
    assert index.tiers_of(key0, A) == {Tier.GPU}
    apply(index, A, wire.removed([1, 2], "GPU"))
    assert matched(index, TOKENS, A) == [] and index.engine_blocks(A) == 0 and index.entries == 0


def test_engine_map_is_trimmed_oldest_first_a_batch_at_a_time():
    index, registry = make_index(engine_capacity_per_endpoint=512)
    for p in range(256):
        store_prompt(index, A, p)
    store_prompt(index, A, 999)
    assert index.engine_blocks(A) == 512 - 512 // 256
    assert metric(registry, "epp_kv_index_engine_key_evictions_total") == 4
    assert matched(index, prompt(0), A) == [] and matched(index, prompt(1), A) == []
    assert matched(index, prompt(2), A) == [Tier.GPU] * 2


def test_endpoint_slots_are_bounded_and_freed_by_removal():
    index, _ = make_index()
    for i in range(MAX_ENDPOINTS):
        index.add_speculative(f"ep-{i}", [1])
    with pytest.raises(ValueError, match="at most"):
        index.add_speculative("one-too-many", [1])
    index.remove_endpoint("ep-0")
    assert index.add_speculative("one-too-many", [1]) == 1
