"""In-flight requests per endpoint as the picker sent them, with a timeout so lost completions expire."""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Gauge

from epp.framework import once_per_registry


def tracked_requests_gauge(registry: CollectorRegistry | None) -> Gauge:
    """`epp_plugin_inflight_tracked_requests{plugin}` on `registry`, created once per registry."""
    return once_per_registry(registry, "epp_plugin_inflight_tracked_requests", lambda r: Gauge(
        "epp_plugin_inflight_tracked_requests", "Requests a plugin tracks as in flight (until completion or timeout).",
        ["plugin"], registry=r))


@dataclass(frozen=True, slots=True)
class _Entry:
    deadline: float
    endpoints: tuple[str, ...]
    tokens: int


class InflightTracker:
    """Counts requests and tokens per endpoint; entries end on `finish`, on timeout, or past capacity."""

    def __init__(self, timeout_s: float, capacity: int = 100_000, gauge: Gauge | None = None) -> None:
        self.timeout_s = timeout_s
        self.capacity = capacity
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self._requests: dict[str, int] = {}
        self._tokens: dict[str, int] = {}
        self._ids = itertools.count(1)
        self._gauge = gauge

    def __len__(self) -> int:
        return len(self._entries)

    def debug_state(self) -> dict[str, object]:
        """Tracked requests, bounds, and requests and tokens per endpoint (for a plugin's `debug_state`)."""
        return {"tracked": len(self._entries), "capacity": self.capacity, "timeout_s": self.timeout_s,
                "requests": dict(self._requests), "tokens": dict(self._tokens)}

    def requests(self, endpoint: str) -> int:
        return self._requests.get(endpoint, 0)

    def tokens(self, endpoint: str) -> int:
        return self._tokens.get(endpoint, 0)

    def start(self, endpoints: Iterable[str], tokens: int = 0, now: float | None = None) -> int:
        """Count a request on `endpoints`; returns the key that `finish` takes."""
        now = time.monotonic() if now is None else now
        self.expire(now)
        key = next(self._ids)
        entry = _Entry(now + self.timeout_s, tuple(dict.fromkeys(endpoints)), tokens)
        self._entries[key] = entry
        self._apply(entry, +1)
        while len(self._entries) > self.capacity:
            _, oldest = self._entries.popitem(last=False)
            self._apply(oldest, -1)
        self._report()
        return key

    def finish(self, key: int | None) -> None:
        """Stop counting a request; unknown or already finished keys are ignored."""
        entry = self._entries.pop(key, None) if key is not None else None
        if entry is not None:
            self._apply(entry, -1)
            self._report()

    def expire(self, now: float | None = None) -> None:
        """Drop entries past their deadline (their completion was never seen)."""
        now = time.monotonic() if now is None else now
        entries = self._entries
        changed = False
        # Entries are in start order and share one timeout, so the oldest expire first.
        while entries:
            key, entry = next(iter(entries.items()))
            if entry.deadline > now:
                break
            del entries[key]
            self._apply(entry, -1)
            changed = True
        if changed:
            self._report()

    def _apply(self, entry: _Entry, sign: int) -> None:
        for ep in entry.endpoints:
            count = self._requests.get(ep, 0) + sign
            tokens = self._tokens.get(ep, 0) + sign * entry.tokens
            if count <= 0:
                self._requests.pop(ep, None)
                self._tokens.pop(ep, None)
            else:
                self._requests[ep] = count
                self._tokens[ep] = tokens

    def _report(self) -> None:
        if self._gauge is not None:
            self._gauge.set(len(self._entries))
