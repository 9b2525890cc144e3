"""Speculative entries: blocks claimed on an endpoint right after a pick, before KV events confirm them.

A request sent to an endpoint will store its prompt's blocks there within a prefill, but the KV
events saying so arrive only afterwards; a second request with the same prefix in between would
find nothing. Both index backends keep such claims here, per key and endpoint with an expiry; a
stored event confirms (drops) a claim, a TTL ends it, and at most `capacity` claims are held
(oldest dropped first).
"""

from __future__ import annotations

from collections import deque


class SpeculativeClaims:
    """(key, endpoint) claims with expiry times, bounded, oldest expiring first."""

    __slots__ = ("by_key", "capacity", "expiries")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        #: Per key, the endpoints claiming it and when each claim expires (read by lookups).
        self.by_key: dict[int, dict[str, float]] = {}
        #: (expiry, key, endpoint) in claim order; with one TTL that is expiry order too.
        self.expiries: deque[tuple[float, int, str]] = deque()

    def __len__(self) -> int:
        return sum(len(claims) for claims in self.by_key.values())

    def claim(self, endpoint: str, key: int, expiry: float) -> None:
        """Claim `key` on `endpoint` until `expiry` (call `trim` after a batch of claims)."""
        self.by_key.setdefault(key, {})[endpoint] = expiry
        self.expiries.append((expiry, key, endpoint))

    def trim(self) -> int:
        """Drop the oldest claims beyond the capacity; how many live claims were dropped."""
        expiries = self.expiries
        dropped = 0
        while len(expiries) > self.capacity:
            dropped += self._drop(*expiries.popleft())
        return dropped

    def purge(self, now: float) -> None:
        """Drop the claims that expired by `now`."""
        expiries = self.expiries
        while expiries and expiries[0][0] <= now:
            self._drop(*expiries.popleft())

    def confirm(self, key: int, endpoint: str) -> None:
        """An event stored `key` on `endpoint`: its claim is no longer speculative."""
        claims = self.by_key.get(key)
        if claims is not None and endpoint in claims:
            del claims[endpoint]
            if not claims:
                del self.by_key[key]

    def forget_endpoint(self, endpoint: str) -> None:
        """Drop every claim on `endpoint` (it was cleared or left the pool)."""
        for key in [k for k, claims in self.by_key.items() if endpoint in claims]:
            self.confirm(key, endpoint)

    def _drop(self, expiry: float, key: int, endpoint: str) -> bool:
        # A newer claim of the same (key, endpoint) has a later expiry and stays.
        claims = self.by_key.get(key)
        if claims is not None and claims.get(endpoint) == expiry:
            del claims[endpoint]
            if not claims:
                del self.by_key[key]
            return True
        return False
