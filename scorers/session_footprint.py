"""The KV context the active sessions keep on each endpoint: what a new session's home will have to share.

A session between turns (a tool running, a person reading) shows in no queue and no in-flight count, yet
its context sits in its home's KV cache and is read again at its next turn. An endpoint whose active
sessions' contexts together exceed its KV tiers evicts some of them between their turns, and every such
turn is prefilled again: placing one more session there costs that recompute. `SessionFootprint` keeps,
per session active within the window, its home and context size, and the sums per endpoint.

Bounded like every per-session table (`SessionTable`: capacity, least recently used out, idle expiry at
the window, its metrics under the owning plugin's name with `:active`); the sums follow every eviction.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from epp.scorers.session_table import SessionTable


@dataclass(frozen=True, slots=True)
class Footprint:
    """One active session: its home and the tokens of context it keeps there."""

    endpoint: str
    tokens: int


class SessionFootprint:
    """Per endpoint, the context tokens of the sessions homed there and active within `window_s`."""

    def __init__(self, table: str, *, window_s: float, capacity: int, registry: CollectorRegistry | None = None) -> None:
        self.sessions: SessionTable[Footprint] = SessionTable(
            f"{table}:active", capacity=capacity, ttl_s=window_s, registry=registry, on_evict=self._forget)
        self.by_endpoint: dict[str, int] = {}
        self.total = 0

    def record(self, session: str, endpoint: str, tokens: int, now: float | None = None) -> None:
        """`session` is active now, homed on `endpoint` with `tokens` of context there."""
        old = self.sessions.pop(session)
        if old is not None:
            self._forget(session, old)
        self.by_endpoint[endpoint] = self.by_endpoint.get(endpoint, 0) + tokens
        self.total += tokens
        self.sessions.put(session, Footprint(endpoint, tokens), now)

    def tokens_on(self, endpoint: str) -> int:
        """Context tokens the active sessions homed on `endpoint` keep there."""
        return self.by_endpoint.get(endpoint, 0)

    def mean_tokens(self) -> float:
        """The mean context of an active session (0 with none): what a new session is expected to grow to."""
        return self.total / len(self.sessions) if len(self.sessions) else 0.0

    def sweep(self, now: float | None = None) -> None:
        """Drop the sessions idle past the window (amortised O(1))."""
        self.sessions.sweep(now)

    def debug_state(self) -> dict[str, object]:
        """The table's bounds and the per-endpoint sums (never session ids)."""
        return {**self.sessions.debug_state(), "tokens_by_endpoint": dict(self.by_endpoint)}

    def _forget(self, _session: str, footprint: Footprint) -> None:
        self.total -= footprint.tokens
        left = self.by_endpoint.get(footprint.endpoint, 0) - footprint.tokens
        if left > 0:
            self.by_endpoint[footprint.endpoint] = left
        else:
            self.by_endpoint.pop(footprint.endpoint, None)
