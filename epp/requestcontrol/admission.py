"""GIE's default admission as an `Admitter`: shed sheddable requests while the pool is saturated.

The loader adds it to every pipeline with a saturation detector, unless the `flowControl`
feature gate is on: then the flow controller queues requests instead (as in GIE).
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge

from epp.framework import (
    Admitter,
    CycleState,
    DropReason,
    Endpoint,
    ErrorCode,
    InferenceError,
    InferenceRequest,
    PluginContext,
    SaturationDetector,
    once_per_registry,
)

SHED_MESSAGE = "system saturated, sheddable request dropped"
TYPE_NAME = "saturation-admitter"


def is_sheddable(priority: int) -> bool:
    """GIE: a request whose objective has a negative priority may be dropped under saturation."""
    return priority < 0


def _shed_counter(registry: CollectorRegistry | None) -> Counter:
    return Counter("epp_admission_shed_requests", "Sheddable requests dropped because the pool was saturated.",
                   registry=registry)


def _saturation_gauge(registry: CollectorRegistry | None) -> Gauge:
    return Gauge("epp_pool_saturation", "Pool saturation from the saturation detector (>= 1 is saturated).",
                 registry=registry)


class SaturationAdmitter(Admitter):
    """Admits every request except sheddable ones (priority < 0) while saturation >= 1.0 (429).

    Non-sheddable requests never pay for the saturation computation. With the pool's endpoints
    in the context, the pool-saturation gauge is computed when the metrics are collected;
    otherwise it shows the value seen by the last sheddable request.
    """

    type_name = TYPE_NAME

    def __init__(self, name: str | None, detector: SaturationDetector, context: PluginContext) -> None:
        super().__init__(name)
        self.detector = detector
        registry = context.metrics_registry
        self.shed_requests = once_per_registry(registry, "epp_admission_shed_requests", _shed_counter)
        self.saturation_gauge = once_per_registry(registry, "epp_pool_saturation", _saturation_gauge)
        pool = context.endpoints
        if pool is not None:
            self.saturation_gauge.set_function(lambda: detector.saturation(pool.snapshot()))
        self._gauge_from_pool = pool is not None

    def admit(self, state: CycleState, request: InferenceRequest, endpoints: Sequence[Endpoint]) -> None:
        """Return if admitted; raise InferenceError(RESOURCE_EXHAUSTED) to shed the request."""
        if not is_sheddable(request.priority):
            return
        saturation = self.detector.saturation(endpoints)
        if not self._gauge_from_pool:
            self.saturation_gauge.set(saturation)
        if saturation >= 1.0:
            self.shed_requests.inc()
            raise InferenceError(ErrorCode.RESOURCE_EXHAUSTED, SHED_MESSAGE, drop_reason=DropReason.SATURATED)
