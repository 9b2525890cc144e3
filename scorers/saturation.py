"""`utilization-detector`: pool saturation from queue depth and KV-cache use (GIE), also a Filter.

Per endpoint `max(q / queueDepthThreshold, kv / kvCacheUtilThreshold)`, or 1.0 when its metrics
are stale, missing or it is unhealthy; the pool's saturation is the mean (1.0 with no endpoints).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from epp.framework import (
    ConfigError,
    CycleState,
    Endpoint,
    Filter,
    InferenceRequest,
    PluginContext,
    PluginParams,
    PluginRegistry,
    SaturationDetector,
)


class UtilizationDetector(Filter, SaturationDetector):
    """Saturation detector over queue depth and KV-cache use; as a Filter keeps unsaturated endpoints."""

    type_name = "utilization-detector"

    def __init__(self, name: str | None = None, params: PluginParams | None = None,
                 context: PluginContext | None = None, *, queue_depth_threshold: float = 5.0,
                 kv_cache_util_threshold: float = 0.8, metrics_staleness_threshold: float = 0.2,
                 headroom: float = 0.0) -> None:
        super().__init__(name)
        if params is not None:
            queue_depth_threshold = params.float("queueDepthThreshold", queue_depth_threshold)
            kv_cache_util_threshold = params.float("kvCacheUtilThreshold", kv_cache_util_threshold)
            metrics_staleness_threshold = params.duration("metricsStalenessThreshold", metrics_staleness_threshold)
            headroom = params.float("headroom", headroom, minimum=0.0)
        where = f"plugin {self.name!r}: parameter"
        if queue_depth_threshold <= 0:
            raise ConfigError(f"{where} 'queueDepthThreshold' must be > 0, got {queue_depth_threshold}")
        if not 0 < kv_cache_util_threshold <= 1:
            raise ConfigError(f"{where} 'kvCacheUtilThreshold' must be in (0, 1], got {kv_cache_util_threshold}")
        if metrics_staleness_threshold <= 0:
            raise ConfigError(f"{where} 'metricsStalenessThreshold' must be > 0, got {metrics_staleness_threshold}")
        if headroom < 0:
            raise ConfigError(f"{where} 'headroom' must be >= 0, got {headroom}")
        self.queue_depth_threshold = float(queue_depth_threshold)
        self.kv_cache_util_threshold = float(kv_cache_util_threshold)
        self.metrics_staleness_threshold = float(metrics_staleness_threshold)
        self.headroom = float(headroom)

    def endpoint_saturation(self, endpoint: Endpoint, now: float | None = None) -> float:
        """`max(q/qThr, kv/kvThr)`; 1.0 if the metrics are stale or missing or the endpoint is down."""
        metrics = endpoint.metrics
        if not endpoint.healthy or metrics.is_stale(self.metrics_staleness_threshold, now):
            return 1.0
        return max(metrics.waiting_queue_size / self.queue_depth_threshold,
                   metrics.kv_cache_usage / self.kv_cache_util_threshold)

    def saturation(self, endpoints: Sequence[Endpoint], now: float | None = None) -> float:
        """The pool's saturation: the mean endpoint saturation; 1.0 with no endpoints (>= 1 = saturated)."""
        if not endpoints:
            return 1.0
        now = time.monotonic() if now is None else now
        return sum(self.endpoint_saturation(ep, now) for ep in endpoints) / len(endpoints)

    def filter(self, state: CycleState, request: InferenceRequest,
               endpoints: Sequence[Endpoint]) -> list[Endpoint]:
        """Keep fresh endpoints under both thresholds (times 1 + headroom); all if none qualify."""
        now = time.monotonic()
        queue_limit = self.queue_depth_threshold * (1.0 + self.headroom)
        kv_limit = self.kv_cache_util_threshold * (1.0 + self.headroom)
        kept = [ep for ep in endpoints
                if ep.healthy and not ep.metrics.is_stale(self.metrics_staleness_threshold, now)
                and ep.metrics.waiting_queue_size < queue_limit and ep.metrics.kv_cache_usage < kv_limit]
        # Failing open: with every endpoint busy, a busy pick beats failing the profile.
        return kept if kept else list(endpoints)


def register(registry: PluginRegistry) -> None:
    """Register `utilization-detector` (called by `epp.scorers.register_builtin_plugins`)."""
    registry.register_class(UtilizationDetector)
