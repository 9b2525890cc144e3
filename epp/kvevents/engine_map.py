"""The engine map: an endpoint's decoded vLLM KV events turned into holder changes (key → endpoint → tier).

Dual keys: request keys come from token ids (see `keys.py`); each endpoint keeps a map from the
engine's block hash to the request keys its tokens fall in, so removals and token-less offload
events resolve without ever reproducing vLLM's hash. Both index backends apply events through
this one map; they differ only in where the holder changes go (`Holders`: the in-memory entries,
or writes queued for Redis).

Policies (documented because they are choices):
- Parent unknown: a `BlockStored` whose parent engine hash this endpoint never saw is dropped
  and counted (`reason="unknown_parent"`); only a first block (no parent) starts a new chain.
- Engine block size != index block size: tokens are regrouped into index blocks; a partial tail
  is kept on the engine block and continued by the child's event. An index block is mapped to
  every engine block that contributed tokens to it, so removing any of them removes the key.
- Offload chunks: vLLM announces an offloaded chunk of N GPU blocks by its last block's hash;
  with `offload_chunk_blocks=N` a CPU/disk event also covers the N-1 blocks before it in the chain.
- Tiers: GPU presence is a flag (vLLM may re-announce GPU blocks); CPU/disk presence is
  reference-counted per engine hash, as chunked offload re-announces shared hashes. A key stays
  on an endpoint while any tier holds it; an engine hash is forgotten when no tier holds it.
- Only KV-cache group 0 of kind full attention is indexed (hybrid models' sliding-window or
  mamba groups are evicted on their own schedule and would break prefixes); others are counted.
- Capacity (both backends): each endpoint's map holds at most `capacity_per_endpoint` engine
  hashes, the least recently announced dropped first (a re-announced block is re-inserted as the
  newest). Over capacity a map is trimmed to `capacity - capacity >> 8` at once: the oldest hashes
  are found by scanning the dict's front, past the slots of earlier deletions (a dict keeps them
  until it is resized), so trimming one hash per event at capacity pays that scan on every event;
  a batch pays it once per capacity/256 evictions. A forgotten block's holders are released (its
  removal can no longer be seen), counted in `epp_kv_index_engine_key_evictions_total`.
- Memory: an engine block that maps to one request key, on GPU only, with no partial tail is the
  request key itself in its endpoint's map (no object); other engine blocks (tails, several
  keys, CPU/disk counts, offload chunks, which walk parent links) are an `_EngineBlock`.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import islice
from typing import Any, Protocol

import xxhash

from epp.kvevents.decoding import AllBlocksCleared, BlockRemoved, BlockStored, DecodedBatch, Tier
from epp.kvevents.keys import BlockKeyer, media_extras
from epp.kvevents.metrics import KVIndexMetrics

BIT = (1, 2, 4)  # Tier -> its bit in a holder's tier mask
ALL_TIERS = 7
# Best (fastest) tier of a non-zero tier mask.
BEST_TIER = (Tier.GPU, Tier.GPU, Tier.CPU, Tier.GPU, Tier.DISK, Tier.GPU, Tier.CPU, Tier.GPU)
_GPU = Tier.GPU


def tiers_in(mask: int) -> frozenset[Tier]:
    """The tiers of a holder's tier mask."""
    return frozenset(t for t in Tier if mask & BIT[t])


# Over capacity, trim an endpoint's map down to capacity - capacity >> SLACK_SHIFT at once.
SLACK_SHIFT = 8


def trim_target(capacity: int) -> int:
    """The size a bounded map or index over `capacity` is trimmed to at once (see the module docstring)."""
    return capacity - (capacity >> SLACK_SHIFT)


class Holders(Protocol):
    """Where an engine map's holder changes go: the in-memory entries, or writes queued for Redis."""

    @abstractmethod
    def hold(self, endpoint: str, keys: Sequence[int], bits: int) -> None:
        """`endpoint` holds each of `keys` in the tiers of `bits` too (touched; confirms its claims)."""

    @abstractmethod
    def release(self, endpoint: str, keys: Iterable[int], bits: int) -> None:
        """`endpoint` no longer holds `keys` in the tiers of `bits`."""

    @abstractmethod
    def release_endpoint(self, endpoint: str, keys: Iterable[int]) -> int:
        """`endpoint` holds nothing any more (`keys`: all its map knew, claims too); entries released."""


# An engine block's per-tier counts packed in one int (21 bits a tier; GPU is a flag).
_COUNT_SHIFT = (0, 21, 42)
_COUNT_MASK = (1 << 21) - 1


def _count(eb: _EngineBlock, tier: int) -> int:
    return (eb.counts >> _COUNT_SHIFT[tier]) & _COUNT_MASK


def _set_count(eb: _EngineBlock, tier: int, value: int) -> None:
    shift = _COUNT_SHIFT[tier]
    eb.counts = (eb.counts & ~(_COUNT_MASK << shift)) | (min(value, _COUNT_MASK) << shift)


def _mask(eb: _EngineBlock) -> int:
    """The tiers holding an engine block, as holder bits."""
    counts = eb.counts
    return ((1 if counts & _COUNT_MASK else 0) | (2 if (counts >> 21) & _COUNT_MASK else 0)
            | (4 if counts >> 42 else 0))


def _keys_of(keys: int | list[int]) -> Sequence[int]:
    """An engine block's request keys: one key is held as the int itself, several as a list."""
    return (keys,) if keys.__class__ is int else keys  # type: ignore[return-value]


def _with_key(keys: int | list[int] | None, key: int) -> int | list[int]:
    """`keys` with `key` added (kept once)."""
    if keys is None:
        return key
    if keys.__class__ is int:
        return keys if keys == key else [keys, key]
    if key not in keys:  # type: ignore[operator]
        keys.append(key)  # type: ignore[union-attr]
    return keys


class _EngineBlock:
    """What an endpoint's engine block maps to when it is more than one request key on GPU: request
    keys, the chain to continue, the partial tail, tier counts. (The common block is the key itself.)"""

    __slots__ = ("chain_key", "counts", "hash", "keys", "parent", "tail", "tail_hashes")

    def __init__(self, block_hash: int) -> None:
        self.hash = block_hash
        self.parent: int | None = None  # the previous engine block's hash in this chain
        self.keys: int | list[int] = []
        self.chain_key = 0
        self.tail: tuple[int, ...] = ()
        self.tail_hashes: tuple[int, ...] = ()
        self.counts = 0  # packed per tier, see _count

    @classmethod
    def of_key(cls, block_hash: int, key: int) -> _EngineBlock:
        """The object form of a compact engine block (the request key itself: on GPU, no tail)."""
        eb = cls(block_hash)
        eb.keys = eb.chain_key = key
        eb.counts = 1
        return eb


# An engine map's value: the request key itself (one key, GPU only, no tail) or an _EngineBlock.
_EngineEntry = int | _EngineBlock


@dataclass
class ApplyStats:
    """What one batch did to the index."""

    applied: int = 0
    dropped: dict[str, int] = field(default_factory=dict)

    def drop(self, reason: str, n: int = 1) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + n


class EngineMap:
    """Per endpoint, engine block hash → request keys and tiers (bounded), fed by KV events; every
    change in what an endpoint holds goes to `holders`."""

    def __init__(self, keyer: BlockKeyer, holders: Holders, *, capacity_per_endpoint: int,
                 offload_chunk_blocks: int = 1, metrics: KVIndexMetrics) -> None:
        if capacity_per_endpoint < 1:
            raise ValueError("engine_capacity_per_endpoint must be >= 1")
        self.keyer = keyer
        self.block_size = keyer.block_size
        self.capacity = capacity_per_endpoint
        self.offload_chunk_blocks = max(1, offload_chunk_blocks)
        self.metrics = metrics
        self._maps: dict[str, dict[int, _EngineEntry]] = {}
        self._hold = holders.hold
        self._release = holders.release
        self._release_endpoint = holders.release_endpoint
        # Compact engine blocks need no parent link: only offload chunks of several blocks walk it.
        self._compact = self.offload_chunk_blocks == 1

    def endpoints(self) -> list[str]:
        """Endpoints with a map (any stored event applied since their last clear)."""
        return list(self._maps)

    def blocks(self, endpoint: str) -> int:
        """Engine hashes known for `endpoint` (at most `capacity_per_endpoint`)."""
        return len(self._maps.get(endpoint, ()))

    def held(self, endpoint: str, slice_size: int) -> Iterator[list[tuple[Sequence[int], int]]]:
        """What `endpoint`'s blocks hold, (request keys, tier bits) per block, `slice_size` blocks at
        a time, each slice read when it is asked for; ends early once the endpoint is cleared."""
        blocks = self._maps.get(endpoint)
        if not blocks:
            return
        hashes = list(blocks)
        for i in range(0, len(hashes), slice_size):
            if self._maps.get(endpoint) is not blocks:
                return
            out: list[tuple[Sequence[int], int]] = []
            for h in hashes[i:i + slice_size]:
                entry = blocks.get(h)
                if entry is None:
                    continue
                if entry.__class__ is int:
                    out.append(((entry,), 1))
                elif mask := _mask(entry):  # type: ignore[arg-type]
                    out.append((_keys_of(entry.keys), mask))  # type: ignore[union-attr]
            yield out

    def clear(self, endpoint: str) -> int:
        """Forget `endpoint`'s map and release all it held (AllBlocksCleared, restart, lost events)."""
        blocks = self._maps.pop(endpoint, None)
        return self._release_endpoint(endpoint, _all_keys(blocks) if blocks else ())

    # ---- events ------------------------------------------------------------------------------
    def apply(self, endpoint: str, batch: DecodedBatch, model: str | None) -> ApplyStats:
        """Apply one decoded batch from `endpoint`'s publisher; `model` is the topic's model."""
        stats = ApplyStats()
        for event in batch.events:
            cls = event.__class__
            if cls is BlockStored:
                self._stored(endpoint, event, model, stats)  # type: ignore[arg-type]
            elif cls is BlockRemoved:
                self._removed(endpoint, event, stats)  # type: ignore[arg-type]
            elif cls is AllBlocksCleared:
                self.clear(endpoint)
                stats.applied += 1
        if batch.unknown_events:
            stats.drop("unknown_type", batch.unknown_events)
        if batch.malformed_events:
            stats.drop("malformed", batch.malformed_events)
        self.metrics.record_apply(stats.applied, stats.dropped, batch.unknown_fields)
        return stats

    def _stored(self, endpoint: str, ev: BlockStored, model: str | None, stats: ApplyStats) -> None:
        if ev.group_idx or ev.kv_cache_spec_kind not in (None, "full_attention"):
            stats.drop("other_kv_group")
            return
        blocks = self._maps.get(endpoint)
        if blocks is None:
            blocks = self._maps[endpoint] = {}
        tier = ev.tier
        tokens = ev.token_ids
        if not tokens:
            # Offload placeholder: same engine hashes as the GPU blocks, no tokens.
            for h in ev.block_hashes:
                chunk = self._offload_chunk(blocks, h, tier)
                if not chunk:
                    stats.drop("unknown_engine_key")
                    continue
                for eb in chunk:
                    self._add_tier(endpoint, eb, tier)
            stats.applied += 1
            return
        hashes = ev.block_hashes
        n_blocks = len(hashes)
        if n_blocks == 0:
            stats.drop("malformed")
            return
        esize = ev.block_size or len(tokens) // n_blocks
        if esize <= 0 or esize * n_blocks != len(tokens):
            stats.drop("malformed")
            return
        salt, extras_by_block = _split_extra_keys(ev.extra_keys, ev.lora_name) if ev.extra_keys else (None, None)
        parent_hash = ev.parent_block_hash
        if parent_hash is None:
            parent: _EngineEntry | None = None
            chain = self.keyer.root(ev.lora_name or model, salt)
        else:
            parent = blocks.get(parent_hash)
            if parent is None:
                stats.drop("unknown_parent")
                return
            chain = parent if isinstance(parent, int) else parent.chain_key
        stats.applied += 1
        if (esize != self.block_size or tier is not _GPU or extras_by_block or not self._compact
                or (parent is not None and parent.__class__ is not int and parent.tail)):  # type: ignore[union-attr]
            self._stored_general(endpoint, blocks, ev, parent, chain, extras_by_block)
        else:
            self._stored_aligned(endpoint, blocks, hashes, self.keyer.chain(chain, tokens))
        if len(blocks) > self.capacity:
            self._trim(endpoint, blocks)

    def _stored_aligned(self, endpoint: str, blocks: dict[int, _EngineEntry], hashes: Sequence[int],
                        keys: list[int]) -> None:
        """The common event: engine blocks the size of index blocks, on GPU, each the next key of a
        chain with no partial tail, so each engine block is its request key. New blocks (the usual
        case) go in with one C-level update, and their keys to the holders in one call."""
        if not any(map(blocks.__contains__, hashes)):
            blocks.update(zip(hashes, keys))
            self._hold(endpoint, keys, 1)
            return
        fresh = []
        for h, key in zip(hashes, keys):
            old = blocks.pop(h, None)  # re-inserted: newest last for the FIFO bound
            if old is None or old == key:
                blocks[h] = key
                fresh.append(key)
                continue
            # Re-announced with other keys, or more than GPU: keep what it had.
            eb = _EngineBlock.of_key(h, old) if isinstance(old, int) else old
            eb.keys = _with_key(eb.keys, key)
            eb.chain_key, eb.tail, eb.tail_hashes = key, (), ()
            blocks[h] = eb
            self._add_tier(endpoint, eb, _GPU, force_bits=True)
        if fresh:
            self._hold(endpoint, fresh, 1)

    def _stored_general(self, endpoint: str, blocks: dict[int, _EngineEntry], ev: BlockStored,
                        parent: _EngineEntry | None, chain: int, extras_by_block: _Extras | None) -> None:
        """Any other event: engine and index block sizes differ (tails), extra keys, CPU/disk tiers."""
        if parent is None or parent.__class__ is int:
            tail: tuple[int, ...] = ()
            tail_hashes: tuple[int, ...] = ()
        else:
            tail, tail_hashes = parent.tail, parent.tail_hashes  # type: ignore[union-attr]
        tier = ev.tier
        hashes = ev.block_hashes
        n_blocks = len(hashes)
        esize = ev.block_size or len(ev.token_ids) // n_blocks
        bsize = self.block_size
        offset = len(tail)
        combined = tail + ev.token_ids if tail else ev.token_ids
        extras: dict[int, int] | None = None
        if extras_by_block:
            media, others = extras_by_block
            # A media item salts the index block its first placeholder token is in (`keys.media_extras`): the
            # engine block where it starts names it with its offset in that block (>= 0; later blocks, < 0).
            extras = media_extras(((ident, offset + j * esize + rel) for j, ident, rel in media), bsize)
            # Salt every index block that overlaps an engine block with unreproducible extras.
            for j, value in others.items():
                first = (offset + j * esize) // bsize
                last = (offset + (j + 1) * esize - 1) // bsize
                for k in range(first, last + 1):
                    extras[k] = extras.get(k, 0) ^ value
        keys = self.keyer.chain(chain, combined, extras)
        keys_by_block: list[list[int]] = [[] for _ in range(n_blocks)]
        for k, key in enumerate(keys):
            start, end = k * bsize, (k + 1) * bsize
            last_j = (end - offset - 1) // esize
            if start < offset:
                first_j = 0
                for th in tail_hashes:  # earlier engine blocks that hold the start of this key
                    teb = self._block(blocks, th)
                    if teb is not None:
                        teb.keys = _with_key(teb.keys, key)
            else:
                first_j = (start - offset) // esize
            for j in range(first_j, last_j + 1):
                keys_by_block[j].append(key)
        for j, h in enumerate(hashes):
            block_end = offset + (j + 1) * esize
            done = block_end // bsize  # index blocks complete at the end of engine block j
            old = blocks.pop(h, None)
            block_keys = keys_by_block[j]
            if old is None:
                eb = _EngineBlock(h)
                eb.keys = block_keys[0] if len(block_keys) == 1 else block_keys
            else:  # re-announced: keep keys that children's events added to it
                eb = _EngineBlock.of_key(h, old) if old.__class__ is int else old  # type: ignore[assignment]
                for k in block_keys:
                    eb.keys = _with_key(eb.keys, k)
            blocks[h] = eb  # re-insert: newest last for the FIFO bound
            eb.parent = ev.parent_block_hash if j == 0 else hashes[j - 1]
            eb.chain_key = keys[done - 1] if done > 0 else chain
            tail_start = done * bsize
            eb.tail = combined[tail_start:block_end]
            if eb.tail:
                first_tail_j = (tail_start - offset) // esize if tail_start >= offset else 0
                eb.tail_hashes = ((tail_hashes if tail_start < offset else ())
                                  + tuple(hashes[first_tail_j:j + 1]))
            else:
                eb.tail_hashes = ()
            self._add_tier(endpoint, eb, tier, force_bits=True)
            self._settle(blocks, eb)

    def _block(self, blocks: dict[int, _EngineEntry], h: int) -> _EngineBlock | None:
        """Engine block `h` as an object (a compact one is expanded in place), or None."""
        entry = blocks.get(h)
        if entry is None or entry.__class__ is _EngineBlock:
            return entry
        eb = blocks[h] = _EngineBlock.of_key(h, entry)  # type: ignore[arg-type]
        return eb

    def _settle(self, blocks: dict[int, _EngineEntry], eb: _EngineBlock) -> None:
        """Forget `eb` when no tier holds it; store it compact when it is just a request key on GPU."""
        if blocks.get(eb.hash) is not eb:
            return
        if not eb.counts:
            del blocks[eb.hash]
        elif (eb.counts == 1 and eb.keys.__class__ is int and eb.chain_key == eb.keys and not eb.tail
              and self._compact):
            blocks[eb.hash] = eb.keys

    def _add_tier(self, endpoint: str, eb: _EngineBlock, tier: Tier, force_bits: bool = False) -> None:
        if tier is _GPU:
            eb.counts |= 1
        else:
            _set_count(eb, tier, _count(eb, tier) + 1)
        if force_bits or _count(eb, tier) == 1:
            self._hold(endpoint, _keys_of(eb.keys), BIT[tier])

    def _removed(self, endpoint: str, ev: BlockRemoved, stats: ApplyStats) -> None:
        if ev.group_idx:
            stats.drop("other_kv_group", ev.events)
            return
        blocks = self._maps.get(endpoint)
        tier = ev.tier
        if not blocks:
            stats.drop("unknown_engine_key", len(ev.block_hashes))
            stats.applied += ev.events
            return
        gone: list[int] = []  # keys of compact blocks that left the GPU: released at once
        for h in ev.block_hashes:
            entry = blocks.get(h)
            if entry.__class__ is int:  # the common block: one key on GPU
                if tier is _GPU:
                    del blocks[h]
                    gone.append(entry)
                else:
                    stats.drop("unknown_engine_key")
                continue
            chunk = self._offload_chunk(blocks, h, tier)
            if not chunk or _count(chunk[0], tier) == 0:
                stats.drop("unknown_engine_key")
                continue
            bit = BIT[tier]
            for eb in chunk:
                count = _count(eb, tier)
                if count == 0:
                    continue
                count = 0 if tier is _GPU else count - 1
                _set_count(eb, tier, count)
                if count == 0:
                    self._release(endpoint, _keys_of(eb.keys), bit)
            for eb in chunk:
                self._settle(blocks, eb)
        if gone:
            self._release(endpoint, gone, 1)
        stats.applied += ev.events

    def _offload_chunk(self, blocks: dict[int, _EngineEntry], h: int, tier: Tier) -> list[_EngineBlock]:
        """The engine blocks an offload event for hash `h` stands for: vLLM announces a chunk of
        `offload_chunk_blocks` GPU blocks by the hash of its last block, so walk back the chain."""
        eb = self._block(blocks, h)
        if eb is None:
            return []
        chunk = [eb]
        if tier is not _GPU:
            while len(chunk) < self.offload_chunk_blocks and eb.parent is not None:
                eb = self._block(blocks, eb.parent)
                if eb is None:
                    break
                chunk.append(eb)
        return chunk

    def _trim(self, endpoint: str, blocks: dict[int, _EngineEntry]) -> None:
        """Over capacity: forget the oldest engine blocks, down a little below it (module docstring)."""
        victims = list(islice(blocks, len(blocks) - trim_target(self.capacity)))
        gone: list[int] = []
        for h in victims:
            entry = blocks.pop(h)
            # We can no longer see this block's removal, so stop claiming it.
            if entry.__class__ is int:
                gone.append(entry)
            elif mask := _mask(entry):  # type: ignore[arg-type]
                self._release(endpoint, _keys_of(entry.keys), mask)  # type: ignore[union-attr]
        if gone:
            self._release(endpoint, gone, 1)
        self.metrics.engine_evictions.inc(len(victims))


def _all_keys(blocks: dict[int, _EngineEntry]) -> Iterator[int]:
    """Every request key an endpoint's map holds (a key shared by blocks more than once)."""
    for entry in blocks.values():
        if entry.__class__ is int:
            yield entry
        else:
            yield from _keys_of(entry.keys)  # type: ignore[union-attr]


# From an event's extra keys: its media items as (engine block, identifier, offset of the item's first
# placeholder token from the block's start), and per engine block a hash of what no request can reproduce.
_Extras = tuple[list[tuple[int, str, int]], dict[int, int]]


def _split_extra_keys(extra_keys: tuple[Any, ...] | None,
                      lora_name: str | None) -> tuple[str | None, _Extras | None]:
    """From the events' untagged extra keys: the cache salt (a string on block 0 that is not the LoRA
    name), the media items vLLM tags blocks with (`(identifier, offset)`, kept where the item starts:
    offset >= 0), and per block a hash of inputs we cannot rebuild (prompt embeds); None when there are neither."""
    salt = None
    media: list[tuple[int, str, int]] = []
    extras: dict[int, int] = {}
    if not extra_keys:
        return salt, None
    for j, entry in enumerate(extra_keys):
        if not entry:
            continue
        items = entry if isinstance(entry, (list, tuple)) else (entry,)
        other = []
        for item in items:
            if isinstance(item, str) and item == lora_name:
                continue
            if j == 0 and salt is None and isinstance(item, str):
                salt = item
                continue
            if isinstance(item, (list, tuple)) and len(item) == 2 and isinstance(item[0], str) \
                    and isinstance(item[1], int) and not isinstance(item[1], bool):
                if item[1] >= 0:  # the block it starts in; blocks it runs on into say < 0 (chained from there)
                    media.append((j, item[0], item[1]))
                continue
            other.append(item)
        if other:
            extras[j] = xxhash.xxh64_intdigest(repr(other).encode())
    return salt, (media, extras) if media or extras else None
