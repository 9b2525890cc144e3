"""The KV block index: dual keys, block-size mismatch, tiers, removal, clears, capacity, speculation."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from epp.kvevents.decoding import Tier, decode_batch
from epp.kvevents.index import KVBlockIndex
from epp.kvevents.keys import BlockKeyer
from epp.kvevents.metrics import KVIndexMetrics
from tests.kvevents import wire

CAPTURE = Path(__file__).parents[1] / "fixtures" / "vllm_capture"
MODEL = "m"
A, B = "10.0.0.1:8000", "10.0.0.2:8000"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make_index(block_size=4, capacity=10_000, **kw):
    registry = CollectorRegistry()
    index = KVBlockIndex(block_size, capacity, metrics=KVIndexMetrics(registry), **kw)
    return index, registry


def apply(index, endpoint, *events, model=MODEL):
    return index.apply_batch(endpoint, decode_batch(wire.encode_batch(list(events))), model)


def matched(index, tokens, endpoint, model=MODEL, salt=None):
    keys = index.keyer.request_keys(tokens, model, salt)
    return index.lookup(keys, [endpoint]).get(endpoint, [])


def metric(registry, name, labels=None):
    return registry.get_sample_value(name, labels or {}) or 0.0


TOKENS = list(range(100, 132))  # 32 tokens


def test_request_keys_depend_on_model_salt_and_prefix_only():
    keyer = BlockKeyer(4)
    keys = keyer.request_keys(TOKENS, "m")
    assert len(keys) == 8 and len(set(keys)) == 8
    assert keyer.request_keys(TOKENS[:10], "m") == keys[:2]  # partial tail has no key
    assert keyer.request_keys(TOKENS, "other")[0] != keys[0]
    assert keyer.request_keys(TOKENS, "m", "salt")[0] != keys[0]
    changed = TOKENS[:]
    changed[5] += 1
    assert keyer.request_keys(changed, "m")[:1] == keys[:1] and keyer.request_keys(changed, "m")[1] != keys[1]


def test_stored_blocks_are_found_through_request_keys_and_chained_events_continue():
    index, registry = make_index()
    apply(index, A, wire.stored([1, 2], TOKENS[:8]))
    apply(index, A, wire.stored([3, 4], TOKENS[8:16], parent=2))
    assert matched(index, TOKENS, A) == [Tier.GPU] * 4
    assert matched(index, TOKENS, B) == []
    assert metric(registry, "epp_kv_index_events_applied_total") == 2
    assert metric(registry, "epp_kv_index_entries") == 4
    # a different model never matches the same tokens
    assert matched(index, TOKENS, A, model="other") == []


def test_unknown_parent_is_dropped_and_counted():
    index, registry = make_index()
    stats = apply(index, A, wire.stored([9], TOKENS[4:8], parent=777))
    assert stats.dropped == {"unknown_parent": 1}
    assert index.entries == 0
    assert metric(registry, "epp_kv_index_events_dropped_total", {"reason": "unknown_parent"}) == 1


def test_engine_blocks_smaller_than_index_blocks_many_to_one_with_partial_tail():
    index, _ = make_index(block_size=8)
    # engine block 4: the first event ends half-way through index block 1
    apply(index, A, wire.stored([1, 2, 3], TOKENS[:12], block_size=4))
    assert matched(index, TOKENS, A) == [Tier.GPU]
    apply(index, A, wire.stored([4, 5], TOKENS[12:20], parent=3, block_size=4))
    assert matched(index, TOKENS, A) == [Tier.GPU, Tier.GPU]
    # removing the engine block from the earlier event that started index block 1 breaks it
    apply(index, A, wire.removed([3]))
    assert matched(index, TOKENS, A) == [Tier.GPU]
    apply(index, A, wire.removed([1]))
    assert matched(index, TOKENS, A) == []


def test_engine_blocks_larger_than_index_blocks_one_to_many():
    index, _ = make_index(block_size=4)
    apply(index, A, wire.stored([1, 2], TOKENS[:32], block_size=16))
    assert matched(index, TOKENS, A) == [Tier.GPU] * 8
    apply(index, A, wire.removed([2]))
    assert matched(index, TOKENS, A) == [Tier.GPU] * 4


def test_engine_block_not_a_multiple_of_index_block_keeps_tails_across_events():
    index, _ = make_index(block_size=5)
    apply(index, A, wire.stored([1, 2], TOKENS[:8], block_size=4))   # tail of 3 tokens
    apply(index, A, wire.stored([3, 4], TOKENS[8:16], parent=2, block_size=4))
    apply(index, A, wire.stored([5, 6], TOKENS[16:24], parent=4, block_size=4))
    assert len(matched(index, TOKENS, A)) == 24 // 5


def test_tiers_per_endpoint_offload_placeholders_and_removal_per_tier():
    index, _ = make_index()
    apply(index, A, wire.stored([1, 2], TOKENS[:8]))
    apply(index, A, wire.placeholder([1, 2], "CPU"))
    apply(index, A, wire.placeholder([1], "STORAGE"))
    apply(index, B, wire.stored([1, 2], TOKENS[:8], medium="CPU"))
    key0 = index.keyer.request_keys(TOKENS, MODEL)[0]
    assert index.tiers_of(key0, A) == {Tier.GPU, Tier.CPU, Tier.DISK}
    assert matched(index, TOKENS, A) == [Tier.GPU, Tier.GPU]
    assert matched(index, TOKENS, B) == [Tier.CPU, Tier.CPU]
    apply(index, A, wire.removed([1, 2], "GPU"))  # evicted from GPU, still offloaded
    assert matched(index, TOKENS, A) == [Tier.CPU, Tier.CPU]
    apply(index, A, wire.removed([1, 2], "CPU"))
    assert matched(index, TOKENS, A) == [Tier.DISK]  # block 2 was never on disk
    apply(index, A, wire.removed([1], "STORAGE"))
    assert matched(index, TOKENS, A) == [] and index.engine_blocks(A) == 0
    assert matched(index, TOKENS, B) == [Tier.CPU, Tier.CPU]  # other endpoint untouched


def test_a_run_of_single_block_removals_counts_every_engine_event():
    index, registry = make_index()
    apply(index, A, wire.stored([1, 2, 3, 4], TOKENS[:16]))
    stats = apply(index, A, *(wire.removed([h]) for h in (1, 2, 3, 4, 99)))
    assert stats.applied == 5 and stats.dropped == {"unknown_engine_key": 1}
    assert metric(registry, "epp_kv_index_events_applied_total") == 6
    assert matched(index, TOKENS, A) == [] and index.entries == 0


def test_offload_store_is_reference_counted_per_medium_and_hash():
    index, _ = make_index()
    apply(index, A, wire.stored([1], TOKENS[:4]))
    apply(index, A, wire.placeholder([1], "CPU"), wire.placeholder([1], "CPU"))  # chunk re-announced
    apply(index, A, wire.removed([1], "GPU"), wire.removed([1], "CPU"))
    assert matched(index, TOKENS, A) == [Tier.CPU]
    apply(index, A, wire.removed([1], "CPU"))
    assert matched(index, TOKENS, A) == []


def test_placeholder_for_an_unknown_engine_hash_is_dropped():
    index, _ = make_index()
    stats = apply(index, A, wire.placeholder([42], "CPU"))
    assert stats.dropped == {"unknown_engine_key": 1} and index.entries == 0


def test_all_blocks_cleared_and_endpoint_removal_touch_one_endpoint_only():
    index, _ = make_index()
    apply(index, A, wire.stored([1, 2], TOKENS[:8]))
    apply(index, B, wire.stored([1, 2], TOKENS[:8]))
    apply(index, A, wire.AllBlocksCleared())
    assert matched(index, TOKENS, A) == [] and matched(index, TOKENS, B) == [Tier.GPU] * 2
    apply(index, A, wire.stored([1], TOKENS[:4]))  # a fresh chain after the clear
    assert matched(index, TOKENS, A) == [Tier.GPU]
    index.remove_endpoint(B)
    assert matched(index, TOKENS, B) == [] and B not in index.endpoints()
    assert index.entries == 1


def test_lora_name_and_cache_salt_seed_the_chain():
    index, _ = make_index()
    apply(index, A, wire.stored([1, 2], TOKENS[:8], lora_name="sql-lora", extra_keys=[["sql-lora"], ["sql-lora"]]))
    apply(index, A, wire.stored([5, 6], TOKENS[:8], extra_keys=[["tenant-a"], None]))
    assert matched(index, TOKENS, A, model="sql-lora") == [Tier.GPU] * 2
    assert matched(index, TOKENS, A, salt="tenant-a") == [Tier.GPU] * 2
    assert matched(index, TOKENS, A) == []  # base model, unsalted: never stored


def test_multimodal_extra_keys_never_match_text_only_requests():
    index, _ = make_index()
    apply(index, A, wire.stored([1, 2], TOKENS[:8], extra_keys=[[["img-hash", 0]], None]))
    assert matched(index, TOKENS, A) == []


def test_other_kv_cache_groups_are_not_indexed():
    index, _ = make_index()
    stats = apply(index, A, wire.stored([1], TOKENS[:4], group_idx=1, kv_cache_spec_kind="sliding_window"))
    assert stats.dropped == {"other_kv_group": 1} and index.entries == 0


def test_longest_consecutive_run_stops_at_the_first_gap():
    index, _ = make_index()
    apply(index, A, wire.stored([1, 2, 3, 4], TOKENS[:16]))
    apply(index, A, wire.removed([2]))
    assert matched(index, TOKENS, A) == [Tier.GPU]


def test_capacity_evicts_least_recently_used_keys_and_counts_them():
    index, registry = make_index(capacity=4)
    prompts = [[p * 1000 + i for i in range(8)] for p in range(3)]
    apply(index, A, wire.stored([1, 2], prompts[0]))
    apply(index, A, wire.stored([3, 4], prompts[1]))
    assert matched(index, prompts[0], A) == [Tier.GPU] * 2  # touch prompt 0: prompt 1 is now LRU
    apply(index, A, wire.stored([5, 6], prompts[2]))
    assert index.entries == 4
    assert matched(index, prompts[1], A) == []
    assert matched(index, prompts[0], A) == [Tier.GPU] * 2
    assert matched(index, prompts[2], A) == [Tier.GPU] * 2
    assert metric(registry, "epp_kv_index_evictions_total") == 2


def test_engine_key_map_is_bounded_per_endpoint():
    index, _ = make_index(engine_capacity_per_endpoint=3)
    apply(index, A, wire.stored([1, 2, 3, 4], TOKENS[:16]))
    assert index.engine_blocks(A) == 3
    # the oldest engine block was forgotten, so the index stops claiming it
    assert matched(index, TOKENS, A) == []


def test_speculative_entries_count_until_ttl_and_confirmed_events_replace_them():
    clock = Clock()
    index, _ = make_index(clock=clock, speculative_ttl_s=2.0)
    keys = index.keyer.request_keys(TOKENS[:8], MODEL)
    assert index.add_speculative(A, keys) == 2
    assert index.lookup(keys, [A, B]) == {A: [Tier.GPU, Tier.GPU]}
    clock.now += 2.5
    assert index.lookup(keys, [A, B]) == {}
    index.add_speculative(A, keys)
    apply(index, A, wire.stored([1], TOKENS[:4], medium="CPU"))
    assert index.speculative_entries() == 1  # block 0 is confirmed (CPU), block 1 still speculative
    assert index.lookup(keys, [A]) == {A: [Tier.CPU, Tier.GPU]}
    clock.now += 2.5
    assert index.lookup(keys, [A]) == {A: [Tier.CPU]}


def test_lookup_hits_and_misses_are_counted_in_blocks():
    index, registry = make_index()
    apply(index, A, wire.stored([1, 2], TOKENS[:8]))
    matched(index, TOKENS[:16], A)
    assert metric(registry, "epp_kv_index_lookup_hit_blocks_total") == 2
    assert metric(registry, "epp_kv_index_lookup_miss_blocks_total") == 2


@pytest.mark.skipif(not (CAPTURE / "events.json").exists(), reason="no vLLM capture recorded")
def test_captured_vllm_events_index_the_captured_prompts():
    frames = json.loads((CAPTURE / "events.json").read_text())
    manifest = json.loads((CAPTURE / "manifest.json").read_text())
    requests = {r["name"]: r for r in json.loads((CAPTURE / "requests.json").read_text())}
    block = manifest["block_size"]
    index, registry = make_index(block_size=block)
    endpoint = f"127.0.0.1:{manifest['http_port']}"
    seen_full = {}
    for frame in frames:
        index.apply_batch(endpoint, decode_batch(base64.b64decode(frame["payload_b64"])), "tiny")
        for name, req in requests.items():
            got = len(matched(index, req["prompt_token_ids"], endpoint, model="tiny",
                              salt=req["body"].get("cache_salt")))
            seen_full[name] = max(seen_full.get(name, 0), got)
    assert metric(registry, "epp_kv_index_events_dropped_total", {"reason": "unknown_parent"}) == 0
    for name, req in requests.items():
        # every prompt was fully indexed at some point (full blocks only)
        assert seen_full[name] == len(req["prompt_token_ids"]) // block, name
    final = requests["prefix_a_again"]
    assert len(matched(index, final["prompt_token_ids"], endpoint, model="tiny")) == 385 // block
    # salted blocks are a different chain from the unsalted ones
    salted = requests["salted_prefix_a"]
    assert index.keyer.request_keys(salted["prompt_token_ids"], "tiny", "tenant-a")[0] != \
        index.keyer.request_keys(salted["prompt_token_ids"], "tiny")[0]


def test_an_offloaded_chunk_announced_by_its_last_hash_covers_the_whole_chunk():
    index, _ = make_index(offload_chunk_blocks=2)
    apply(index, A, wire.stored([1, 2, 3, 4], TOKENS[:16]))
    apply(index, A, wire.placeholder([2], "CPU"), wire.placeholder([4], "CPU"))  # chunks (1,2), (3,4)
    apply(index, A, wire.removed([1, 2, 3, 4], "GPU"))
    assert matched(index, TOKENS, A) == [Tier.CPU] * 4
    apply(index, A, wire.removed([2], "CPU"))  # the first chunk leaves the CPU tier
    assert matched(index, TOKENS, A) == [] and index.engine_blocks(A) == 2
    apply(index, A, wire.removed([4], "CPU"))
    assert index.engine_blocks(A) == 0 and index.entries == 0
