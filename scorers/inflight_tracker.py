"""In-flight requests per endpoint as the picker sent them, with a timeout so lost completions expire."""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Generic, TypeVar

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


# A book's entry: one request, with the deadline it expires at.
_EntryT = TypeVar("_EntryT", bound="_Entry | _Request")


class _TimedBook(Generic[_EntryT]):
    """Requests and tokens counted per endpoint, each request an entry that ends on `finish`, on its
    timeout, or past capacity (oldest first); subclasses say how an entry counts and uncounts."""

    def __init__(self, timeout_s: float, capacity: int = 100_000, gauge: Gauge | None = None) -> None:
        self.timeout_s = timeout_s
        self.capacity = capacity
        self._entries: OrderedDict[int, _EntryT] = OrderedDict()
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
        """Requests counted on `endpoint`."""
        return self._requests.get(endpoint, 0)

    def tokens(self, endpoint: str) -> int:
        """Tokens counted on `endpoint`."""
        return self._tokens.get(endpoint, 0)

    def finish(self, key: int | None) -> None:
        """Stop counting a request; unknown or already finished keys are ignored."""
        entry = self._entries.pop(key, None) if key is not None else None
        if entry is not None:
            self._drop(entry)
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
            self._drop(entry)
            changed = True
        if changed:
            self._report()

    def _add_entry(self, entry: _EntryT) -> int:
        """Track an entry already counted; the oldest go past capacity. Returns its key."""
        key = next(self._ids)
        self._entries[key] = entry
        while len(self._entries) > self.capacity:
            _, oldest = self._entries.popitem(last=False)
            self._drop(oldest)
        self._report()
        return key

    def _drop(self, entry: _EntryT) -> None:
        """Uncount what an ending entry still counts."""
        raise NotImplementedError

    def _report(self) -> None:
        if self._gauge is not None:
            self._gauge.set(len(self._entries))


class InflightTracker(_TimedBook[_Entry]):
    """Counts requests and tokens per endpoint; entries end on `finish`, on timeout, or past capacity."""

    def start(self, endpoints: Iterable[str], tokens: int = 0, now: float | None = None) -> int:
        """Count a request on `endpoints`; returns the key that `finish` takes."""
        now = time.monotonic() if now is None else now
        self.expire(now)
        entry = _Entry(now + self.timeout_s, tuple(dict.fromkeys(endpoints)), tokens)
        self._apply(entry, +1)
        return self._add_entry(entry)

    def _drop(self, entry: _Entry) -> None:
        self._apply(entry, -1)

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


@dataclass(slots=True)
class _Part:
    """One profile's pick of a request: its endpoint, its tokens still counted, whether it still counts as a request."""

    profile: str
    endpoint: str
    generation: int  # of the endpoint's counters when counted (an endpoint that left and came back starts anew)
    tokens: int
    counted: bool = True


@dataclass(slots=True)
class _Request:
    deadline: float
    parts: list[_Part]


class LoadBook(_TimedBook[_Request]):
    """Requests and tokens in flight per endpoint, one request counted on each profile's pick (llm-d's counters).

    A request's tokens may be released before the request itself (`release`: its prefill is done),
    a profile's whole pick too; `finish` releases the rest. Entries end on `finish`, on timeout,
    or past capacity (oldest first); an endpoint that leaves the pool is forgotten at once
    (`remove_endpoint`), and later releases of its picks change nothing.
    """

    def __init__(self, timeout_s: float, capacity: int = 100_000, gauge: Gauge | None = None) -> None:
        super().__init__(timeout_s, capacity, gauge)
        self._generation: dict[str, int] = {}

    def start(self, picks: Iterable[tuple[str, str, int]], now: float | None = None) -> int | None:
        """Count a request: one `(profile, endpoint, tokens)` per profile's pick; the key `release`/`finish` take."""
        now = time.monotonic() if now is None else now
        self.expire(now)
        parts = [_Part(profile, ep, self._generation.get(ep, 0), max(0, tokens)) for profile, ep, tokens in picks]
        if not parts:
            return None
        for part in parts:
            self._add(part.endpoint, 1, part.tokens)
        return self._add_entry(_Request(now + self.timeout_s, parts))

    def release(self, key: int | None, *, whole: Iterable[str] = (), all_tokens: bool = False) -> None:
        """Release the picks of profiles `whole` entirely and, with `all_tokens`, the tokens of every other pick."""
        entry = self._entries.get(key) if key is not None else None
        if entry is None:
            return
        whole = set(whole)
        for part in entry.parts:
            if part.profile in whole:
                self._release(part, request=True)
            elif all_tokens:
                self._release(part, request=False)

    def remove_endpoint(self, endpoint: str) -> None:
        """Forget an endpoint that left the pool; what was counted on it is never released onto a newcomer."""
        self._requests.pop(endpoint, None)
        self._tokens.pop(endpoint, None)
        self._generation[endpoint] = self._generation.get(endpoint, 0) + 1
        if len(self._generation) > 1024:  # bounded: forget endpoints that no tracked request names
            named = {part.endpoint for entry in self._entries.values() for part in entry.parts}
            self._generation = {ep: g for ep, g in self._generation.items() if ep in named}

    def _drop(self, entry: _Request) -> None:
        for part in entry.parts:
            self._release(part, request=True)

    def _release(self, part: _Part, *, request: bool) -> None:
        live = part.generation == self._generation.get(part.endpoint, 0)
        requests = 1 if request and part.counted else 0
        if live and (requests or part.tokens):
            self._add(part.endpoint, -requests, -part.tokens)
        part.tokens = 0
        if request:
            part.counted = False

    def _add(self, endpoint: str, requests: int, tokens: int) -> None:
        count = self._requests.get(endpoint, 0) + requests
        total = max(0, self._tokens.get(endpoint, 0) + tokens)
        if count <= 0 and total <= 0:
            self._requests.pop(endpoint, None)
            self._tokens.pop(endpoint, None)
        else:
            self._requests[endpoint] = max(0, count)
            self._tokens[endpoint] = total
