"""Legacy (GIE default) admission: shed sheddable requests while the pool is saturated."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge

from epp.framework.errors import ErrorCode, InferenceError
from epp.framework.types import Endpoint, InferenceRequest

SHED_MESSAGE = "system saturated, sheddable request dropped"


class SaturationDetector(Protocol):
    """Anything that rates a set of endpoints: >= 1.0 means saturated (e.g. `utilization-detector`)."""

    def saturation(self, endpoints: Sequence[Endpoint]) -> float: ...


class EndpointSource(Protocol):
    """Where the pool's endpoints come from (the `EndpointRegistry`)."""

    def snapshot(self) -> Sequence[Endpoint]: ...


def is_sheddable(priority: int) -> bool:
    """GIE: a request whose objective has a negative priority may be dropped under saturation."""
    return priority < 0


class AdmissionController:
    """Admits every request except sheddable ones (priority < 0) while saturation >= 1.0 (429).

    Non-sheddable requests never pay for the saturation computation. With `pool` given, the
    pool-saturation gauge is computed when our metrics are collected; otherwise it shows the
    value seen by the last sheddable request.
    """

    def __init__(self, detector: SaturationDetector, *,
                 metrics_registry: CollectorRegistry | None = None,
                 pool: EndpointSource | None = None) -> None:
        self.detector = detector
        registry = metrics_registry if metrics_registry is not None else CollectorRegistry()
        self.saturation_gauge = Gauge(
            "epp_pool_saturation", "Pool saturation from the saturation detector (>= 1 is saturated).",
            registry=registry)
        self.shed_requests = Counter(
            "epp_admission_shed_requests", "Sheddable requests dropped because the pool was saturated.",
            registry=registry)
        if pool is not None:
            self.saturation_gauge.set_function(lambda: detector.saturation(pool.snapshot()))
        self._gauge_from_pool = pool is not None

    def admit(self, request: InferenceRequest, candidates: Sequence[Endpoint]) -> None:
        """Return if admitted; raise InferenceError(RESOURCE_EXHAUSTED) to shed the request."""
        if not is_sheddable(request.priority):
            return
        saturation = self.detector.saturation(candidates)
        if not self._gauge_from_pool:
            self.saturation_gauge.set(saturation)
        if saturation >= 1.0:
            self.shed_requests.inc()
            raise InferenceError(ErrorCode.RESOURCE_EXHAUSTED, SHED_MESSAGE)
