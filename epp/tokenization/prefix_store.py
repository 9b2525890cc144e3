"""A byte-budgeted store of values computed for byte strings, found again for strings that share their head.

A multi-turn conversation re-sends its whole history each turn: whatever was computed for the
previous turn's prompt (its tokens, its block keys) holds for the part of this turn's that
repeats it, and only the rest needs work. `find(data)` returns the stored string that shares
the longest head with `data` (at least half of the stored string) and how many bytes they share;
usually the stored string is all of it, but the end of a turn may differ (a token merged across
the join, a regenerated answer), and what comes before still counts.

Finding it costs what hashing and comparing bytes costs (C speed, about 2x the length of `data`
in hashing at most), never a walk of Python objects: an entry of length L is filed under level
k = floor(log2 L) and the hash of its first 2^k bytes; a lookup hashes the first 2^k bytes of
`data` for each level from the highest down and compares the candidates filed there, stopping
at the first level that has one (every entry of a higher level shares a longer head). Long
entries are filed by long heads, so conversations that share a system prompt (or any head
shorter than half their length) do not crowd each other's buckets.

Bounded: the values' sizes (given by the caller) plus the stored bytes never exceed
`capacity_bytes`; the least recently found or stored entry goes first; the entry a new one was
computed from is dropped when the new one is stored (`put(..., supersedes=...)`), so a
conversation holds one entry, not one per turn; a bucket holds at most `bucket_size` entries
(the oldest goes). Thread-safe (tokenization runs in worker threads).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

import xxhash
from prometheus_client import CollectorRegistry, Counter, Gauge

V = TypeVar("V")
_xxh64 = xxhash.xxh64_intdigest


class PrefixStoreMetrics:
    """Lookups by outcome, bytes reused, evictions by reason; bytes and entries held (`bind` them)."""

    def __init__(self, registry: CollectorRegistry | None, prefix: str) -> None:
        kw = {"registry": registry}
        self.lookups = Counter(f"{prefix}_lookups", "Lookups, by outcome (hit: a stored prefix was found)",
                               ["outcome"], **kw)
        self.reused_bytes = Counter(f"{prefix}_reused_bytes", "Bytes of input covered by stored prefixes", **kw)
        self.evictions = Counter(f"{prefix}_evictions", "Entries dropped, by reason (capacity, superseded, bucket)",
                                 ["reason"], **kw)
        self.bytes = Gauge(f"{prefix}_bytes", "Bytes held (stored strings and their values)", **kw)
        self.entries = Gauge(f"{prefix}_entries", "Entries held", **kw)
        self._hit, self._miss = self.lookups.labels("hit"), self.lookups.labels("miss")
        self._evicted = {reason: self.evictions.labels(reason) for reason in ("capacity", "superseded", "bucket")}

    def bind(self, held_bytes: Callable[[], float], entries: Callable[[], float]) -> None:
        """Read the bytes and entries held from these callables (one store, or the sum of several)."""
        self.bytes.set_function(held_bytes)
        self.entries.set_function(entries)


def common_prefix(a: bytes, b: bytes, known: int = 0) -> int:
    """Length of the longest common head of `a` and `b`, whose first `known` bytes agree."""
    lo, hi = known, min(len(a), len(b))
    if a[lo:hi] == b[lo:hi]:
        return hi
    while hi - lo > 64:  # halving: about 2x the length copied and compared in all, at C speed
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    while lo < hi and a[lo] == b[lo]:
        lo += 1
    return lo


@dataclass(slots=True, eq=False)
class Stored(Generic[V]):
    """One stored string and its value (`size`: bytes charged for both)."""

    data: bytes
    value: V
    size: int
    anchor: tuple[int, int]


class PrefixStore(Generic[V]):
    """Values of byte strings, looked up by any string that starts with a stored one (the longest wins)."""

    def __init__(self, capacity_bytes: int, *, min_bytes: int = 256, bucket_size: int = 16,
                 metrics: PrefixStoreMetrics | None = None,
                 on_evict: Callable[[Stored[V]], None] | None = None) -> None:
        if capacity_bytes < 0 or min_bytes < 1 or bucket_size < 1:
            raise ValueError("capacity_bytes >= 0, min_bytes >= 1 and bucket_size >= 1 are required")
        self.capacity_bytes = capacity_bytes
        self.min_bytes = min_bytes
        self._min_level = min_bytes.bit_length() - 1
        self.bucket_size = bucket_size
        self.metrics = metrics
        self._on_evict = on_evict
        self._lock = threading.Lock()
        self._lru: OrderedDict[int, Stored[V]] = OrderedDict()  # id(entry) -> entry, least recent first
        self._buckets: dict[tuple[int, int], list[Stored[V]]] = {}
        self._bytes = 0

    @property
    def bytes(self) -> int:
        """Bytes held now."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._lru)

    def _anchor(self, view: memoryview, level: int) -> tuple[int, int]:
        return level, _xxh64(view[: 1 << level])

    def find(self, data: bytes) -> tuple[Stored[V], int] | None:
        """The stored entry sharing the longest head with `data`, and the bytes shared; None when none does.

        The entry becomes the most recently used. Only entries whose first half (or more) `data`
        repeats are found, and one longer than `data` only when in the same power of two.
        """
        found: Stored[V] | None = None
        shared = 0
        if len(data) >= self.min_bytes:
            view = memoryview(data)
            with self._lock:
                for level in range(len(data).bit_length() - 1, self._min_level - 1, -1):
                    bucket = self._buckets.get(self._anchor(view, level))
                    if bucket is None:
                        continue
                    for entry in bucket:
                        length = common_prefix(entry.data, data)  # exact: a hash collision shares nothing
                        if length > shared:
                            found, shared = entry, length
                    if found is not None:
                        self._lru.move_to_end(id(found))
                        break
        if self.metrics is not None:
            if found is None:
                self.metrics._miss.inc()
            else:
                self.metrics._hit.inc()
                self.metrics.reused_bytes.inc(shared)
        return None if found is None else (found, shared)

    def put(self, data: bytes, value: V, value_size: int, *, supersedes: Stored[V] | None = None) -> Stored[V] | None:
        """Store `value` for `data` (charged `len(data) + value_size` bytes); `supersedes` (a prefix of it) goes.

        Returns the entry, or None when `data` is too short to be found again or too big to hold.
        """
        size = len(data) + value_size
        if len(data) < self.min_bytes or size > self.capacity_bytes:
            return None
        level = len(data).bit_length() - 1
        entry = Stored(data, value, size, self._anchor(memoryview(data), level))
        evicted: list[tuple[Stored[V], str]] = []
        with self._lock:
            if supersedes is not None and id(supersedes) in self._lru:
                self._remove(supersedes)
                evicted.append((supersedes, "superseded"))
            bucket = self._buckets.setdefault(entry.anchor, [])
            bucket.append(entry)
            self._lru[id(entry)] = entry
            self._bytes += size
            if len(bucket) > self.bucket_size:  # bounds the comparisons of a lookup
                oldest = bucket[0]
                self._remove(oldest)
                evicted.append((oldest, "bucket"))
            while self._bytes > self.capacity_bytes:
                oldest = next(iter(self._lru.values()))
                self._remove(oldest)
                evicted.append((oldest, "capacity"))
        if self.metrics is not None:
            for _, reason in evicted:
                self.metrics._evicted[reason].inc()
        if self._on_evict is not None:
            for gone, _ in evicted:
                self._on_evict(gone)
        return entry

    def _remove(self, entry: Stored[V]) -> None:
        del self._lru[id(entry)]
        bucket = self._buckets[entry.anchor]
        bucket.remove(entry)
        if not bucket:
            del self._buckets[entry.anchor]
        self._bytes -= entry.size
