"""The KV block index knows the pool (P/D role) each endpoint's blocks live in."""

from __future__ import annotations

from epp.kvevents.index import DEFAULT_POOL
from tests.kvevents import wire
from tests.kvevents.test_index import TOKENS, apply, make_index, metric

P, D, AGG = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"
POOL_ENTRIES = "epp_kv_index_pool_entries"


def keys_of(index, tokens):
    return index.keyer.request_keys(tokens, "m")


def test_blocks_are_counted_and_looked_up_per_pool():
    index, registry = make_index()
    index.set_pool(P, "prefill")
    index.set_pool(D, "decode")
    # The prefiller computed the prompt; the decoder received the same blocks (NIXL) and published them.
    for ep in (P, D, AGG):
        apply(index, ep, wire.stored([1, 2, 3, 4], TOKENS[:16]))
    keys = keys_of(index, TOKENS[:16])
    assert index.pool_of(AGG) == DEFAULT_POOL
    assert index.pool_entries() == {DEFAULT_POOL: 4, "prefill": 4, "decode": 4}
    assert metric(registry, POOL_ENTRIES, {"pool": "decode"}) == 4
    assert sorted(index.lookup(keys, pool="decode")) == [D]
    assert sorted(index.lookup(keys, pool="prefill")) == [P]
    assert sorted(index.lookup(keys)) == sorted([P, D, AGG])
    assert index.pools_holding(keys[0]) == {"prefill": [P], "decode": [D], DEFAULT_POOL: [AGG]}

    # The prefiller frees its blocks after the transfer: only the decode copy is left in that pool set.
    apply(index, P, wire.removed([3, 4]))
    assert index.pool_entries()["prefill"] == 2
    assert index.pools_holding(keys[3]) == {"decode": [D], DEFAULT_POOL: [AGG]}
    index.remove_endpoint(D)
    assert index.pool_entries()["decode"] == 0
    assert metric(registry, POOL_ENTRIES, {"pool": "decode"}) == 0


def test_relabelled_endpoint_moves_its_entries_and_capacity_eviction_keeps_counts_right():
    index, _ = make_index(capacity=6)
    apply(index, P, wire.stored([1, 2, 3, 4], TOKENS[:16]))
    assert index.pool_entries()[DEFAULT_POOL] == 4
    index.set_pool(P, "prefill")
    assert index.pool_entries() == {DEFAULT_POOL: 0, "prefill": 4}
    index.set_pool(D, "decode")
    apply(index, D, wire.stored([11, 12, 13, 14], TOKENS[:16]))  # 8 entries > capacity 6
    counts = index.pool_entries()
    assert counts["prefill"] + counts["decode"] == index.entries <= 6
