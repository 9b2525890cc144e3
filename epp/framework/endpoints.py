"""`EndpointSource`: what a plugin may ask of the pool's endpoints (the picker's endpoint registry)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from epp.framework.types import Endpoint

#: Called with (added, removed) endpoints whenever the pool changes.
EndpointListener = Callable[[tuple[Endpoint, ...], tuple[Endpoint, ...]], None]


class EndpointSource(Protocol):
    """The pool's endpoints as immutable snapshots, and notices when they change."""

    #: Whether discovery has produced its first full view of the pool.
    synced: bool

    def snapshot(self) -> tuple[Endpoint, ...]:
        """All endpoints now, each with its latest metrics."""
        ...

    def get(self, name: str) -> Endpoint | None:
        """The endpoint named `name` (`ip:port`), if it is in the pool."""
        ...

    def add_listener(self, listener: EndpointListener) -> None:
        """Call `listener(added, removed)` whenever the set of endpoints changes."""
        ...

    def remove_listener(self, listener: EndpointListener) -> None:
        """Stop calling `listener`."""
        ...

    def add_metrics_listener(self, listener: Callable[[Endpoint], None]) -> None:
        """Call `listener(endpoint)` after each new scrape of an endpoint's metrics or health."""
        ...

    def expect_sleeping(self, name: str, sleeping: bool, for_seconds: float) -> None:
        """Mark an endpoint asleep or awake after a sleep/wake call, held until a scrape agrees or time passes."""
        ...
