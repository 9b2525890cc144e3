"""How old an endpoint's metrics are, and whether they are too old to trust."""

from __future__ import annotations

import time

from epp.framework.types import EndpointMetrics


def metrics_age(metrics: EndpointMetrics, now: float | None = None) -> float:
    """Seconds since the metrics were scraped (`time.monotonic()` clock); infinite if never."""
    if metrics.update_time <= 0.0:
        return float("inf")
    return (time.monotonic() if now is None else now) - metrics.update_time


def is_stale(metrics: EndpointMetrics, threshold: float, now: float | None = None) -> bool:
    """True when the metrics were never scraped or are older than `threshold` seconds."""
    return metrics_age(metrics, now) > threshold
