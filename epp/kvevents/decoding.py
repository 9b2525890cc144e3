"""Decode vLLM KV-event batches (msgpack) into our own typed events, tolerant of format churn.

Accepted shapes (see vLLM `kv_events.py` history):
- batch: an array `[ts, events, data_parallel_rank?]` or a map `{ts, events, data_parallel_rank}`;
- event: a map with the tag under `"type"` (vLLM >= #42892) or a legacy tagged array
  `[tag, field1, field2, ...]` in declaration order, trailing defaults omitted.
Unknown fields and unknown event types are skipped and counted, never fatal.

vLLM publishes one BlockRemoved per evicted block, so a 100k-token prefill into a full cache sends
thousands: consecutive removals of one tier and KV group decode as one `BlockRemoved` (its `events`
says how many it stands for). vLLM's own shapes (an array batch of map events with known fields) are
decoded into typed structs at C speed; any other batch takes the general path, event by event.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
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


_TIER_OF_NAME: dict[str, Tier] = {}  # media names seen, at most 256: the per-event lookup skips normalising


def tier_for_medium(medium: Any) -> Tier:
    """Map a vLLM `medium` to a tier: None → GPU (vLLM's main pool); an unknown name → DISK.

    An unknown medium is some offload tier we cannot name; treating it as the slowest tier keeps
    routing from overrating it, while still counting it as cached.
    """
    if medium is None:
        return Tier.GPU
    if medium.__class__ is str:
        tier = _TIER_OF_NAME.get(medium)
        if tier is None:
            tier = _MEDIUM_TIERS.get(medium.strip().lower(), Tier.DISK)
            if len(_TIER_OF_NAME) < 256:
                _TIER_OF_NAME[medium] = tier
        return tier
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


# The decoded events are frozen msgspec structs: built at C speed (a 100k-token turn can bring thousands).
class BlockStored(msgspec.Struct, frozen=True, gc=False):
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


class BlockRemoved(msgspec.Struct, frozen=True, gc=False):
    """Blocks evicted from one tier; `events`: the engine's consecutive removals this one stands for."""

    block_hashes: tuple[int, ...]
    tier: Tier
    group_idx: int | None = None
    events: int = 1


class AllBlocksCleared(msgspec.Struct, frozen=True, gc=False):
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
_HASH_TYPES = frozenset({int, bytes})


# vLLM's own shapes, decoded at C speed: an array batch of map events with known fields only. Anything
# else (the legacy array form, a new field, a value of another type) fails validation and the batch
# takes the general path, which accepts it and counts what it skips.
class _WireStored(msgspec.Struct, tag="BlockStored", tag_field="type", forbid_unknown_fields=True, gc=False):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None = None
    token_ids: list[int] | None = None
    block_size: int | None = None
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: Any = None
    locality: Any = None
    ownership: Any = None
    session_id: Any = None
    lookahead_token_ids: Any = None


class _WireRemoved(msgspec.Struct, tag="BlockRemoved", tag_field="type", forbid_unknown_fields=True, gc=False):
    block_hashes: list[int | bytes]
    medium: str | None = None
    group_idx: int | None = None
    locality: Any = None
    ownership: Any = None


class _WireCleared(msgspec.Struct, tag="AllBlocksCleared", tag_field="type", forbid_unknown_fields=True,
                   gc=False):
    pass


class _WireBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_WireStored | _WireRemoved | _WireCleared]
    data_parallel_rank: int | None = None


_wire_decoder = msgspec.msgpack.Decoder(_WireBatch)


def decode_batch(payload: bytes) -> DecodedBatch:
    """Decode one msgpack batch; raises `KVEventDecodeError` only if it is not a batch at all."""
    try:
        batch = _from_wire(_wire_decoder.decode(payload))
    except (msgspec.DecodeError, ValueError, TypeError):
        batch = None
    return batch if batch is not None else _decode_general(payload)


def _from_wire(wire: _WireBatch) -> DecodedBatch | None:
    """Our events from vLLM's shapes, checked as the general path checks them; None: let it judge."""
    batch = DecodedBatch(ts=wire.ts, events=[], data_parallel_rank=wire.data_parallel_rank)
    removals = _RemovalRun(batch.events)
    for ev in wire.events:
        cls = ev.__class__
        if cls is _WireRemoved:
            hashes = _plain_hashes(ev.block_hashes) if ev.block_hashes else None
            if hashes is None:
                return None
            removals.add(hashes, tier_for_medium(ev.medium), ev.group_idx)
            continue
        removals.flush()
        if cls is _WireCleared:
            batch.events.append(AllBlocksCleared())
            continue
        hashes = _plain_hashes(ev.block_hashes) if ev.block_hashes else []
        block_size = ev.block_size or 0
        if hashes is None or block_size < 0:
            return None
        parent = ev.parent_block_hash
        extra = ev.extra_keys
        batch.events.append(BlockStored(
            tuple(hashes), None if parent is None else block_hash_to_int(parent),
            tuple(ev.token_ids) if ev.token_ids else (), block_size,
            tier_for_medium(ev.medium), ev.lora_name or None, None if extra is None else tuple(extra),
            ev.group_idx, ev.kv_cache_spec_kind))
    removals.flush()
    return batch


def _decode_general(payload: bytes) -> DecodedBatch:
    """Any batch shape the module docstring accepts, each event checked on its own."""
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
    removals = _RemovalRun(batch.events)
    for raw_event in events:
        event = _decode_event(raw_event, batch)
        if event.__class__ is BlockRemoved:
            removals.add(event.block_hashes, event.tier, event.group_idx)  # type: ignore[union-attr]
        elif event is not None:
            removals.flush()
            batch.events.append(event)
    removals.flush()
    return batch


class _RemovalRun:
    """Consecutive removals of one tier and KV group, gathered into one `BlockRemoved` (order kept:
    any other event flushes the run first)."""

    __slots__ = ("events", "group_idx", "hashes", "out", "tier")

    def __init__(self, out: list[KVEvent]) -> None:
        self.out = out
        self.hashes: list[int] = []
        self.tier = Tier.GPU
        self.group_idx: int | None = None
        self.events = 0

    def add(self, hashes: Sequence[int], tier: Tier, group_idx: int | None) -> None:
        if self.events and (tier is not self.tier or group_idx != self.group_idx):
            self.flush()
        self.tier, self.group_idx = tier, group_idx
        self.hashes += hashes
        self.events += 1

    def flush(self) -> None:
        if self.events:
            self.out.append(BlockRemoved(tuple(self.hashes), self.tier, self.group_idx, self.events))
            self.hashes = []
            self.events = 0


def _plain_hashes(hashes: list[Any]) -> list[int] | None:
    """Block hashes (ints, negative int64s, bytes) as unsigned ints, at C speed for the usual ones; None if
    one is of another type."""
    kinds = set(map(type, hashes))
    if kinds == _INT_ONLY and min(hashes) >= 0:  # vLLM's usual hashes (msgpack ints stop at 2**64 - 1)
        return hashes
    if kinds <= _HASH_TYPES:
        return [block_hash_to_int(h) for h in hashes]
    return None


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


def _decode_event(raw_event: Any, batch: DecodedBatch) -> KVEvent | None:
    """One event of any accepted shape, or None (what was skipped is counted in `batch`)."""
    normalised = _as_fields(raw_event, batch)
    if normalised is None:
        return None
    tag, f = normalised
    try:
        if tag == "AllBlocksCleared":
            return AllBlocksCleared()
        hashes = f.get("block_hashes")
        if not isinstance(hashes, (list, tuple)):
            raise TypeError("block_hashes must be an array")
        block_hashes = tuple(block_hash_to_int(h) for h in hashes)
        group_idx = f.get("group_idx")
        group_idx = group_idx if isinstance(group_idx, int) and not isinstance(group_idx, bool) else None
        if tag == "BlockRemoved":
            return BlockRemoved(block_hashes, tier_for_medium(f.get("medium")), group_idx)
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
        return BlockStored(
            block_hashes=block_hashes,
            parent_block_hash=None if parent is None else block_hash_to_int(parent),
            token_ids=tuple(tokens),
            block_size=block_size,
            tier=tier_for_medium(f.get("medium")),
            lora_name=lora_name if isinstance(lora_name, str) and lora_name else None,
            extra_keys=tuple(extra) if isinstance(extra, (list, tuple)) else None,
            group_idx=group_idx,
            kv_cache_spec_kind=kind if isinstance(kind, str) else None,
        )
    except (TypeError, ValueError):
        batch.malformed_events += 1
        return None
