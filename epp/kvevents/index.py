"""The in-memory KV block index: which endpoint holds which prompt blocks, in which tiers (GPU/CPU/disk).

Events become holder changes in the engine map (`engine_map.py`: dual keys, block-size
regrouping, offload chunks, tier counts, the per-endpoint bound); this index holds the entries
those changes make and answers lookups.

Policies (documented because they are choices):
- Capacity: entries are (request key, endpoint) pairs; whole keys are evicted least recently
  used (stored or matched) first. The dict's insertion order is the recency order (a touch
  re-inserts the key); when over capacity the index evicts down to 1/256 below it at once
  (`engine_map.trim_target`, the engine map's rule too), so the scan for the oldest keys is paid
  once per batch of evictions. A lookup touches what it matched only once the index holds more
  than half its capacity (`TOUCH_FROM`): below that nothing is near eviction, and touching costs
  about half a microsecond a key in a large index (4 ms a 100k-token prompt's 7,000 blocks, more
  than the walk itself); the keys matched while it fills its second half are ordered right when
  eviction starts, the older ones by when they were stored.
- Speculative entries (after a pick) count as GPU, expire after their TTL and are replaced by
  the confirmed event for the same key and endpoint.
- Memory (bytes per entry measured by bench/kv_index_bench.py --compare-with): a key's holders
  are one int of 16-bit fields `endpoint id << 3 | tier mask` (ids of removed endpoints are
  reused, at most 8192 endpoints at once); for the engine map's share see `engine_map.py`.
- Pools: each endpoint belongs to one pool (its P/D role: `prefill`, `decode`, or `both` for an
  aggregated replica, the default), so a lookup can be limited to a pool and the entries of each
  pool are counted (`epp_kv_index_pool_entries{pool}`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from itertools import repeat

from epp.kvevents.decoding import DecodedBatch, Tier
from epp.kvevents.engine_map import ALL_TIERS, BEST_TIER, ApplyStats, tiers_in, trim_target
from epp.kvevents.index_base import DEFAULT_POOL, KVIndexBase
from epp.kvevents.metrics import KVIndexMetrics

_GPU = Tier.GPU

# A key's holders: one int of 16-bit fields, each `endpoint id << 3 | tier mask` (mask > 0). Up to
# three holders fit in a 32-byte int (a tuple of two small ints cost 64 bytes, a dict ~230).
_FIELD = 16
_FIELD_MASK = (1 << _FIELD) - 1
MAX_ENDPOINTS = 1 << (_FIELD - 3)  # endpoint ids that fit in a field (ids of removed endpoints are reused)
# A lookup touches the keys it matched only past this share of the capacity (see the module docstring).
TOUCH_FROM = 0.5


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


class KVBlockIndex(KVIndexBase):
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
        super().__init__(block_size, engine_capacity_per_endpoint=engine_capacity_per_endpoint,
                         offload_chunk_blocks=offload_chunk_blocks, speculative_ttl_s=speculative_ttl_s,
                         speculative_capacity=speculative_capacity, metrics=metrics, clock=clock)
        self.capacity = capacity
        # Request key -> holders; insertion order is recency (oldest first).
        self._keys: dict[int, int] = {}
        # Endpoint names as small ids in the holders; a removed endpoint's id is reused.
        self._ep_ids: dict[str, int] = {}
        self._ep_names: list[str | None] = []
        self._free_ids: list[int] = []
        self._entries = 0
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
        return set(tiers_in(mask))

    def contents(self) -> dict[int, dict[str, frozenset[Tier]]]:
        """Every confirmed request key with its endpoints and their tiers (tests and debugging: O(entries))."""
        return {key: {self._name(f >> 3): tiers_in(f & 7) for f in _holder_fields(holders)}
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

    # ---- events and the entries they make ----------------------------------------------------
    def apply_batch(self, endpoint: str, batch: DecodedBatch, model: str | None) -> ApplyStats:
        """Apply one decoded batch from `endpoint`'s publisher; `model` is the topic's model."""
        stats = self._engine.apply(endpoint, batch, model)
        if self._entries > self.capacity:
            self._evict_over_capacity()
        return stats

    def hold(self, endpoint: str, keys: Sequence[int], bits: int) -> None:
        """`endpoint` holds each of `keys` in the tiers of `bits` too (the engine map's holder change);
        each key becomes the most recently used. New keys (the usual case) go in with one C-level update."""
        ep_id = self._ep_ids.get(endpoint)
        if ep_id is None:
            ep_id = self._id_of(endpoint)
        all_keys = self._keys
        n_keys = len(all_keys)
        field = ep_id << 3 | bits
        if not any(map(all_keys.__contains__, keys)):
            all_keys.update(zip(keys, repeat(field)))
            added = len(all_keys) - n_keys
        else:
            added = 0
            for key in keys:
                holders = all_keys.pop(key, 0)  # re-inserted: most recently used
                if holders <= _FIELD_MASK and holders >> 3 != ep_id:  # none or one other holder
                    all_keys[key] = holders | field << _FIELD if holders else field
                    added += 1
                    continue
                rest, shift = holders, 0
                while rest:  # find this endpoint's field; `shift` ends past the last one if it has none
                    if (rest & _FIELD_MASK) >> 3 == ep_id:
                        break
                    rest >>= _FIELD
                    shift += _FIELD
                if rest:  # held already (a speculative claim never coexists with a confirmed one)
                    all_keys[key] = holders | bits << shift
                else:
                    all_keys[key] = holders | field << shift
                    added += 1
        if added:
            self._entries += added
            self._pool_entries[self._pools.get(endpoint, DEFAULT_POOL)] += added
            if self._spec:
                self._confirm_claims(endpoint, keys)

    def release(self, endpoint: str, keys: Iterable[int], bits: int) -> None:
        """`endpoint` no longer holds `keys` in the tiers of `bits` (the engine map's holder change)."""
        ep_id = self._ep_ids.get(endpoint)
        if ep_id is None:
            return
        all_keys = self._keys
        removed = 0
        for key in keys:
            holders = all_keys.get(key)
            if holders is None:
                continue
            old = _mask_of(holders, ep_id)
            if not old & bits:
                continue
            new = old & ~bits
            if new:
                all_keys[key] = _with_mask(holders, ep_id, new)
                continue
            removed += 1
            rest = _with_mask(holders, ep_id, 0)
            if rest:
                all_keys[key] = rest
            else:
                del all_keys[key]
        if removed:
            self._entries -= removed
            self._pool_entries[self._pools.get(endpoint, DEFAULT_POOL)] -= removed

    def release_endpoint(self, endpoint: str, keys: Iterable[int]) -> int:
        """`endpoint` holds nothing any more: release `keys` in every tier, drop its claims."""
        before = self._entries
        self.release(endpoint, keys, ALL_TIERS)
        self._claims.forget_endpoint(endpoint)
        return before - self._entries

    def _evict_over_capacity(self) -> None:
        # Evict a little below capacity at once: finding the oldest keys scans the dict's front.
        need = self._entries - trim_target(self.capacity)
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

    def remove_endpoint(self, endpoint: str) -> int:
        """The endpoint left the pool: drop its entries and its engine-hash map (its id is reused)."""
        removed = super().remove_endpoint(endpoint)
        ep_id = self._ep_ids.pop(endpoint, None)
        if ep_id is not None:  # no key holds it any more: every holder field is backed by an engine block
            self._ep_names[ep_id] = None
            self._free_ids.append(ep_id)
        return removed

    # ---- speculative entries -----------------------------------------------------------------
    def _unheld(self, endpoint: str, keys: Sequence[int]) -> Iterable[int]:
        """Of `keys`, those `endpoint` does not hold already (a claim never doubles a confirmed entry)."""
        ep_id = self._id_of(endpoint)  # lookups follow speculative holders by id
        get_holders = self._keys.get
        return [key for key in keys if not _mask_of(get_holders(key, 0), ep_id)]

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
            best = BEST_TIER
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
            # Touch: the matched keys become the most recently used (below TOUCH_FROM of the capacity
            # nothing is near eviction, and touching would cost more than the walk).
            if matched and self._entries > self.capacity * TOUCH_FROM:
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

