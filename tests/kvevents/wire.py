"""Build vLLM-shaped KV-event payloads in tests, with msgspec structs declared as vLLM declares them.

Map form (vLLM >= #42892, 0.33.0): events are maps tagged by "type", batch is an array.
Legacy form: events are tagged arrays (`array_like=True`), fields in declaration order.
"""

from __future__ import annotations

from typing import Any

import msgspec


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class MapEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(MapEvent):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(MapEvent):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(MapEvent):
    pass


class LegacyEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class LegacyBlockStored(LegacyEvent, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None = None
    lora_name: str | None = None


class LegacyBlockRemoved(LegacyEvent, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None = None


class LegacyAllBlocksCleared(LegacyEvent, tag="AllBlocksCleared"):
    pass


_encoder = msgspec.msgpack.Encoder()


def encode_batch(events: list[Any], ts: float = 1.5, dp_rank: int | None = 0) -> bytes:
    """A batch as vLLM's publisher encodes it: `[ts, [events...], dp_rank]`."""
    return _encoder.encode(EventBatch(ts, events, dp_rank))


def stored(hashes: list[int], tokens: list[int], parent: int | None = None, block_size: int = 4,
           medium: str = "GPU", lora_name: str | None = None, extra_keys: list[Any] | None = None,
           **kw: Any) -> BlockStored:
    """A map-form BlockStored with vLLM's always-present fields."""
    return BlockStored(hashes, parent, tokens, block_size, None, medium, lora_name, extra_keys, **kw)


def removed(hashes: list[int], medium: str = "GPU") -> BlockRemoved:
    return BlockRemoved(hashes, medium, 0)


def placeholder(hashes: list[int], medium: str = "CPU") -> BlockStored:
    """An offload event without tokens, as OffloadingConnector emits by default."""
    return BlockStored(hashes, None, [], 0, None, medium, None, group_idx=0)
