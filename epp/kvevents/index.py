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
  used (stored or matched) first. Each endpoint's engine-hash map is bounded too (FIFO).
- Speculative entries (after a pick) count as GPU, expire after their TTL and are replaced by
  the confirmed event for the same key and endpoint.
- Memory: a key's holders are one small int (`endpoint id << 3 | tier mask`) or a tuple of them,
  an engine block's tier counts one packed int and its single request key the int itself
  (measured in bench/kv_index_bench.py --compare-with: about half the bytes per entry).
- Pools: each endpoint belongs to one pool (its P/D role: `prefill`, `decode`, or `both` for an
  aggregated replica, the default), so a lookup can be limited to a pool and the entries of each
  pool are counted (`epp_kv_index_pool_entries{pool}`).
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
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

_BIT = (1, 2, 4)  # Tier -> bit in an entry's tier mask
DEFAULT_POOL = "both"  # an endpoint with no P/D role prefills and decodes: the aggregated pool
# Best (fastest) tier of a non-zero tier mask.
_BEST_TIER = (Tier.GPU, Tier.GPU, Tier.CPU, Tier.GPU, Tier.DISK, Tier.GPU, Tier.CPU, Tier.GPU)


# An engine block's per-tier counts packed in one int (21 bits a tier): a GPU-only block's counts
# are the cached small int 1, where a list of three cost 80 bytes per block.
_COUNT_SHIFT = (0, 21, 42)
_COUNT_MASK = (1 << 21) - 1


def _count(eb: _EngineBlock, tier: int) -> int:
    return (eb.counts >> _COUNT_SHIFT[tier]) & _COUNT_MASK


def _set_count(eb: _EngineBlock, tier: int, value: int) -> None:
    shift = _COUNT_SHIFT[tier]
    eb.counts = (eb.counts & ~(_COUNT_MASK << shift)) | (min(value, _COUNT_MASK) << shift)


def _keys_of(keys: int | list[int]) -> Sequence[int]:
    """An engine block's request keys: one key is held as the int itself (the common case, engine and
    index blocks of one size: no list of 64 bytes per block), several as a list."""
    return (keys,) if keys.__class__ is int else keys  # type: ignore[return-value]


def _with_key(keys: int | list[int] | None, key: int) -> int | list[int]:
    """`keys` with `key` added (kept once)."""
    if keys is None:
        return key
    if keys.__class__ is int:
        return keys if keys == key else [keys, key]  # type: ignore[list-item]
    if key not in keys:  # type: ignore[operator]
        keys.append(key)  # type: ignore[union-attr]
    return keys


# A request key's holders: one holder is one small int `endpoint id << 3 | tier mask`; several are
# a tuple of them (a dict of endpoint name -> mask cost ~230 bytes per key, a tuple of two 56).
Holders = int | tuple[int, ...]


def _holder_mask(holders: Holders, ep_id: int) -> int:
    if holders.__class__ is int:
        return holders & 7 if holders >> 3 == ep_id else 0  # type: ignore[operator]
    for h in holders:  # type: ignore[union-attr]
        if h >> 3 == ep_id:
            return h & 7
    return 0


def _holder_count(holders: Holders) -> int:
    return 1 if holders.__class__ is int else len(holders)  # type: ignore[arg-type]


def _holder_items(holders: Holders) -> tuple[int, ...]:
    return (holders,) if holders.__class__ is int else holders  # type: ignore[return-value]


def _with_holder(holders: Holders, ep_id: int, mask: int) -> Holders:
    """`holders` with `ep_id`'s mask set to `mask` (> 0)."""
    packed = ep_id << 3 | mask
    items = _holder_items(holders)
    for i, h in enumerate(items):
        if h >> 3 == ep_id:
            if len(items) == 1:
                return packed
            return items[:i] + (packed,) + items[i + 1:]
    return items + (packed,)


def _without_holder(holders: Holders, ep_id: int) -> Holders | None:
    """`holders` without `ep_id` (None when no holder is left)."""
    rest = tuple(h for h in _holder_items(holders) if h >> 3 != ep_id)
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else rest


class _EngineBlock:
    """What an endpoint's engine block maps to: request keys, the chain to continue, tier counts."""

    __slots__ = ("chain_key", "counts", "hash", "keys", "parent", "tail", "tail_hashes")

    def __init__(self, block_hash: int) -> None:
        self.hash = block_hash
        self.parent: int | None = None  # the previous engine block's hash in this chain
        self.keys: int | list[int] = []
        self.chain_key = 0
        self.tail: tuple[int, ...] = ()
        self.tail_hashes: tuple[int, ...] = ()
        self.counts = 0  # packed per tier, see _count


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
        self.speculative_capacity = speculative_capacity
        self.metrics = metrics or KVIndexMetrics(None)
        self._clock = clock
        self._keys: OrderedDict[int, Holders] = OrderedDict()
        # Endpoint names as small ids in the holders (never reused: a removed endpoint leaves its name here).
        self._ep_ids: dict[str, int] = {}
        self._ep_names: list[str] = []
        self._entries = 0
        self._engine: dict[str, dict[int, _EngineBlock]] = {}
        self._spec: dict[int, dict[str, float]] = {}
        self._spec_queue: deque[tuple[float, int, str]] = deque()
        self._pools: dict[str, str] = {}
        self._pool_entries: dict[str, int] = {}
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
            held = 0 if ep_id is None else sum(1 for h in self._keys.values() if _holder_mask(h, ep_id))
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
        holders = self._keys.get(key)
        for h in _holder_items(holders) if holders is not None else ():
            ep = self._ep_names[h >> 3]
            found.setdefault(self.pool_of(ep), []).append(ep)
        return found

    def tiers_of(self, key: int, endpoint: str) -> set[Tier]:
        """The confirmed tiers holding `key` on `endpoint` (for tests and debugging)."""
        holders = self._keys.get(key)
        ep_id = self._ep_ids.get(endpoint)
        mask = _holder_mask(holders, ep_id) if holders is not None and ep_id is not None else 0
        return {t for t in Tier if mask & _BIT[t]}

    def contents(self) -> dict[int, dict[str, frozenset[Tier]]]:
        """Every confirmed request key with its endpoints and their tiers (tests and debugging: O(entries))."""
        names = self._ep_names
        return {key: {names[h >> 3]: frozenset(t for t in Tier if h & _BIT[t]) for h in _holder_items(holders)}
                for key, holders in self._keys.items()}

    def _id_of(self, endpoint: str) -> int:
        ep_id = self._ep_ids.get(endpoint)
        if ep_id is None:
            ep_id = self._ep_ids[endpoint] = len(self._ep_names)
            self._ep_names.append(endpoint)
        return ep_id

    # ---- events ------------------------------------------------------------------------------
    def apply_batch(self, endpoint: str, batch: DecodedBatch, model: str | None) -> ApplyStats:
        """Apply one decoded batch from `endpoint`'s publisher; `model` is the topic's model."""
        stats = ApplyStats()
        for event in batch.events:
            if isinstance(event, BlockStored):
                self._stored(endpoint, event, model, stats)
            elif isinstance(event, BlockRemoved):
                self._removed(endpoint, event, stats)
            elif isinstance(event, AllBlocksCleared):
                self.clear_endpoint(endpoint)
                stats.applied += 1
        if batch.unknown_events:
            stats.drop("unknown_type", batch.unknown_events)
        if batch.malformed_events:
            stats.drop("malformed", batch.malformed_events)
        self._evict_over_capacity()
        self.metrics.record_apply(stats.applied, stats.dropped, batch.unknown_fields)
        return stats

    def _stored(self, endpoint: str, ev: BlockStored, model: str | None, stats: ApplyStats) -> None:
        if (ev.group_idx or 0) != 0 or ev.kv_cache_spec_kind not in (None, "full_attention"):
            stats.drop("other_kv_group")
            return
        engine = self._engine.setdefault(endpoint, {})
        tier = ev.tier
        if not ev.token_ids:
            # Offload placeholder: same engine hashes as the GPU blocks, no tokens.
            for h in ev.block_hashes:
                chunk = self._offload_chunk(engine, h, tier)
                if not chunk:
                    stats.drop("unknown_engine_key")
                    continue
                for eb in chunk:
                    self._add_tier(endpoint, eb, tier)
            stats.applied += 1
            return
        n_blocks = len(ev.block_hashes)
        if n_blocks == 0:
            stats.drop("malformed")
            return
        esize = ev.block_size or len(ev.token_ids) // n_blocks
        if esize <= 0 or esize * n_blocks != len(ev.token_ids):
            stats.drop("malformed")
            return
        effective_model = ev.lora_name or model
        salt, extras_by_block = _split_extra_keys(ev.extra_keys, ev.lora_name)
        if ev.parent_block_hash is None:
            chain = self.keyer.root(effective_model, salt)
            tail: tuple[int, ...] = ()
            tail_hashes: tuple[int, ...] = ()
        else:
            parent = engine.get(ev.parent_block_hash)
            if parent is None:
                stats.drop("unknown_parent")
                return
            chain, tail, tail_hashes = parent.chain_key, parent.tail, parent.tail_hashes
        bsize = self.block_size
        offset = len(tail)
        combined = tail + ev.token_ids if tail else ev.token_ids
        extras = None
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
                    teb = engine.get(th)
                    if teb is not None:
                        teb.keys = _with_key(teb.keys, key)
            else:
                first_j = (start - offset) // esize
            for j in range(first_j, last_j + 1):
                keys_by_block[j].append(key)
        for j, h in enumerate(ev.block_hashes):
            block_end = offset + (j + 1) * esize
            done = block_end // bsize  # index blocks complete at the end of engine block j
            eb = engine.pop(h, None)
            block_keys = keys_by_block[j]
            if eb is None:
                eb = _EngineBlock(h)
                eb.keys = block_keys[0] if len(block_keys) == 1 else block_keys
            else:  # re-announced: keep keys that children's events added to it
                for k in block_keys:
                    eb.keys = _with_key(eb.keys, k)
            engine[h] = eb  # re-insert: newest last for the FIFO bound
            eb.parent = ev.parent_block_hash if j == 0 else ev.block_hashes[j - 1]
            eb.chain_key = keys[done - 1] if done > 0 else chain
            tail_start = done * bsize
            eb.tail = combined[tail_start:block_end]
            if eb.tail:
                first_tail_j = (tail_start - offset) // esize if tail_start >= offset else 0
                eb.tail_hashes = ((tail_hashes if tail_start < offset else ())
                                  + tuple(ev.block_hashes[first_tail_j:j + 1]))
            else:
                eb.tail_hashes = ()
            self._add_tier(endpoint, eb, tier, force_bits=True)
        stats.applied += 1
        if len(engine) > self.engine_capacity:
            self._trim_engine(endpoint, engine)

    def _add_tier(self, endpoint: str, eb: _EngineBlock, tier: Tier, force_bits: bool = False) -> None:
        if tier is Tier.GPU:
            eb.counts |= 1
        else:
            _set_count(eb, tier, _count(eb, tier) + 1)
        bit = _BIT[tier]
        if force_bits or _count(eb, tier) == 1:
            ep_id = self._id_of(endpoint)
            for key in _keys_of(eb.keys):
                self._set_bit(key, endpoint, ep_id, bit)

    def _removed(self, endpoint: str, ev: BlockRemoved, stats: ApplyStats) -> None:
        if (ev.group_idx or 0) != 0:
            stats.drop("other_kv_group")
            return
        engine = self._engine.get(endpoint)
        tier = ev.tier
        for h in ev.block_hashes:
            chunk = self._offload_chunk(engine, h, tier) if engine else []
            if not chunk or _count(chunk[0], tier) == 0:
                stats.drop("unknown_engine_key")
                continue
            for eb in chunk:
                count = _count(eb, tier)
                if count == 0:
                    continue
                count = 0 if tier is Tier.GPU else count - 1
                _set_count(eb, tier, count)
                if count == 0:
                    bit = _BIT[tier]
                    for key in _keys_of(eb.keys):
                        self._clear_bit(key, endpoint, bit)
            for eb in chunk:
                if not eb.counts and engine.get(eb.hash) is eb:
                    del engine[eb.hash]
        stats.applied += 1

    def _offload_chunk(self, engine: dict[int, _EngineBlock], h: int, tier: Tier) -> list[_EngineBlock]:
        """The engine blocks an offload event for hash `h` stands for: vLLM announces a chunk of
        `offload_chunk_blocks` GPU blocks by the hash of its last block, so walk back the chain."""
        eb = engine.get(h)
        if eb is None:
            return []
        chunk = [eb]
        if tier is not Tier.GPU:
            while len(chunk) < self.offload_chunk_blocks and eb.parent is not None:
                eb = engine.get(eb.parent)
                if eb is None:
                    break
                chunk.append(eb)
        return chunk


    def _trim_engine(self, endpoint: str, engine: dict[int, _EngineBlock]) -> None:
        evicted = 0
        while len(engine) > self.engine_capacity:
            h = next(iter(engine))
            eb = engine.pop(h)
            # We can no longer see this block's removal, so stop claiming it.
            for tier in Tier:
                if _count(eb, tier):
                    for key in _keys_of(eb.keys):
                        self._clear_bit(key, endpoint, _BIT[tier])
            evicted += 1
        self.metrics.engine_evictions.inc(evicted)

    # ---- entries -----------------------------------------------------------------------------
    def _set_bit(self, key: int, endpoint: str, ep_id: int, bit: int) -> None:
        keys = self._keys
        holders = keys.get(key)
        if holders is None:
            keys[key] = ep_id << 3 | bit
            old = 0
        else:
            keys.move_to_end(key)
            if holders.__class__ is int:  # one holder (inlined: this runs for every block stored)
                if holders >> 3 == ep_id:  # type: ignore[operator]
                    old = holders & 7  # type: ignore[operator]
                    if not old & bit:
                        keys[key] = holders | bit  # type: ignore[operator]
                else:
                    old = 0
                    keys[key] = (holders, ep_id << 3 | bit)  # type: ignore[assignment]
            else:
                old = _holder_mask(holders, ep_id)
                if old | bit != old:
                    keys[key] = _with_holder(holders, ep_id, old | bit)
        if not old:
            self._entries += 1
            self._pool_entries[self._pools.get(endpoint, DEFAULT_POOL)] += 1
        spec = self._spec.get(key)
        if spec is not None and endpoint in spec:
            del spec[endpoint]
            if not spec:
                del self._spec[key]

    def _clear_bit(self, key: int, endpoint: str, bit: int) -> None:
        holders = self._keys.get(key)
        ep_id = self._ep_ids.get(endpoint)
        if holders is None or ep_id is None:
            return
        old = _holder_mask(holders, ep_id)
        if not old:
            return
        new = old & ~bit
        if new:
            if new != old:
                self._keys[key] = _with_holder(holders, ep_id, new)
            return
        self._entries -= 1
        self._pool_entries[self._pools.get(endpoint, DEFAULT_POOL)] -= 1
        rest = _without_holder(holders, ep_id)
        if rest is None:
            del self._keys[key]
        else:
            self._keys[key] = rest

    def _evict_over_capacity(self) -> None:
        evicted = 0
        pools, counts, names = self._pools, self._pool_entries, self._ep_names
        while self._entries > self.capacity:
            _, holders = self._keys.popitem(last=False)
            items = _holder_items(holders)
            self._entries -= len(items)
            evicted += len(items)
            for h in items:
                counts[pools.get(names[h >> 3], DEFAULT_POOL)] -= 1
        if evicted:
            self.metrics.evictions.inc(evicted)

    def clear_endpoint(self, endpoint: str) -> int:
        """Forget everything `endpoint` holds (AllBlocksCleared, publisher restart, lost events)."""
        engine = self._engine.pop(endpoint, None)
        removed = 0
        ep_id = self._ep_ids.get(endpoint)
        if engine and ep_id is not None:
            keys = self._keys
            pool = self.pool_of(endpoint)
            for eb in engine.values():
                for key in _keys_of(eb.keys):
                    holders = keys.get(key)
                    if holders is not None and _holder_mask(holders, ep_id):
                        self._entries -= 1
                        self._pool_entries[pool] -= 1
                        removed += 1
                        rest = _without_holder(holders, ep_id)
                        if rest is None:
                            del keys[key]
                        else:
                            keys[key] = rest
        for key in [k for k, spec in self._spec.items() if endpoint in spec]:
            spec = self._spec[key]
            del spec[endpoint]
            if not spec:
                del self._spec[key]
        return removed

    def remove_endpoint(self, endpoint: str) -> int:
        """The endpoint left the pool: drop its entries and its engine-hash map."""
        removed = self.clear_endpoint(endpoint)
        self._pools.pop(endpoint, None)
        return removed

    # ---- speculative entries -----------------------------------------------------------------
    def add_speculative(self, endpoint: str, keys: Sequence[int], ttl_s: float | None = None) -> int:
        """After a pick: claim `keys` on `endpoint` (as GPU) for a short TTL, until events confirm."""
        ttl = self.speculative_ttl_s if ttl_s is None else ttl_s
        if ttl <= 0 or not keys:
            return 0
        now = self._clock()
        self._purge_speculative(now)
        ep_id = self._ep_ids.get(endpoint)
        expiry = now + ttl
        added = 0
        for key in keys:
            holders = self._keys.get(key)
            if holders is not None and ep_id is not None and _holder_mask(holders, ep_id):
                continue
            self._spec.setdefault(key, {})[endpoint] = expiry
            self._spec_queue.append((expiry, key, endpoint))
            added += 1
        while len(self._spec_queue) > self.speculative_capacity:
            self._drop_spec(*self._spec_queue.popleft())
        return added

    def speculative_entries(self) -> int:
        """Speculative (key, endpoint) claims not yet expired or confirmed."""
        self._purge_speculative(self._clock())
        return sum(len(s) for s in self._spec.values())

    def _drop_spec(self, expiry: float, key: int, endpoint: str) -> None:
        spec = self._spec.get(key)
        if spec is not None and spec.get(endpoint) == expiry:
            del spec[endpoint]
            if not spec:
                del self._spec[key]

    def _purge_speculative(self, now: float) -> None:
        queue = self._spec_queue
        while queue and queue[0][0] <= now:
            self._drop_spec(*queue.popleft())

    # ---- lookups -----------------------------------------------------------------------------
    def lookup(self, keys: Sequence[int], endpoints: Iterable[str] | None = None,
               pool: str | None = None) -> dict[str, list[Tier]]:
        """Per endpoint, the best tier of each block in its longest run of consecutive keys from
        the start; endpoints with no first block are left out. O(blocks × endpoints still in run).
        With `pool`, only endpoints of that pool are considered."""
        result: dict[str, list[Tier]] = {}
        if not keys:
            return result
        now = self._clock()
        if self._spec_queue:
            self._purge_speculative(now)
        spec_all = self._spec
        all_keys = self._keys
        if endpoints is None:
            first = all_keys.get(keys[0])
            names: Iterable[str] = {self._ep_names[h >> 3] for h in _holder_items(first)} if first is not None \
                else set()
            names = set(names) | set(spec_all.get(keys[0]) or ())
        else:
            names = endpoints
        if pool is not None:
            pools = self._pools
            names = [name for name in names if pools.get(name, DEFAULT_POOL) == pool]
        # Endpoints still in the run, by id: each key's few holders are looked up here, rather than
        # every endpoint in each key's holders.
        ids = self._ep_ids
        alive: dict[int, str] = {}
        for name in names:
            ep_id = ids.get(name)
            alive[self._id_of(name) if ep_id is None else ep_id] = name
        matched = 0
        touched = all_keys.move_to_end
        best = _BEST_TIER
        for key in keys:
            holders = all_keys.get(key)
            spec = spec_all.get(key)
            if holders is None and spec is None:
                break
            hits = 0
            items = () if holders is None else (holders,) if holders.__class__ is int else holders
            for h in items:  # type: ignore[union-attr]
                name = alive.get(h >> 3)
                if name is not None:
                    hits += 1
                    tiers = result.get(name)
                    if tiers is None:
                        tiers = result[name] = []
                    tiers.append(best[h & 7])
            if hits < len(alive):  # the run ends here for some: keep the others
                still = {h >> 3: alive[h >> 3] for h in items if h >> 3 in alive}  # type: ignore[union-attr]
                if spec is not None:
                    for ep_id, name in alive.items():
                        if ep_id not in still and name in spec:
                            still[ep_id] = name
                            tiers = result.get(name)
                            if tiers is None:
                                tiers = result[name] = []
                            tiers.append(Tier.GPU)
                if not still:
                    break
                alive = still
            if holders is not None:
                touched(key)
            matched += 1
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
