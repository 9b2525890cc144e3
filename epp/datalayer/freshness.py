"""Unknown is not idle: prefer endpoints whose load is known over those never (or no longer) scraped.

A never-scraped endpoint carries zero queue and KV use, which every load scorer reads as the best
choice; a backend whose `/metrics` hangs keeps its last, ever older numbers. While some candidates
have fresh metrics, the others are left out; when none has, all stay (nothing better is known).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from epp.framework.types import Endpoint

# The window is this many scrape intervals, and never under the floor (a busy loop delays scrapes).
FRESHNESS_INTERVALS = 10
FRESHNESS_FLOOR_S = 0.5


def freshness_window(scrape_interval: float) -> float:
    """Seconds within which an endpoint's metrics count as fresh, for a given scrape interval."""
    return max(FRESHNESS_FLOOR_S, FRESHNESS_INTERVALS * scrape_interval)


def prefer_fresh(endpoints: Sequence[Endpoint], window: float, now: float | None = None) -> list[Endpoint]:
    """The endpoints with metrics younger than `window` seconds if there is one; else all of them."""
    now = time.monotonic() if now is None else now
    fresh = [ep for ep in endpoints if ep.metrics.age(now) <= window]
    return fresh if fresh else list(endpoints)
