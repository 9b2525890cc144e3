"""A bounded table keyed by session (or program) id: capacity, idle expiry, least recently used out, metrics.

Session ids are chosen by clients, so a flood of distinct ids (thousands a second, one per
request) must not grow the picker's memory: every table of per-session state is one of these.

- At most `capacity` entries; a new id past it drops the least recently used entry (`capacity`).
- An entry not used for `ttl_s` seconds is dropped when next read, and by the sweep every write
  runs over the oldest entries (`idle`): entries are kept in use order, so the expired ones are
  always at the front and the sweep stops at the first live one (amortised O(1) per write).
- Metrics, by table (the plugin's name): `epp_session_table_entries` and
  `epp_session_table_evictions_total{reason=capacity|idle}`.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge

from epp.framework import once_per_registry

V = TypeVar("V")

# The default bound of every session table: about 100 bytes of key and a small record each.
DEFAULT_CAPACITY = 100_000
EVICTION_REASONS = ("capacity", "idle")


@dataclass(frozen=True)
class _Families:
    entries: Gauge
    evictions: Counter


def _families(registry: CollectorRegistry | None) -> _Families:
    def build(r: CollectorRegistry | None) -> _Families:
        return _Families(
            Gauge("epp_session_table_entries", "Sessions (or programs) a session table holds, by table (plugin).",
                  ["table"], registry=r),
            Counter("epp_session_table_evictions", "Entries a session table dropped, by table and reason "
                    "(capacity: least recently used past the capacity; idle: unused past the table's TTL).",
                    ["table", "reason"], registry=r))
    return once_per_registry(registry, "epp_session_table", build)


class SessionTable(Generic[V]):
    """Bounded LRU map from a session id to `V`, with idle expiry (`ttl_s`; 0 = none) and metrics."""

    def __init__(self, table: str, *, capacity: int = DEFAULT_CAPACITY, ttl_s: float = 0.0,
                 registry: CollectorRegistry | None = None, clock: Callable[[], float] = time.monotonic,
                 on_evict: Callable[[str, V], None] | None = None) -> None:
        if capacity < 1:
            raise ValueError(f"session table {table!r}: capacity must be >= 1, got {capacity}")
        if not ttl_s >= 0:
            raise ValueError(f"session table {table!r}: ttl must be >= 0, got {ttl_s}")
        self.table = table
        self.capacity = capacity
        self.ttl_s = float(ttl_s)
        self.clock = clock
        self.on_evict = on_evict
        self._entries: OrderedDict[str, tuple[V, float]] = OrderedDict()  # id -> (value, last use)
        families = _families(registry)
        self._size = families.entries.labels(table)
        self._evicted = {reason: families.evictions.labels(table, reason) for reason in EVICTION_REASONS}
        self.evictions = dict.fromkeys(EVICTION_REASONS, 0)
        self._size.set(0)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def _expired(self, last_use: float, now: float) -> bool:
        return self.ttl_s > 0 and now - last_use > self.ttl_s

    def get(self, key: str, now: float | None = None, *, touch: bool = True) -> V | None:
        """The live entry of `key` (None when absent or expired); `touch` makes it the most recently used."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        now = self.clock() if now is None else now
        if self._expired(entry[1], now):
            self._drop(key, "idle")
            return None
        if touch:
            self._entries[key] = (entry[0], now)
            self._entries.move_to_end(key)
        return entry[0]

    def put(self, key: str, value: V, now: float | None = None) -> None:
        """Store `value` as the most recently used entry, dropping expired and, past capacity, the oldest."""
        now = self.clock() if now is None else now
        self._entries[key] = (value, now)
        self._entries.move_to_end(key)
        self.sweep(now)
        while len(self._entries) > self.capacity:
            oldest = next(iter(self._entries))
            self._drop(oldest, "capacity")
        self._size.set(len(self._entries))

    def setdefault(self, key: str, factory: Callable[[], V], now: float | None = None) -> V:
        """The live entry of `key`, made most recently used, or a new one from `factory`."""
        value = self.get(key, now)
        if value is None:
            value = factory()
            self.put(key, value, now)
        return value

    def pop(self, key: str) -> V | None:
        """Remove `key` (not counted as an eviction) and return its value."""
        entry = self._entries.pop(key, None)
        self._size.set(len(self._entries))
        return entry[0] if entry is not None else None

    def sweep(self, now: float | None = None) -> int:
        """Drop the entries unused past the TTL (the oldest first); how many were dropped."""
        if self.ttl_s <= 0:
            return 0
        now = self.clock() if now is None else now
        dropped = 0
        while self._entries:
            key, (_, last_use) = next(iter(self._entries.items()))
            if not self._expired(last_use, now):
                break
            self._drop(key, "idle")
            dropped += 1
        return dropped

    def items(self) -> Iterator[tuple[str, V]]:
        """Every entry, least recently used first (expired ones included until swept)."""
        for key, (value, _) in list(self._entries.items()):
            yield key, value

    def _drop(self, key: str, reason: str) -> None:
        value, _ = self._entries.pop(key)
        self.evictions[reason] += 1
        self._evicted[reason].inc()
        self._size.set(len(self._entries))
        if self.on_evict is not None:
            self.on_evict(key, value)

    def debug_state(self) -> dict[str, object]:
        """Size, bounds and evictions (never the ids: clients choose them)."""
        return {"entries": len(self._entries), "capacity": self.capacity, "ttl_s": self.ttl_s,
                "evictions": dict(self.evictions)}
