"""Build vLLM-shaped KV-event payloads in tests, with the project's own publisher structs.

The structs are those `epp.engine.kv_publisher` publishes with (declared as vLLM declares them):
map form (vLLM >= #42892, 0.33.0), events are maps tagged by "type" in an array batch.
`legacy(...)` gives the older tagged-array form of an event.

No second copy of the structs here: the publisher's encoding is checked against oracles that do
not share its types, so a bug in it cannot hide behind these builders: literal msgpack maps read
by a plain SUB (tests/sim/test_kv_events.py) and the frames a real vLLM sent
(tests/fixtures/vllm_capture, compared in tests/sim/test_vllm_fidelity.py and decoded in
tests/kvevents/test_decoding.py).
"""

from __future__ import annotations

from typing import Any

import msgspec

from epp.engine.kv_publisher import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
    legacy_array_form,
)

_encoder = msgspec.msgpack.Encoder()


def encode_batch(events: list[Any], ts: float = 1.5, dp_rank: int | None = 0) -> bytes:
    """A batch as vLLM's publisher encodes it: `[ts, [events...], dp_rank]`."""
    return _encoder.encode(KVEventBatch(ts, events, dp_rank))


def stored(hashes: list[int], tokens: list[int], parent: int | None = None, block_size: int = 4,
           medium: str = "GPU", lora_name: str | None = None, extra_keys: list[Any] | None = None,
           **kw: Any) -> BlockStored:
    """A map-form BlockStored with vLLM's always-present fields."""
    return BlockStored(list(hashes), parent, tokens, block_size, None, medium, lora_name, extra_keys, **kw)


def removed(hashes: list[int], medium: str = "GPU") -> BlockRemoved:
    return BlockRemoved(list(hashes), medium, 0)


def placeholder(hashes: list[int], medium: str = "CPU") -> BlockStored:
    """An offload event without tokens, as OffloadingConnector emits by default."""
    return BlockStored(list(hashes), None, [], 0, None, medium, None, group_idx=0)


def legacy(event: KVEvent) -> list[Any]:
    """The event in the pre-map tagged-array form `[tag, field1, field2, ...]`."""
    return legacy_array_form(event)


__all__ = ["AllBlocksCleared", "encode_batch", "legacy", "placeholder", "removed", "stored"]
