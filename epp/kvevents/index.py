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


class _EngineBlock:
    """What an endpoint's engine block maps to: request keys, the chain to continue, tier counts."""

    __slots__ = ("chain_key", "counts", "hash", "keys", "parent", "tail", "tail_hashes")

    def __init__(self, block_hash: int) -> None:
        self.hash = block_hash
        self.parent: int | None = None  # the previous engine block's hash in this chain
        self.keys: list[int] = []
        self.chain_key = 0
        self.tail: tuple[int, ...] = ()
        self.tail_hashes: tuple[int, ...] = ()
        self.counts = [0, 0, 0]


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
        self._keys: OrderedDict[int, dict[str, int]] = OrderedDict()
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
            held = sum(1 for eps in self._keys.values() if endpoint in eps)
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
        for ep in self._keys.get(key, {}):
            found.setdefault(self.pool_of(ep), []).append(ep)
        return found

    def tiers_of(self, key: int, endpoint: str) -> set[Tier]:
        """The confirmed tiers holding `key` on `endpoint` (for tests and debugging)."""
        mask = self._keys.get(key, {}).get(endpoint, 0)
        return {t for t in Tier if mask & _BIT[t]}

    def contents(self) -> dict[int, dict[str, frozenset[Tier]]]:
        """Every confirmed request key with its endpoints and their tiers (tests and debugging: O(entries))."""
        return {key: {ep: frozenset(t for t in Tier if mask & _BIT[t]) for ep, mask in holders.items() if mask}
                for key, holders in self._keys.items()}

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
                    if teb is not None and key not in teb.keys:
                        teb.keys.append(key)
            else:
                first_j = (start - offset) // esize
            for j in range(first_j, last_j + 1):
                keys_by_block[j].append(key)
        for j, h in enumerate(ev.block_hashes):
            block_end = offset + (j + 1) * esize
            done = block_end // bsize  # index blocks complete at the end of engine block j
            eb = engine.pop(h, None)
            if eb is None:
                eb = _EngineBlock(h)
                eb.keys = keys_by_block[j]
            else:  # re-announced: keep keys that children's events added to it
                eb.keys.extend(k for k in keys_by_block[j] if k not in eb.keys)
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
            eb.counts[0] = 1
        else:
            eb.counts[tier] += 1
        bit = _BIT[tier]
        if force_bits or eb.counts[tier] == 1:
            for key in eb.keys:
                self._set_bit(key, endpoint, bit)

    def _removed(self, endpoint: str, ev: BlockRemoved, stats: ApplyStats) -> None:
        if (ev.group_idx or 0) != 0:
            stats.drop("other_kv_group")
            return
        engine = self._engine.get(endpoint)
        tier = ev.tier
        for h in ev.block_hashes:
            chunk = self._offload_chunk(engine, h, tier) if engine else []
            if not chunk or chunk[0].counts[tier] == 0:
                stats.drop("unknown_engine_key")
                continue
            for eb in chunk:
                if eb.counts[tier] == 0:
                    continue
                eb.counts[tier] = 0 if tier is Tier.GPU else eb.counts[tier] - 1
                if eb.counts[tier] == 0:
                    bit = _BIT[tier]
                    for key in eb.keys:
                        self._clear_bit(key, endpoint, bit)
            for eb in chunk:
                if not any(eb.counts) and engine.get(eb.hash) is eb:
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
                if eb.counts[tier]:
                    for key in eb.keys:
                        self._clear_bit(key, endpoint, _BIT[tier])
            evicted += 1
        self.metrics.engine_evictions.inc(evicted)

    # ---- entries -----------------------------------------------------------------------------
    def _set_bit(self, key: int, endpoint: str, bit: int) -> None:
        eps = self._keys.get(key)
        if eps is None:
            eps = self._keys[key] = {}
        else:
            self._keys.move_to_end(key)
        old = eps.get(endpoint, 0)
        if not old:
            self._entries += 1
            self._pool_entries[self._pools.get(endpoint, DEFAULT_POOL)] += 1
        eps[endpoint] = old | bit
        spec = self._spec.get(key)
        if spec is not None and endpoint in spec:
            del spec[endpoint]
            if not spec:
                del self._spec[key]

    def _clear_bit(self, key: int, endpoint: str, bit: int) -> None:
        eps = self._keys.get(key)
        if not eps:
            return
        old = eps.get(endpoint)
        if old is None:
            return
        new = old & ~bit
        if new:
            eps[endpoint] = new
        else:
            del eps[endpoint]
            self._entries -= 1
            self._pool_entries[self._pools.get(endpoint, DEFAULT_POOL)] -= 1
            if not eps:
                del self._keys[key]

    def _evict_over_capacity(self) -> None:
        evicted = 0
        pools, counts = self._pools, self._pool_entries
        while self._entries > self.capacity:
            _, eps = self._keys.popitem(last=False)
            self._entries -= len(eps)
            evicted += len(eps)
            for ep in eps:
                counts[pools.get(ep, DEFAULT_POOL)] -= 1
        if evicted:
            self.metrics.evictions.inc(evicted)

    def clear_endpoint(self, endpoint: str) -> int:
        """Forget everything `endpoint` holds (AllBlocksCleared, publisher restart, lost events)."""
        engine = self._engine.pop(endpoint, None)
        removed = 0
        if engine:
            for eb in engine.values():
                for key in eb.keys:
                    eps = self._keys.get(key)
                    if eps and endpoint in eps:
                        del eps[endpoint]
                        self._entries -= 1
                        self._pool_entries[self.pool_of(endpoint)] -= 1
                        removed += 1
                        if not eps:
                            del self._keys[key]
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
        expiry = now + ttl
        added = 0
        for key in keys:
            eps = self._keys.get(key)
            if eps is not None and endpoint in eps:
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
        first = self._keys.get(keys[0])
        first_spec = spec_all.get(keys[0])
        if endpoints is None:
            alive = list(set(first or ()) | set(first_spec or ()))
        else:
            alive = list(endpoints)
        if pool is not None:
            alive = [ep for ep in alive if self._pools.get(ep, DEFAULT_POOL) == pool]
        matched = 0
        touched = self._keys.move_to_end
        for key in keys:
            eps = self._keys.get(key)
            spec = spec_all.get(key)
            if eps is None and spec is None:
                break
            still = []
            for ep in alive:
                mask = eps.get(ep, 0) if eps is not None else 0
                if mask:
                    tier = _BEST_TIER[mask]
                elif spec is not None and ep in spec:
                    tier = Tier.GPU
                else:
                    continue
                tiers = result.get(ep)
                if tiers is None:
                    tiers = result[ep] = []
                tiers.append(tier)
                still.append(ep)
            if not still:
                break
            if eps is not None:
                touched(key)
            alive = still
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
