"""The KV-index backend interface: what the KV-event subscriber writes and the precise producer reads.

Two backends implement it: `InMemoryKVIndex` (the process-local `KVBlockIndex`, the default) and
`RedisKVIndex` (epp.kvevents.redis_index: entries in a Redis shared by every picker of a pool).
Both turn events into holder changes with the one engine map (epp.kvevents.engine_map, through
their common base epp.kvevents.index_base) and differ only in where the entries live.
Event application is synchronous (the subscriber applies batches in order; a remote backend
queues its writes); lookups are coroutines, so a remote backend does network I/O off the hot
path's critical CPU and never blocks the loop.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from epp.kvevents.decoding import DecodedBatch, Tier
from epp.kvevents.index import KVBlockIndex
from epp.kvevents.keys import BlockKeyer

BACKENDS = ("memory", "redis")


class KVIndexBackend(Protocol):
    """A KV block index: fed per endpoint by KV events, asked per request for prefix matches."""

    keyer: BlockKeyer

    async def start(self) -> None:
        """Open connections and background tasks (no-op for a local index)."""

    async def stop(self) -> None:
        """Close what `start` opened."""

    def apply_batch(self, endpoint: str, batch: DecodedBatch, model: str | None) -> Any:
        """Apply one decoded batch from `endpoint`'s publisher; `model` is the topic's model."""

    def clear_endpoint(self, endpoint: str) -> int:
        """Forget everything `endpoint` holds (AllBlocksCleared, publisher restart, lost events)."""

    def remove_endpoint(self, endpoint: str) -> int:
        """The endpoint left the pool: drop its entries and its engine-hash map."""

    def set_pool(self, endpoint: str, pool: str) -> None:
        """Put `endpoint` in `pool` (its P/D role)."""

    def endpoints(self) -> list[str]:
        """Endpoints with engine state in this process."""

    def engine_blocks(self, endpoint: str) -> int:
        """Engine hashes known for `endpoint` in this process (its blocks in any tier, bounded)."""

    def add_speculative(self, endpoint: str, keys: Sequence[int], ttl_s: float | None = None) -> int:
        """After a pick: claim `keys` on `endpoint` (as GPU) for a short TTL, until events confirm."""

    async def lookup_async(self, keys: Sequence[int], endpoints: Iterable[str] | None = None,
                           pool: str | None = None) -> dict[str, list[Tier]]:
        """Per endpoint, the best tier of each block in its longest run of keys from the start."""


class InMemoryKVIndex(KVBlockIndex):
    """The process-local index as a backend: `KVBlockIndex` plus the async lookup of the interface."""

    async def start(self) -> None:
        """Nothing to open."""

    async def stop(self) -> None:
        """Nothing to close."""

    async def lookup_async(self, keys: Sequence[int], endpoints: Iterable[str] | None = None,
                           pool: str | None = None) -> dict[str, list[Tier]]:
        """`lookup`, which is CPU-bound and short (no I/O), as a coroutine."""
        return self.lookup(keys, endpoints, pool)
