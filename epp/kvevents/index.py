"""The KV block index: which endpoint holds which prompt blocks, in which tiers (GPU/CPU/disk).

Dual keys: request keys come from token ids (see `keys.py`); each endpoint keeps a map from the
engine's block hash to the request keys its tokens fall in, so removals and token-less offload
events resolve without ever reproducing vLLM's hash.

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
- Capacity: entries are (request key, endpoint) pairs; whole keys are evicted least recently
  used (stored or matched) first. The dict's insertion order is the recency order (a touch
  re-inserts the key); when over capacity the index evicts down to 1/256 below it at once, so
  the scan for the oldest keys is paid once per batch of evictions. Each endpoint's
  engine-hash map is bounded too (FIFO, trimmed the same way).
- Speculative entries (after a pick) count as GPU, expire after their TTL and are replaced by
  the confirmed event for the same key and endpoint.
- Memory (bytes per entry measured by bench/kv_index_bench.py --compare-with): a key's holders
  are one int of 16-bit fields `endpoint id << 3 | tier mask` (ids of removed endpoints are
  reused, at most 8192 endpoints at once); an engine block that maps to one request key, on GPU
  only, with no partial tail is the request key itself in its endpoint's map (no object); other
  engine blocks (tails, several keys, CPU/disk counts, offload chunks) are an `_EngineBlock`.
- Pools: each endpoint belongs to one pool (its P/D role: `prefill`, `decode`, or `both` for an
  aggregated replica, the default), so a lookup can be limited to a pool and the entries of each
  pool are counted (`epp_kv_index_pool_entries{pool}`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import islice, repeat
from typing import Any

import xxhash

from epp.kvevents.decoding import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    DecodedBatch,
    Tier,
)
from epp.kvevents.keys import BlockKeyer
from epp.kvevents.metrics import KVIndexMetrics
from epp.kvevents.speculative import SpeculativeClaims

_BIT = (1, 2, 4)  # Tier -> bit in an entry's tier mask
DEFAULT_POOL = "both"  # an endpoint with no P/D role prefills and decodes: the aggregated pool
# Best (fastest) tier of a non-zero tier mask.
_BEST_TIER = (Tier.GPU, Tier.GPU, Tier.CPU, Tier.GPU, Tier.DISK, Tier.GPU, Tier.CPU, Tier.GPU)
_GPU = Tier.GPU

# A key's holders: one int of 16-bit fields, each `endpoint id << 3 | tier mask` (mask > 0). Up to
# three holders fit in a 32-byte int (a tuple of two small ints cost 64 bytes, a dict ~230).
_FIELD = 16
_FIELD_MASK = (1 << _FIELD) - 1
MAX_ENDPOINTS = 1 << (_FIELD - 3)  # endpoint ids that fit in a field (ids of removed endpoints are reused)
# Over capacity, evict (or trim an engine map) down to capacity - capacity >> _SLACK_SHIFT at once.
_SLACK_SHIFT = 8


def _mask_of(holders: int, ep_id: int) -> int:
    """`ep_id`'s tier mask in a key's holders (0: not a holder)."""
    while holders:
        f = holders & _FIELD_MASK
        if f >> 3 == ep_id:
            return f & 7
        holders >>= _FIELD
    return 0


def _with_mask(holders: int, ep_id: int, mask: int) -> int:
    """`holders` with `ep_id`'s tier mask set to `mask` (0 removes `ep_id`; 0 is no holder left)."""
    out = shift = 0
    found = False
    while holders:
        f = holders & _FIELD_MASK
        holders >>= _FIELD
        if f >> 3 == ep_id:
            found = True
            if not mask:
                continue
            f = ep_id << 3 | mask
        out |= f << shift
        shift += _FIELD
    if not found and mask:
        out |= (ep_id << 3 | mask) << shift
    return out


def _holder_ids(holders: int) -> list[int]:
    """The endpoint ids holding a key, in holder order."""
    ids = []
    while holders:
        ids.append((holders & _FIELD_MASK) >> 3)
        holders >>= _FIELD
    return ids


def _holder_fields(holders: int) -> list[int]:
    """A key's holder fields (`endpoint id << 3 | tier mask`)."""
    fields = []
    while holders:
        fields.append(holders & _FIELD_MASK)
        holders >>= _FIELD
    return fields


# An engine block's per-tier counts packed in one int (21 bits a tier).
_COUNT_SHIFT = (0, 21, 42)
_COUNT_MASK = (1 << 21) - 1


def _count(eb: _EngineBlock, tier: int) -> int:
    return (eb.counts >> _COUNT_SHIFT[tier]) & _COUNT_MASK


def _set_count(eb: _EngineBlock, tier: int, value: int) -> None:
    shift = _COUNT_SHIFT[tier]
    eb.counts = (eb.counts & ~(_COUNT_MASK << shift)) | (min(value, _COUNT_MASK) << shift)


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


class KVBlockIndex:
    """Bounded index of request keys → endpoints → tiers, fed by KV events, read by lookups."""

    def __init__(
        self,
        block_size: int = 16,
        capacity: int = 1_000_000,
        *,
        engine_capacity_per_endpoint: int = 200_000,
        offload_chunk_blocks: int = 1,
        speculative_ttl_s: float = 2.0,
        speculative_capacity: int = 200_000,
        metrics: KVIndexMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if capacity < 1 or engine_capacity_per_endpoint < 1:
            raise ValueError("capacities must be >= 1")
        self.keyer = BlockKeyer(block_size)
        self.block_size = block_size
        self.capacity = capacity
        self.engine_capacity = engine_capacity_per_endpoint
        self.offload_chunk_blocks = max(1, offload_chunk_blocks)
        self.speculative_ttl_s = speculative_ttl_s
        self.metrics = metrics or KVIndexMetrics(None)
        self._clock = clock
        # Request key -> holders; insertion order is recency (oldest first).
        self._keys: dict[int, int] = {}
        # Endpoint names as small ids in the holders; a removed endpoint's id is reused.
        self._ep_ids: dict[str, int] = {}
        self._ep_names: list[str | None] = []
        self._free_ids: list[int] = []
        self._entries = 0
        self._engine: dict[str, dict[int, _EngineEntry]] = {}
        self._claims = SpeculativeClaims(speculative_capacity)
        self._spec = self._claims.by_key  # read directly by the hot paths
        self._pools: dict[str, str] = {}
        self._pool_entries: dict[str, int] = {}
        # Compact engine blocks need no parent link: only offload chunks of several blocks walk it.
        self._compact = self.offload_chunk_blocks == 1
        self.metrics.bind_size(lambda: self._entries, lambda: len(self._keys))
        self._bind_pool(DEFAULT_POOL)

    # ---- sizes -------------------------------------------------------------------------------
    @property
    def entries(self) -> int:
        """Confirmed (request key, endpoint) pairs held now."""
        return self._entries

    def __len__(self) -> int:
        return len(self._keys)

    def endpoints(self) -> list[str]:
        """Endpoints with any engine state in the index."""
        return list(self._engine)

    def engine_blocks(self, endpoint: str) -> int:
        """Engine hashes known for an endpoint (bounded by `engine_capacity_per_endpoint`)."""
        return len(self._engine.get(endpoint, ()))

    # ---- pools -------------------------------------------------------------------------------
    def _bind_pool(self, pool: str) -> None:
        if pool not in self._pool_entries:
            self._pool_entries[pool] = 0
            self.metrics.bind_pool(pool, lambda: self._pool_entries.get(pool, 0))

    def set_pool(self, endpoint: str, pool: str) -> None:
        """Put `endpoint` in `pool` (its P/D role); entries it already holds move with it."""
        old = self._pools.get(endpoint, DEFAULT_POOL)
        self._pools[endpoint] = pool
        self._bind_pool(pool)
        if old != pool:
            # Rare (a pod relabelled), so a scan of the keys is fine here.
            ep_id = self._ep_ids.get(endpoint)
            held = 0 if ep_id is None else sum(1 for h in self._keys.values() if _mask_of(h, ep_id))
            self._pool_entries[old] -= held
            self._pool_entries[pool] += held

    def pool_of(self, endpoint: str) -> str:
        """The pool `endpoint` belongs to (`both` unless set)."""
        return self._pools.get(endpoint, DEFAULT_POOL)

    def pool_entries(self) -> dict[str, int]:
        """Confirmed entries held by the endpoints of each pool."""
        return dict(self._pool_entries)

    def pools_holding(self, key: int) -> dict[str, list[str]]:
        """For one request key: the pools whose endpoints hold it, with those endpoints."""
        found: dict[str, list[str]] = {}
        for ep_id in _holder_ids(self._keys.get(key, 0)):
            ep = self._name(ep_id)
            found.setdefault(self.pool_of(ep), []).append(ep)
        return found

    def tiers_of(self, key: int, endpoint: str) -> set[Tier]:
        """The confirmed tiers holding `key` on `endpoint` (for tests and debugging)."""
        ep_id = self._ep_ids.get(endpoint)
        mask = 0 if ep_id is None else _mask_of(self._keys.get(key, 0), ep_id)
        return {t for t in Tier if mask & _BIT[t]}

    def contents(self) -> dict[int, dict[str, frozenset[Tier]]]:
        """Every confirmed request key with its endpoints and their tiers (tests and debugging: O(entries))."""
        return {key: {self._name(f >> 3): frozenset(t for t in Tier if f & _BIT[t]) for f in _holder_fields(holders)}
                for key, holders in self._keys.items()}

    def _name(self, ep_id: int) -> str:
        name = self._ep_names[ep_id]
        assert name is not None, "a key held by a released endpoint id"
        return name

    def _id_of(self, endpoint: str) -> int:
        ep_id = self._ep_ids.get(endpoint)
        if ep_id is None:
            if self._free_ids:
                ep_id = self._free_ids.pop()
                self._ep_names[ep_id] = endpoint
            elif len(self._ep_names) < MAX_ENDPOINTS:
                ep_id = len(self._ep_names)
                self._ep_names.append(endpoint)
            else:
                raise ValueError(f"the KV index holds at most {MAX_ENDPOINTS} endpoints at once")
            self._ep_ids[endpoint] = ep_id
        return ep_id

    # ---- events ------------------------------------------------------------------------------
    def apply_batch(self, endpoint: str, batch: DecodedBatch, model: str | None) -> ApplyStats:
        """Apply one decoded batch from `endpoint`'s publisher; `model` is the topic's model."""
        stats = ApplyStats()
        for event in batch.events:
            cls = event.__class__
            if cls is BlockStored:
                self._stored(endpoint, event, model, stats)  # type: ignore[arg-type]
            elif cls is BlockRemoved:
                self._removed(endpoint, event, stats)  # type: ignore[arg-type]
            elif cls is AllBlocksCleared:
                self.clear_endpoint(endpoint)
                stats.applied += 1
        if batch.unknown_events:
            stats.drop("unknown_type", batch.unknown_events)
        if batch.malformed_events:
            stats.drop("malformed", batch.malformed_events)
        if self._entries > self.capacity:
            self._evict_over_capacity()
        self.metrics.record_apply(stats.applied, stats.dropped, batch.unknown_fields)
        return stats

    def _stored(self, endpoint: str, ev: BlockStored, model: str | None, stats: ApplyStats) -> None:
        if ev.group_idx or ev.kv_cache_spec_kind not in (None, "full_attention"):
            stats.drop("other_kv_group")
            return
        engine = self._engine.get(endpoint)
        if engine is None:
            engine = self._engine[endpoint] = {}
        tier = ev.tier
        tokens = ev.token_ids
        if not tokens:
            # Offload placeholder: same engine hashes as the GPU blocks, no tokens.
            ep_id = self._id_of(endpoint)
            for h in ev.block_hashes:
                chunk = self._offload_chunk(engine, h, tier)
                if not chunk:
                    stats.drop("unknown_engine_key")
                    continue
                for eb in chunk:
                    self._add_tier(endpoint, ep_id, eb, tier)
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
            parent = engine.get(parent_hash)
            if parent is None:
                stats.drop("unknown_parent")
                return
            chain = parent if isinstance(parent, int) else parent.chain_key
        stats.applied += 1
        if (esize != self.block_size or tier is not _GPU or extras_by_block or not self._compact
                or (parent is not None and parent.__class__ is not int and parent.tail)):  # type: ignore[union-attr]
            self._stored_general(endpoint, engine, ev, parent, chain, extras_by_block)
        else:
            self._stored_aligned(endpoint, engine, hashes, self.keyer.chain(chain, tokens))
        if len(engine) > self.engine_capacity:
            self._trim_engine(endpoint, engine)

    def _stored_aligned(self, endpoint: str, engine: dict[int, _EngineEntry], hashes: Sequence[int],
                        keys: list[int]) -> None:
        """The common event: engine blocks the size of index blocks, on GPU, each the next key of a
        chain with no partial tail, so each engine block is its request key. New blocks and new keys
        (the usual case) go in with one C-level update each; the rest in one loop."""
        ep_id = self._ep_ids.get(endpoint)
        if ep_id is None:
            ep_id = self._id_of(endpoint)
        if not any(map(engine.__contains__, hashes)):
            engine.update(zip(hashes, keys))
            fresh = keys
        else:
            fresh = []
            for h, key in zip(hashes, keys):
                old = engine.pop(h, None)  # re-inserted: newest last for the FIFO bound
                if old is None or old == key:
                    engine[h] = key
                    fresh.append(key)
                    continue
                # Re-announced with other keys, or more than GPU: keep what it had.
                eb = _EngineBlock.of_key(h, old) if isinstance(old, int) else old
                eb.keys = _with_key(eb.keys, key)
                eb.chain_key, eb.tail, eb.tail_hashes = key, (), ()
                engine[h] = eb
                self._add_tier(endpoint, ep_id, eb, _GPU, force_bits=True)
        all_keys = self._keys
        n_keys = len(all_keys)
        field_gpu = ep_id << 3 | 1
        if not any(map(all_keys.__contains__, fresh)):
            all_keys.update(zip(fresh, repeat(field_gpu)))
            added = len(all_keys) - n_keys
        else:
            added = 0
            for key in fresh:
                holders = all_keys.pop(key, 0)  # re-inserted: most recently used
                if holders <= _FIELD_MASK and holders >> 3 != ep_id:  # none or one other holder
                    all_keys[key] = holders | field_gpu << _FIELD if holders else field_gpu
                    added += 1
                    continue
                rest, shift = holders, 0
                while rest:  # find this endpoint's field; `shift` ends past the last one if it has none
                    if (rest & _FIELD_MASK) >> 3 == ep_id:
                        break
                    rest >>= _FIELD
                    shift += _FIELD
                if rest:  # held already (a speculative claim never coexists with a confirmed one)
                    all_keys[key] = holders | 1 << shift
                else:
                    all_keys[key] = holders | field_gpu << shift
                    added += 1
        if added:
            self._entries += added
            self._pool_entries[self._pools.get(endpoint, DEFAULT_POOL)] += added
            spec_all = self._spec
            if spec_all:
                for key in fresh:
                    spec = spec_all.get(key)
                    if spec is not None and endpoint in spec:
                        del spec[endpoint]
                        if not spec:
                            del spec_all[key]

    def _stored_general(self, endpoint: str, engine: dict[int, _EngineEntry], ev: BlockStored,
                        parent: _EngineEntry | None, chain: int, extras_by_block: dict[int, int] | None) -> None:
        """Any other event: engine and index block sizes differ (tails), extra keys, CPU/disk tiers."""
        if parent is None or parent.__class__ is int:
            tail: tuple[int, ...] = ()
            tail_hashes: tuple[int, ...] = ()
        else:
            tail, tail_hashes = parent.tail, parent.tail_hashes  # type: ignore[union-attr]
        ep_id = self._id_of(endpoint)
        tier = ev.tier
        hashes = ev.block_hashes
        n_blocks = len(hashes)
        esize = ev.block_size or len(ev.token_ids) // n_blocks
        bsize = self.block_size
        offset = len(tail)
        combined = tail + ev.token_ids if tail else ev.token_ids
        extras: dict[int, int] | None = None
        if extras_by_block:
            # Salt every index block that overlaps an engine block with unreproducible extras.
            extras = {}
            for j, value in extras_by_block.items():
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
                    teb = self._block(engine, th)
                    if teb is not None:
                        teb.keys = _with_key(teb.keys, key)
            else:
                first_j = (start - offset) // esize
            for j in range(first_j, last_j + 1):
                keys_by_block[j].append(key)
        for j, h in enumerate(hashes):
            block_end = offset + (j + 1) * esize
            done = block_end // bsize  # index blocks complete at the end of engine block j
            old = engine.pop(h, None)
            block_keys = keys_by_block[j]
            if old is None:
                eb = _EngineBlock(h)
                eb.keys = block_keys[0] if len(block_keys) == 1 else block_keys
            else:  # re-announced: keep keys that children's events added to it
                eb = _EngineBlock.of_key(h, old) if old.__class__ is int else old  # type: ignore[assignment]
                for k in block_keys:
                    eb.keys = _with_key(eb.keys, k)
            engine[h] = eb  # re-insert: newest last for the FIFO bound
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
            self._add_tier(endpoint, ep_id, eb, tier, force_bits=True)
            self._settle(engine, eb)

    def _block(self, engine: dict[int, _EngineEntry], h: int) -> _EngineBlock | None:
        """Engine block `h` as an object (a compact one is expanded in place), or None."""
        entry = engine.get(h)
        if entry is None or entry.__class__ is _EngineBlock:
            return entry
        eb = engine[h] = _EngineBlock.of_key(h, entry)  # type: ignore[arg-type]
        return eb

    def _settle(self, engine: dict[int, _EngineEntry], eb: _EngineBlock) -> None:
        """Forget `eb` when no tier holds it; store it compact when it is just a request key on GPU."""
        if engine.get(eb.hash) is not eb:
            return
        if not eb.counts:
            del engine[eb.hash]
        elif (eb.counts == 1 and eb.keys.__class__ is int and eb.chain_key == eb.keys and not eb.tail
              and self._compact):
            engine[eb.hash] = eb.keys

    def _add_tier(self, endpoint: str, ep_id: int, eb: _EngineBlock, tier: Tier, force_bits: bool = False) -> None:
        if tier is Tier.GPU:
            eb.counts |= 1
        else:
            _set_count(eb, tier, _count(eb, tier) + 1)
        if force_bits or _count(eb, tier) == 1:
            bit = _BIT[tier]
            for key in _keys_of(eb.keys):
                self._set_bit(key, endpoint, ep_id, bit)

    def _removed(self, endpoint: str, ev: BlockRemoved, stats: ApplyStats) -> None:
        if (ev.group_idx or 0) != 0:
            stats.drop("other_kv_group")
            return
        engine = self._engine.get(endpoint)
        ep_id = self._ep_ids.get(endpoint)
        tier = ev.tier
        if not engine or ep_id is None:
            stats.drop("unknown_engine_key", len(ev.block_hashes))
            stats.applied += 1
            return
        for h in ev.block_hashes:
            entry = engine.get(h)
            if entry.__class__ is int:  # the common block: one key on GPU
                if tier is _GPU:
                    del engine[h]
                    self._clear_bit(entry, endpoint, ep_id, 1)
                else:
                    stats.drop("unknown_engine_key")
                continue
            chunk = self._offload_chunk(engine, h, tier)
            if not chunk or _count(chunk[0], tier) == 0:
                stats.drop("unknown_engine_key")
                continue
            bit = _BIT[tier]
            for eb in chunk:
                count = _count(eb, tier)
                if count == 0:
                    continue
                count = 0 if tier is Tier.GPU else count - 1
                _set_count(eb, tier, count)
                if count == 0:
                    for key in _keys_of(eb.keys):
                        self._clear_bit(key, endpoint, ep_id, bit)
            for eb in chunk:
                self._settle(engine, eb)
        stats.applied += 1

    def _offload_chunk(self, engine: dict[int, _EngineEntry], h: int, tier: Tier) -> list[_EngineBlock]:
        """The engine blocks an offload event for hash `h` stands for: vLLM announces a chunk of
        `offload_chunk_blocks` GPU blocks by the hash of its last block, so walk back the chain."""
        eb = self._block(engine, h)
        if eb is None:
            return []
        chunk = [eb]
        if tier is not Tier.GPU:
            while len(chunk) < self.offload_chunk_blocks and eb.parent is not None:
                eb = self._block(engine, eb.parent)
                if eb is None:
                    break
                chunk.append(eb)
        return chunk

    def _trim_engine(self, endpoint: str, engine: dict[int, _EngineEntry]) -> None:
        # Trim a little below the bound at once: finding the oldest hashes scans the dict's front.
        cap = self.engine_capacity
        target = cap - (cap >> _SLACK_SHIFT)
        ep_id = self._ep_ids[endpoint]
        victims = list(islice(engine, len(engine) - target))
        for h in victims:
            entry = engine.pop(h)
            # We can no longer see this block's removal, so stop claiming it.
            if entry.__class__ is int:
                self._clear_bit(entry, endpoint, ep_id, 1)
                continue
            for tier in Tier:
                if _count(entry, tier):  # type: ignore[arg-type]
                    for key in _keys_of(entry.keys):  # type: ignore[union-attr]
                        self._clear_bit(key, endpoint, ep_id, _BIT[tier])
        self.metrics.engine_evictions.inc(len(victims))

    # ---- entries -----------------------------------------------------------------------------
    def _set_bit(self, key: int, endpoint: str, ep_id: int, bit: int) -> None:
        keys = self._keys
        holders = keys.pop(key, 0)  # re-inserted: most recently used
        old = _mask_of(holders, ep_id)
        keys[key] = _with_mask(holders, ep_id, old | bit) if old | bit != old else holders
        if not old:
            self._entries += 1
            self._pool_entries[self._pools.get(endpoint, DEFAULT_POOL)] += 1
        self._claims.confirm(key, endpoint)

    def _clear_bit(self, key: int, endpoint: str, ep_id: int, bit: int) -> None:
        holders = self._keys.get(key)
        if holders is None:
            return
        old = _mask_of(holders, ep_id)
        if not old & bit:
            return
        new = old & ~bit
        if new:
            self._keys[key] = _with_mask(holders, ep_id, new)
            return
        self._entries -= 1
        self._pool_entries[self._pools.get(endpoint, DEFAULT_POOL)] -= 1
        rest = _with_mask(holders, ep_id, 0)
        if rest:
            self._keys[key] = rest
        else:
            del self._keys[key]

    def _evict_over_capacity(self) -> None:
        # Evict a little below capacity at once: finding the oldest keys scans the dict's front.
        target = self.capacity - (self.capacity >> _SLACK_SHIFT)
        need = self._entries - target
        keys = self._keys
        victims: list[int] = []
        evicted = 0
        one_pool = len(self._pool_entries) == 1
        for key, holders in keys.items():
            victims.append(key)
            if one_pool:
                evicted += (holders.bit_length() + _FIELD - 1) // _FIELD  # its holders
            else:
                for ep_id in _holder_ids(holders):
                    self._pool_entries[self._pools.get(self._name(ep_id), DEFAULT_POOL)] -= 1
                    evicted += 1
            if evicted >= need:
                break
        for key in victims:
            del keys[key]
        if one_pool:
            for pool in self._pool_entries:
                self._pool_entries[pool] -= evicted
        self._entries -= evicted
        self.metrics.evictions.inc(evicted)

    def clear_endpoint(self, endpoint: str) -> int:
        """Forget everything `endpoint` holds (AllBlocksCleared, publisher restart, lost events)."""
        engine = self._engine.pop(endpoint, None)
        removed = 0
        ep_id = self._ep_ids.get(endpoint)
        if engine and ep_id is not None:
            keys = self._keys
            for entry in engine.values():
                for key in (entry,) if entry.__class__ is int else _keys_of(entry.keys):  # type: ignore[union-attr]
                    holders = keys.get(key)
                    if holders is not None and _mask_of(holders, ep_id):
                        removed += 1
                        rest = _with_mask(holders, ep_id, 0)
                        if rest:
                            keys[key] = rest
                        else:
                            del keys[key]
            self._entries -= removed
            self._pool_entries[self.pool_of(endpoint)] -= removed
        self._claims.forget_endpoint(endpoint)
        return removed

    def remove_endpoint(self, endpoint: str) -> int:
        """The endpoint left the pool: drop its entries and its engine-hash map (its id is reused)."""
        removed = self.clear_endpoint(endpoint)
        self._pools.pop(endpoint, None)
        ep_id = self._ep_ids.pop(endpoint, None)
        if ep_id is not None:  # no key holds it any more: every holder field is backed by an engine block
            self._ep_names[ep_id] = None
            self._free_ids.append(ep_id)
        return removed

    # ---- speculative entries -----------------------------------------------------------------
    def add_speculative(self, endpoint: str, keys: Sequence[int], ttl_s: float | None = None) -> int:
        """After a pick: claim `keys` on `endpoint` (as GPU) for a short TTL, until events confirm."""
        ttl = self.speculative_ttl_s if ttl_s is None else ttl_s
        if ttl <= 0 or not keys:
            return 0
        now = self._clock()
        self._claims.purge(now)
        ep_id = self._id_of(endpoint)  # lookups follow speculative holders by id
        expiry = now + ttl
        added = 0
        get_holders = self._keys.get
        for key in keys:
            holders = get_holders(key)
            if holders is not None and _mask_of(holders, ep_id):
                continue
            self._claims.claim(endpoint, key, expiry)
            added += 1
        self._claims.trim()
        return added

    def speculative_entries(self) -> int:
        """Speculative (key, endpoint) claims not yet expired or confirmed."""
        self._claims.purge(self._clock())
        return len(self._claims)

    # ---- lookups -----------------------------------------------------------------------------
    def lookup(self, keys: Sequence[int], endpoints: Iterable[str] | None = None,
               pool: str | None = None) -> dict[str, list[Tier]]:
        """Per endpoint, the best tier of each block in its longest run of consecutive keys from
        the start; endpoints with no first block are left out. O(blocks × holders of a block).
        With `pool`, only endpoints of that pool are considered."""
        result: dict[str, list[Tier]] = {}
        if not keys:
            return result
        if self._claims.expiries:
            self._claims.purge(self._clock())
        spec_all = self._spec
        all_keys = self._keys
        get_holders = all_keys.get
        # Endpoints in the run so far, by id, with their result lists: those holding the first key.
        run: dict[int, list[Tier]] = {}
        first = get_holders(keys[0], 0)
        spec = spec_all.get(keys[0]) if spec_all else None
        if first or spec:
            ids = _holder_ids(first)
            if spec:
                ids += [ep_id for ep_id in map(self._ep_ids.get, spec) if ep_id is not None and ep_id not in ids]
            if endpoints is not None and not isinstance(endpoints, (set, frozenset, dict)):
                endpoints = set(endpoints)
            for ep_id in ids:
                name = self._name(ep_id)
                if endpoints is not None and name not in endpoints:
                    continue
                if pool is not None and self._pools.get(name, DEFAULT_POOL) != pool:
                    continue
                run[ep_id] = result[name] = []
        matched = 0
        if run:
            names = self._ep_names
            best = _BEST_TIER
            prev = -1  # the previous key's holders, when they alone decided its step (no speculation)
            prev_step: list[tuple[list[Tier], Tier]] = []
            repeats = 0  # keys after `prev` with the very same holders, appended in one go
            held_all = True  # every matched key is held (not only speculatively)
            for key in keys:
                holders = get_holders(key)
                if holders == prev and (not spec_all or key not in spec_all):
                    repeats += 1
                    continue
                if repeats:
                    for tiers, tier in prev_step:
                        tiers += [tier] * repeats
                    matched += repeats
                    repeats = 0
                spec = spec_all.get(key) if spec_all else None
                if holders is None:
                    if spec is None:
                        break
                    held_all = False
                step = []
                rest = holders or 0
                while rest:
                    tiers = run.get((rest & _FIELD_MASK) >> 3)  # type: ignore[assignment]
                    if tiers is not None:
                        step.append((tiers, best[rest & 7]))
                    rest >>= _FIELD
                if len(step) < len(run):  # the run ends here for some: keep the others
                    kept = {ep_id: run[ep_id] for ep_id in _holder_ids(holders or 0) if ep_id in run}
                    if spec is not None:
                        for ep_id, tiers in run.items():
                            if ep_id not in kept and names[ep_id] in spec:
                                kept[ep_id] = tiers
                                step.append((tiers, _GPU))
                    if not kept:
                        break
                    run = kept
                for tiers, tier in step:
                    tiers.append(tier)
                prev = holders if spec is None else -1  # type: ignore[assignment]
                prev_step = step
                matched += 1
            if repeats:
                for tiers, tier in prev_step:
                    tiers += [tier] * repeats
                matched += repeats
            if matched:  # touch: the matched keys become the most recently used
                touched = keys[:matched]
                if held_all:
                    all_keys.update(zip(touched, map(all_keys.pop, touched)))
                else:
                    for key in touched:
                        holders = all_keys.pop(key, None)
                        if holders is not None:
                            all_keys[key] = holders
        self.metrics.record_lookup(matched, len(keys) - matched)
        return result


def _split_extra_keys(extra_keys: tuple[Any, ...] | None, lora_name: str | None) -> tuple[str | None, dict[int, int]]:
    """From the events' untagged extra keys: the cache salt (a string on block 0 that is not the
    LoRA name) and, per block, a hash of inputs we cannot rebuild from text (MM ids, embeds)."""
    salt = None
    extras: dict[int, int] = {}
    if not extra_keys:
        return salt, extras
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
            other.append(item)
        if other:
            extras[j] = xxhash.xxh64_intdigest(repr(other).encode())
    return salt, extras
