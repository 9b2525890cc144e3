"""Decode vLLM KV-event batches (msgpack) into our own typed events, tolerant of format churn.

Accepted shapes (see vLLM `kv_events.py` history):
- batch: an array `[ts, events, data_parallel_rank?]` or a map `{ts, events, data_parallel_rank}`;
- event: a map with the tag under `"type"` (vLLM >= #42892) or a legacy tagged array
  `[tag, field1, field2, ...]` in declaration order, trailing defaults omitted.
Unknown fields and unknown event types are skipped and counted, never fatal.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import msgspec

_U64_MASK = (1 << 64) - 1

# Field order after the tag, as vLLM declares the structs (0.33.0, a superset of older layouts).
BLOCK_STORED_FIELDS: tuple[str, ...] = (
    "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
    "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window",
    "locality", "ownership", "session_id", "lookahead_token_ids",
)
BLOCK_REMOVED_FIELDS: tuple[str, ...] = ("block_hashes", "medium", "group_idx", "locality", "ownership")
_KNOWN_FIELDS = {
    "BlockStored": frozenset(BLOCK_STORED_FIELDS),
    "BlockRemoved": frozenset(BLOCK_REMOVED_FIELDS),
    "AllBlocksCleared": frozenset(),
}


class Tier(enum.IntEnum):
    """Where a cached block lives; lower is faster (the order is used to pick a block's best tier)."""

    GPU = 0
    CPU = 1
    DISK = 2

    @property
    def label(self) -> str:
        return self.name.lower()


_MEDIUM_TIERS = {
    "gpu": Tier.GPU, "hbm": Tier.GPU, "device": Tier.GPU, "cuda": Tier.GPU, "xpu": Tier.GPU,
    "cpu": Tier.CPU, "host": Tier.CPU, "dram": Tier.CPU,
    "storage": Tier.DISK, "disk": Tier.DISK, "ssd": Tier.DISK, "nvme": Tier.DISK, "fs": Tier.DISK,
    "file": Tier.DISK, "local_disk": Tier.DISK, "remote": Tier.DISK, "obj": Tier.DISK,
}


def tier_for_medium(medium: Any) -> Tier:
    """Map a vLLM `medium` to a tier: None → GPU (vLLM's main pool); an unknown name → DISK.

    An unknown medium is some offload tier we cannot name; treating it as the slowest tier keeps
    routing from overrating it, while still counting it as cached.
    """
    if medium is None:
        return Tier.GPU
    if isinstance(medium, bytes):
        medium = medium.decode("utf-8", "replace")
    if not isinstance(medium, str):
        return Tier.DISK
    return _MEDIUM_TIERS.get(medium.strip().lower(), Tier.DISK)


class KVEventDecodeError(ValueError):
    """The payload is not a KV-event batch at all (the whole message is skipped)."""


def block_hash_to_int(value: Any) -> int:
    """An engine block hash as an unsigned 64-bit int: ints (negative int64 reinterpreted) or bytes
    (last 8 bytes big-endian, shorter ones left-padded)."""
    if isinstance(value, bool):
        raise TypeError("a bool is not a block hash")
    if isinstance(value, int):
        return value & _U64_MASK
    if isinstance(value, (bytes, bytearray, memoryview)):
        return int.from_bytes(bytes(value)[-8:], "big")
    raise TypeError(f"block hash must be int or bytes, got {type(value).__name__}")


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks newly cached in one tier; `token_ids` may be empty for offload placeholders."""

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    tier: Tier
    lora_name: str | None = None
    extra_keys: tuple[Any, ...] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks evicted from one tier."""

    block_hashes: tuple[int, ...]
    tier: Tier
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The engine reset its prefix cache (every tier of this publisher)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(slots=True)
class DecodedBatch:
    """One decoded batch, with counts of what was skipped."""

    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None
    unknown_events: int = 0
    unknown_fields: int = 0
    malformed_events: int = 0
    skipped_types: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Topic:
    """A parsed topic: `kv@<pod>@<model>`; `pod` is `ip:port`, an IP alone, or None if not in the topic."""

    pod: str | None
    model: str | None

    @property
    def has_port(self) -> bool:
        return self.pod is not None and _split_hostport(self.pod) is not None


def _split_hostport(pod: str) -> tuple[str, int] | None:
    if pod.startswith("["):  # [v6]:port
        host, sep, port = pod[1:].partition("]:")
        return (host, int(port)) if sep and port.isdigit() else None
    if pod.count(":") == 1:
        host, _, port = pod.partition(":")
        return (host, int(port)) if port.isdigit() else None
    return None


def parse_topic(topic: bytes | str) -> Topic:
    """Parse `kv@<ip:port>@<model>` or `kv@<ip>@<model>`; any other topic carries no pod or model."""
    text = topic.decode("utf-8", "replace") if isinstance(topic, (bytes, bytearray)) else topic
    parts = text.split("@")
    if len(parts) == 3 and parts[1]:
        return Topic(parts[1], parts[2] or None)
    return Topic(None, None)


def pod_endpoint_name(pod: str) -> str:
    """The endpoint name (`ip:port`, IPv6 bracketed) for a topic pod id that carries a port."""
    split = _split_hostport(pod)
    if split is None:
        return pod
    host, port = split
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def pod_host(pod: str) -> str:
    """The address part of a topic pod id (`ip:port`, `[v6]:port` or a bare IP)."""
    split = _split_hostport(pod)
    return split[0] if split else pod.strip("[]")


_decoder = msgspec.msgpack.Decoder()
_INT_ONLY = frozenset({int})


def decode_batch(payload: bytes) -> DecodedBatch:
    """Decode one msgpack batch; raises `KVEventDecodeError` only if it is not a batch at all."""
    try:
        raw = _decoder.decode(payload)
    except (msgspec.DecodeError, ValueError) as exc:
        raise KVEventDecodeError(f"not msgpack: {exc}") from None
    if isinstance(raw, (list, tuple)):
        if len(raw) < 2:
            raise KVEventDecodeError("batch array shorter than [ts, events]")
        ts, events = raw[0], raw[1]
        dp_rank = raw[2] if len(raw) > 2 else None
    elif isinstance(raw, dict):
        ts, events, dp_rank = raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")
    else:
        raise KVEventDecodeError(f"batch must be an array or a map, got {type(raw).__name__}")
    if not isinstance(events, (list, tuple)):
        raise KVEventDecodeError("batch events must be an array")
    batch = DecodedBatch(
        ts=float(ts) if isinstance(ts, (int, float)) and not isinstance(ts, bool) else 0.0,
        events=[],
        data_parallel_rank=dp_rank if isinstance(dp_rank, int) and not isinstance(dp_rank, bool) else None,
    )
    for raw_event in events:
        _decode_event(raw_event, batch)
    return batch


def _as_fields(raw_event: Any, batch: DecodedBatch) -> tuple[str, dict[str, Any]] | None:
    """Normalise an event (map or tagged array) to (tag, fields by name); unknown ones are counted."""
    if isinstance(raw_event, dict):
        tag = raw_event.get("type")
        if not isinstance(tag, str):
            batch.malformed_events += 1
            return None
        known = _KNOWN_FIELDS.get(tag)
        if known is None:
            batch.unknown_events += 1
            batch.skipped_types[tag] = batch.skipped_types.get(tag, 0) + 1
            return None
        fields = {}
        for key, value in raw_event.items():
            if key == "type":
                continue
            if key in known:
                fields[key] = value
            else:
                batch.unknown_fields += 1
        return tag, fields
    if isinstance(raw_event, (list, tuple)) and raw_event and isinstance(raw_event[0], str):
        tag = raw_event[0]
        order = (BLOCK_STORED_FIELDS if tag == "BlockStored" else BLOCK_REMOVED_FIELDS
                 if tag == "BlockRemoved" else () if tag == "AllBlocksCleared" else None)
        if order is None:
            batch.unknown_events += 1
            batch.skipped_types[tag] = batch.skipped_types.get(tag, 0) + 1
            return None
        values = raw_event[1:]
        batch.unknown_fields += max(0, len(values) - len(order))
        return tag, dict(zip(order, values))
    batch.malformed_events += 1
    return None


def _decode_event(raw_event: Any, batch: DecodedBatch) -> None:
    normalised = _as_fields(raw_event, batch)
    if normalised is None:
        return
    tag, f = normalised
    try:
        if tag == "AllBlocksCleared":
            batch.events.append(AllBlocksCleared())
            return
        hashes = f.get("block_hashes")
        if not isinstance(hashes, (list, tuple)):
            raise TypeError("block_hashes must be an array")
        block_hashes = tuple(block_hash_to_int(h) for h in hashes)
        group_idx = f.get("group_idx")
        group_idx = group_idx if isinstance(group_idx, int) and not isinstance(group_idx, bool) else None
        if tag == "BlockRemoved":
            batch.events.append(BlockRemoved(block_hashes, tier_for_medium(f.get("medium")), group_idx))
            return
        parent = f.get("parent_block_hash")
        tokens = f.get("token_ids") or ()
        # Every token an int (not a bool), checked at C speed: a prompt chunk's event holds thousands.
        if not isinstance(tokens, (list, tuple)) or (tokens and not set(map(type, tokens)) <= _INT_ONLY):
            raise TypeError("token_ids must be an array of ints")
        block_size = f.get("block_size") or 0
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 0:
            raise TypeError("block_size must be a non-negative int")
        lora_name = f.get("lora_name")
        extra = f.get("extra_keys")
        kind = f.get("kv_cache_spec_kind")
        batch.events.append(BlockStored(
            block_hashes=block_hashes,
            parent_block_hash=None if parent is None else block_hash_to_int(parent),
            token_ids=tuple(tokens),
            block_size=block_size,
            tier=tier_for_medium(f.get("medium")),
            lora_name=lora_name if isinstance(lora_name, str) and lora_name else None,
            extra_keys=tuple(extra) if isinstance(extra, (list, tuple)) else None,
            group_idx=group_idx,
            kv_cache_spec_kind=kind if isinstance(kind, str) else None,
        ))
    except (TypeError, ValueError):
        batch.malformed_events += 1
