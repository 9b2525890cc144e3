"""Decoding vLLM KV-event batches: map and array forms, unknown fields and types, hashes, topics."""

from __future__ import annotations

import base64
import json
import random
from pathlib import Path

import msgspec
import pytest

from epp.kvevents import decoding
from epp.kvevents.decoding import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventDecodeError,
    Tier,
    block_hash_to_int,
    decode_batch,
    parse_topic,
    pod_endpoint_name,
    tier_for_medium,
)
from tests.kvevents import wire

CAPTURE = Path(__file__).parents[1] / "fixtures" / "vllm_capture"


def test_map_events_in_array_batch_decode_to_typed_events():
    payload = wire.encode_batch([
        wire.stored([11, 12], list(range(8)), parent=None, block_size=4, group_idx=0,
                    kv_cache_spec_kind="full_attention"),
        wire.removed([11]),
        wire.AllBlocksCleared(),
    ], ts=2.5, dp_rank=3)
    batch = decode_batch(payload)
    assert batch.ts == 2.5 and batch.data_parallel_rank == 3
    stored, removed, cleared = batch.events
    assert stored == BlockStored((11, 12), None, tuple(range(8)), 4, Tier.GPU, None, None, 0, "full_attention")
    assert removed == BlockRemoved((11,), Tier.GPU, 0)
    assert isinstance(cleared, AllBlocksCleared)
    assert batch.unknown_events == batch.unknown_fields == batch.malformed_events == 0


def test_legacy_tagged_arrays_decode_by_position_with_trailing_fields_omitted():
    payload = wire.encode_batch([
        wire.legacy(wire.stored([5], [1, 2, 3, 4], parent=4, medium="CPU", lora_name="adapter")),
        ["BlockStored", [6], None, [1, 2, 3, 4], 4, None],  # an older vLLM: medium and lora omitted
        wire.legacy(wire.removed([5], "STORAGE")),
        wire.legacy(wire.AllBlocksCleared()),
    ])
    raw = msgspec.msgpack.decode(payload)
    assert raw[1][0][0] == "BlockStored"  # really the positional form
    events = decode_batch(payload).events
    assert events[0] == BlockStored((5,), 4, (1, 2, 3, 4), 4, Tier.CPU, "adapter")
    assert events[1].tier is Tier.GPU and events[1].lora_name is None
    assert events[2] == BlockRemoved((5,), Tier.DISK, 0)
    assert isinstance(events[3], AllBlocksCleared)


def test_outer_map_batch_is_accepted():
    payload = msgspec.msgpack.encode({"ts": 1.0, "events": [{"type": "AllBlocksCleared"}],
                                      "data_parallel_rank": None})
    batch = decode_batch(payload)
    assert isinstance(batch.events[0], AllBlocksCleared) and batch.data_parallel_rank is None


def test_unknown_fields_and_event_types_are_skipped_and_counted():
    payload = msgspec.msgpack.encode([1.0, [
        {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": [1, 2],
         "block_size": 2, "lora_id": None, "medium": "GPU", "lora_name": None, "brand_new": 7},
        {"type": "BlockPinned", "block_hashes": [1]},
        ["BlockRemoved", [1], "GPU", 0, None, None, "future-positional"],
        ["SomethingElse", 1, 2],
        42,
        {"type": "BlockStored", "block_hashes": "not-a-list"},
    ], 0])
    batch = decode_batch(payload)
    assert [type(e).__name__ for e in batch.events] == ["BlockStored", "BlockRemoved"]
    assert batch.unknown_fields == 2
    assert batch.unknown_events == 2 and batch.skipped_types == {"BlockPinned": 1, "SomethingElse": 1}
    assert batch.malformed_events == 2


def test_consecutive_removals_of_one_tier_and_group_decode_as_one_event_in_order():
    # vLLM sends one BlockRemoved per evicted block; a run of them is read as one removal.
    payload = wire.encode_batch([
        wire.removed([1]), wire.removed([2]), wire.removed([3]),
        wire.stored([4], [1, 2, 3, 4], parent=None),
        wire.removed([5]), wire.legacy(wire.removed([6])),  # the array form joins a run too
        wire.removed([7], "CPU"),
        wire.BlockRemoved([8], "CPU", 1),
    ])
    events = decode_batch(payload).events
    assert events[0] == BlockRemoved((1, 2, 3), Tier.GPU, 0, events=3)
    assert isinstance(events[1], BlockStored)  # a store between removals keeps its place
    assert events[2:] == [BlockRemoved((5, 6), Tier.GPU, 0, events=2), BlockRemoved((7,), Tier.CPU, 0),
                          BlockRemoved((8,), Tier.CPU, 1)]


@pytest.mark.parametrize("event,expected", [
    ({"type": "BlockRemoved", "block_hashes": [-1], "medium": "GPU"}, (2**64 - 1,)),  # int64 reinterpreted
    ({"type": "BlockRemoved", "block_hashes": [b"\x00" * 24 + bytes(range(1, 9))], "medium": None},
     (0x0102030405060708,)),
    ({"type": "BlockRemoved", "block_hashes": [3, b"\x04"], "medium": "GPU"}, (3, 4)),  # mixed
])
def test_removal_hashes_in_every_accepted_form_read_as_unsigned_ints(event, expected):
    [removed] = decode_batch(msgspec.msgpack.encode([1.0, [event], 0])).events
    assert removed.block_hashes == expected and removed.tier is Tier.GPU


def _random_vllm_event(rnd: random.Random):
    def block_hash():
        return rnd.choice([rnd.getrandbits(64), rnd.randbytes(32), rnd.randrange(1 << 8)])

    medium = rnd.choice(["GPU", "CPU", "STORAGE", None])
    kind = rnd.random()
    if kind < 0.45:
        return wire.BlockRemoved([block_hash() for _ in range(rnd.randint(1, 3))], medium, rnd.choice([0, 1, None]))
    if kind < 0.95:
        n = rnd.randint(0, 3)
        return wire.stored([block_hash() for _ in range(n)], [rnd.randrange(50_000) for _ in range(4 * n)],
                           parent=rnd.choice([None, block_hash()]), medium=medium,
                           lora_name=rnd.choice([None, "", "adapter"]),
                           extra_keys=rnd.choice([None, [["salt"]] + [None] * max(0, n - 1)]),
                           group_idx=rnd.choice([0, 1, None]),
                           kv_cache_spec_kind=rnd.choice([None, "full_attention", "sliding_window"]))
    return wire.AllBlocksCleared()


def test_vllm_shaped_batches_decode_alike_on_the_fast_and_the_general_path():
    rnd = random.Random(43)
    for _ in range(300):
        payload = wire.encode_batch([_random_vllm_event(rnd) for _ in range(rnd.randint(0, 12))],
                                    ts=rnd.choice([1.5, 2]), dp_rank=rnd.choice([0, 3, None]))
        assert decoding._from_wire(decoding._wire_decoder.decode(payload)) is not None  # the fast path took it
        assert decode_batch(payload) == decoding._decode_general(payload)


def test_removals_with_unknown_fields_or_bad_hashes_still_count_what_they_skip():
    payload = msgspec.msgpack.encode([1.0, [
        {"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU", "brand_new": 1},
        {"type": "BlockRemoved", "block_hashes": [True], "medium": "GPU"},
        {"type": "BlockRemoved", "block_hashes": [2], "medium": ["GPU"]},
    ], 0])
    batch = decode_batch(payload)
    assert batch.events == [BlockRemoved((1,), Tier.GPU), BlockRemoved((2,), Tier.DISK)]
    assert batch.unknown_fields == 1 and batch.malformed_events == 1


@pytest.mark.parametrize("tokens", [[1, True], [1, 2.0], [1, "2"], [1, None], "12"])
def test_a_block_stored_whose_tokens_are_not_all_ints_is_malformed(tokens):
    payload = msgspec.msgpack.encode([1.5, [
        {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": tokens,
         "block_size": 2, "medium": "GPU"},
        {"type": "BlockStored", "block_hashes": [2], "parent_block_hash": 1, "token_ids": [3, 4],
         "block_size": 2, "medium": "GPU"},
    ], 0])
    batch = decode_batch(payload)
    assert batch.malformed_events == 1
    assert [e.token_ids for e in batch.events] == [(3, 4)]


@pytest.mark.parametrize("payload", [b"\xc1", msgspec.msgpack.encode("x"), msgspec.msgpack.encode([1.0])])
def test_a_payload_that_is_no_batch_raises_a_decode_error(payload):
    with pytest.raises(KVEventDecodeError):
        decode_batch(payload)


def test_hashes_as_int_negative_int64_and_bytes():
    assert block_hash_to_int(15760518052499183552) == 15760518052499183552
    assert block_hash_to_int(-1) == 2**64 - 1
    assert block_hash_to_int(-2) == 2**64 - 2
    digest = bytes(range(32))
    assert block_hash_to_int(digest) == int.from_bytes(digest[-8:], "big")
    assert block_hash_to_int(b"\x01\x02") == 0x0102  # left-padded
    payload = wire.encode_batch([wire.stored([digest], [1, 2, 3, 4], parent=b"\x00" * 31 + b"\x07")])
    event = decode_batch(payload).events[0]
    assert event.block_hashes == (int.from_bytes(digest[-8:], "big"),) and event.parent_block_hash == 7
    with pytest.raises(TypeError):
        block_hash_to_int("abc")


@pytest.mark.parametrize("medium,tier", [
    ("GPU", Tier.GPU), (None, Tier.GPU), ("CPU", Tier.CPU), ("cpu", Tier.CPU),
    ("STORAGE", Tier.DISK), ("disk", Tier.DISK), ("quantum-foam", Tier.DISK),
])
def test_medium_maps_to_tier_and_unknown_media_count_as_disk(medium, tier):
    assert tier_for_medium(medium) is tier


def test_topics_with_ip_port_ip_only_and_no_pod():
    topic = parse_topic(b"kv@10.0.0.7:8000@Qwen/Qwen3-0.6B")
    assert (topic.pod, topic.model, topic.has_port) == ("10.0.0.7:8000", "Qwen/Qwen3-0.6B", True)
    assert pod_endpoint_name(topic.pod) == "10.0.0.7:8000"
    ip_only = parse_topic("kv@10.0.0.7@tiny")
    assert (ip_only.pod, ip_only.model, ip_only.has_port) == ("10.0.0.7", "tiny", False)
    v6 = parse_topic("kv@[fd00::1]:8000@m")
    assert v6.has_port and pod_endpoint_name(v6.pod) == "[fd00::1]:8000"
    assert parse_topic(b"kv-events") == parse_topic(b"") == parse_topic("a@b")
    assert parse_topic(b"kv-events").pod is None


@pytest.mark.skipif(not (CAPTURE / "events.json").exists(), reason="no vLLM capture recorded")
def test_every_captured_vllm_frame_decodes_without_skips():
    frames = json.loads((CAPTURE / "events.json").read_text())
    kinds = set()
    for frame in frames:
        batch = decode_batch(base64.b64decode(frame["payload_b64"]))
        assert batch.unknown_events == batch.malformed_events == batch.unknown_fields == 0
        for event in batch.events:
            kinds.add(type(event).__name__)
            if isinstance(event, BlockStored):
                assert event.tier is Tier.GPU and len(event.token_ids) == 32 * len(event.block_hashes)
        assert parse_topic(frame["topic"]).model == "tiny"
    assert {"BlockStored", "BlockRemoved"} <= kinds
