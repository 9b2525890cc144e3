"""Which replica stored which response: learned from responses, asked by follow-ups (`previous_response_id`).

vLLM keeps a Responses API response in the memory of the replica that produced it; a follow-up
naming it (`previous_response_id`) can only be served there. The store maps a response id to the
endpoint that answered it, bounded: at most `capacity` ids (least recently used out) and each
for `ttl_s` seconds after it was last learned or asked for (a client continues a conversation
within minutes; a replica's memory does not keep it forever either). Metrics: ids held,
evictions by reason, lookups by outcome (`pinned`, `unknown`, `gone`).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge

from epp.framework import once_per_registry

# A response id longer than this is not one of a model server's (vLLM: `resp_` and 32 hex digits).
MAX_RESPONSE_ID_CHARS = 256


class ResponseStoreMetrics:
    """Ids held, evictions and lookups of every parser's response store, by parser name."""

    def __init__(self, registry: CollectorRegistry | None) -> None:
        self.entries = Gauge("epp_response_affinity_entries", "Response ids whose replica the picker remembers "
                             "(Responses API previous_response_id affinity)", ["parser"], registry=registry)
        self.evictions = Counter("epp_response_affinity_evictions", "Response ids forgotten, by reason "
                                 "(capacity, expired)", ["parser", "reason"], registry=registry)
        self.lookups = Counter("epp_response_affinity_lookups", "Follow-ups naming a previous_response_id, by "
                               "outcome (pinned: sent to the replica that stored it; unknown: never seen or "
                               "expired, routed as any request; gone: its replica left the pool, answered 404)",
                               ["parser", "outcome"], registry=registry)


class ResponseStore:
    """Response id -> endpoint name, bounded by `capacity` (least recently used out) and `ttl_s`."""

    def __init__(self, capacity: int, ttl_s: float, *, name: str = "", registry: CollectorRegistry | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.capacity = capacity
        self.ttl_s = ttl_s
        self._clock = clock
        self._entries: OrderedDict[str, tuple[str, float]] = OrderedDict()  # id -> (endpoint, expires at)
        metrics = once_per_registry(registry, "epp_response_affinity", ResponseStoreMetrics)
        metrics.entries.labels(name).set_function(lambda: len(self._entries))
        self._evicted_capacity = metrics.evictions.labels(name, "capacity")
        self._evicted_expired = metrics.evictions.labels(name, "expired")
        self._lookups = {outcome: metrics.lookups.labels(name, outcome) for outcome in ("pinned", "unknown", "gone")}

    def __len__(self) -> int:
        return len(self._entries)

    def learn(self, response_id: str, endpoint: str) -> None:
        """`endpoint` stored the response `response_id` (a response the picker saw come back from it)."""
        if not response_id or len(response_id) > MAX_RESPONSE_ID_CHARS or self.capacity <= 0:
            return
        entries = self._entries
        entries[response_id] = (endpoint, self._clock() + self.ttl_s)
        entries.move_to_end(response_id)
        self._expire()
        while len(entries) > self.capacity:
            entries.popitem(last=False)
            self._evicted_capacity.inc()

    def endpoint_of(self, response_id: str) -> str | None:
        """The endpoint that stored `response_id`, if known and not expired (its time to live starts again)."""
        entries = self._entries
        found = entries.get(response_id)
        now = self._clock()
        if found is None:
            return None
        if found[1] <= now:
            del entries[response_id]
            self._evicted_expired.inc()
            return None
        entries[response_id] = (found[0], now + self.ttl_s)
        entries.move_to_end(response_id)
        return found[0]

    def counted(self, outcome: str) -> None:
        """Count a follow-up's lookup by outcome: `pinned`, `unknown` or `gone`."""
        self._lookups[outcome].inc()

    def _expire(self) -> None:
        """Drop expired ids from the old end (entries are in last-used order, so expired ones come first)."""
        entries = self._entries
        now = self._clock()
        while entries:
            first = next(iter(entries.values()))
            if first[1] > now:
                return
            entries.popitem(last=False)
            self._evicted_expired.inc()
