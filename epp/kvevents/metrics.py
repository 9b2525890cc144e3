"""Prometheus metrics of the KV block index and the KV-event subscriber.

Collectors are registered on the `CollectorRegistry` passed in (none: they exist but are not
exported), so tests and several pickers in one process never collide on the global registry.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge


class KVIndexMetrics:
    """Size, evictions, lookup hits/misses (in blocks), events applied and dropped (by reason)."""

    def __init__(self, registry: CollectorRegistry | None, prefix: str = "epp_kv_index") -> None:
        kw = {"registry": registry}
        self.entries = Gauge(f"{prefix}_entries", "Confirmed (request key, endpoint) entries held", **kw)
        self.keys = Gauge(f"{prefix}_keys", "Distinct request block keys held", **kw)
        self.evictions = Counter(f"{prefix}_evictions", "Entries evicted by the capacity bound (LRU)", **kw)
        self.engine_evictions = Counter(
            f"{prefix}_engine_key_evictions", "Engine hashes forgotten by the per-endpoint bound", **kw)
        self.hits = Counter(f"{prefix}_lookup_hit_blocks", "Prompt blocks found (longest match)", **kw)
        self.misses = Counter(f"{prefix}_lookup_miss_blocks", "Prompt blocks not found", **kw)
        self.lookups = Counter(f"{prefix}_lookups", "Lookups served", **kw)
        self.events_applied = Counter(f"{prefix}_events_applied", "KV events applied", **kw)
        self.events_dropped = Counter(
            f"{prefix}_events_dropped", "KV events dropped, by reason", ["reason"], **kw)
        self.unknown_fields = Counter(
            f"{prefix}_unknown_fields", "Event fields skipped because we do not know them", **kw)
        self.speculative = Gauge(
            f"{prefix}_speculative_entries", "Speculative (key, endpoint) claims held (after picks, until confirmed "
            "or expired)", **kw)
        self.speculative_evictions = Counter(
            f"{prefix}_speculative_evictions", "Live speculative claims dropped by the capacity bound (oldest first)",
            **kw)
        self.pool_entries = Gauge(
            f"{prefix}_pool_entries", "Confirmed entries held by the endpoints of each pool (P/D role)",
            ["pool"], **kw)

    def bind_size(self, entries: Callable[[], int], keys: Callable[[], int]) -> None:
        """Read the sizes lazily at scrape time (no cost on the hot path)."""
        self.entries.set_function(entries)
        self.keys.set_function(keys)

    def bind_speculative(self, claims: Callable[[], int]) -> None:
        """Read the number of speculative claims lazily at scrape time."""
        self.speculative.set_function(claims)

    def bind_pool(self, pool: str, entries: Callable[[], int]) -> None:
        """Read one pool's entry count lazily at scrape time."""
        self.pool_entries.labels(pool).set_function(entries)

    def record_apply(self, applied: int, dropped: Mapping[str, int], unknown_fields: int) -> None:
        if applied:
            self.events_applied.inc(applied)
        for reason, n in dropped.items():
            self.events_dropped.labels(reason).inc(n)
        if unknown_fields:
            self.unknown_fields.inc(unknown_fields)

    def record_lookup(self, hit_blocks: int, miss_blocks: int) -> None:
        self.lookups.inc()
        if hit_blocks:
            self.hits.inc(hit_blocks)
        if miss_blocks:
            self.misses.inc(miss_blocks)


class KVSubscriberMetrics:
    """Messages, sequence gaps, restarts, replays and endpoint resets of the KV-event subscriber."""

    def __init__(self, registry: CollectorRegistry | None, prefix: str = "epp_kv_events") -> None:
        kw = {"registry": registry}
        self.messages = Counter(f"{prefix}_messages", "Event batches received (live and replayed)",
                                ["source"], **kw)
        self.decode_errors = Counter(f"{prefix}_decode_errors", "Messages that were not event batches", **kw)
        self.gaps = Counter(f"{prefix}_sequence_gaps", "Sequence gaps detected", **kw)
        self.restarts = Counter(f"{prefix}_publisher_restarts", "Publisher restarts (sequence went back)", **kw)
        self.replays = Counter(f"{prefix}_replays", "Replay requests, by outcome", ["outcome"], **kw)
        self.resets = Counter(
            f"{prefix}_endpoint_resets",
            "Endpoints whose entries were dropped because their events could not be repaired",
            ["reason"], **kw)
        self.unresolved = Counter(
            f"{prefix}_unresolved_topics", "Messages whose topic named no known endpoint", **kw)
        self.subscriptions = Gauge(f"{prefix}_subscriptions", "Publishers subscribed to", **kw)
