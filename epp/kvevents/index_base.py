"""What both KV-index backends share: request keys, the engine map, speculative claims, endpoint pools.

A backend (`index.KVBlockIndex` in memory, `redis_index.RedisKVIndex` on Redis) subclasses
`KVIndexBase`, stores the holder changes the engine map makes (`hold`, `release`,
`release_endpoint`: it is the map's `Holders`) and answers lookups from them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from epp.kvevents.engine_map import EngineMap, Holders
from epp.kvevents.keys import BlockKeyer
from epp.kvevents.metrics import KVIndexMetrics
from epp.kvevents.speculative import SpeculativeClaims

DEFAULT_POOL = "both"  # an endpoint with no P/D role prefills and decodes: the aggregated pool


class KVIndexBase(Holders):
    """Request keys, the engine map feeding this backend's entries (the `Holders` a backend
    implements: `hold`, `release`, `release_endpoint`), speculative claims and pools."""

    def __init__(self, block_size: int, *, engine_capacity_per_endpoint: int, offload_chunk_blocks: int,
                 speculative_ttl_s: float, speculative_capacity: int, metrics: KVIndexMetrics | None,
                 clock: Callable[[], float]) -> None:
        self.keyer = BlockKeyer(block_size)
        self.block_size = block_size
        self.speculative_ttl_s = speculative_ttl_s
        self.metrics = metrics or KVIndexMetrics(None)
        self._clock = clock
        self._engine = EngineMap(self.keyer, self, capacity_per_endpoint=engine_capacity_per_endpoint,
                                 offload_chunk_blocks=offload_chunk_blocks, metrics=self.metrics)
        self._claims = SpeculativeClaims(speculative_capacity)
        self._spec = self._claims.by_key  # read directly by the hot paths
        self._pools: dict[str, str] = {}
        self.metrics.bind_speculative(lambda: len(self._claims))

    # ---- endpoints -------------------------------------------------------------------------------
    def endpoints(self) -> list[str]:
        """Endpoints whose events this index applies (they have an engine map)."""
        return self._engine.endpoints()

    def engine_blocks(self, endpoint: str) -> int:
        """Engine hashes known for an endpoint (bounded by `engine_capacity_per_endpoint`)."""
        return self._engine.blocks(endpoint)

    def clear_endpoint(self, endpoint: str) -> int:
        """Forget everything `endpoint` holds (AllBlocksCleared, publisher restart, lost events)."""
        return self._engine.clear(endpoint)

    def remove_endpoint(self, endpoint: str) -> int:
        """The endpoint left the pool: drop its entries, its engine map and its pool."""
        removed = self.clear_endpoint(endpoint)
        self._pools.pop(endpoint, None)
        return removed

    def set_pool(self, endpoint: str, pool: str) -> None:
        """Put `endpoint` in `pool` (its P/D role)."""
        self._pools[endpoint] = pool

    def pool_of(self, endpoint: str) -> str:
        """The pool `endpoint` belongs to (`both` unless set)."""
        return self._pools.get(endpoint, DEFAULT_POOL)

    # ---- speculative entries (this process's own) --------------------------------------------------
    def add_speculative(self, endpoint: str, keys: Sequence[int], ttl_s: float | None = None) -> int:
        """After a pick: claim `keys` on `endpoint` (as GPU) for a short TTL, until events confirm."""
        ttl = self.speculative_ttl_s if ttl_s is None else ttl_s
        if ttl <= 0 or not keys:
            return 0
        now = self._clock()
        self._claims.purge(now)
        expiry = now + ttl
        claimed = 0
        for key in self._unheld(endpoint, keys):
            self._claims.claim(endpoint, key, expiry)
            claimed += 1
        evicted = self._claims.trim()
        if evicted:
            self.metrics.speculative_evictions.inc(evicted)
        return claimed

    def _unheld(self, endpoint: str, keys: Sequence[int]) -> Iterable[int]:
        """Of `keys`, those worth claiming on `endpoint` (a backend that sees its entries skips held ones)."""
        return keys

    def _confirm_claims(self, endpoint: str, keys: Iterable[int]) -> None:
        """A stored event confirmed `keys` on `endpoint`: they are no longer speculative."""
        confirm = self._claims.confirm
        for key in keys:
            confirm(key, endpoint)

    def speculative_entries(self) -> int:
        """Speculative (key, endpoint) claims not yet expired or confirmed."""
        self._claims.purge(self._clock())
        return len(self._claims)
