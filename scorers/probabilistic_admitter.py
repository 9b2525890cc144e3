"""`probabilistic-admitter` (llm-d): sheds sheddable requests with a probability that rises with saturation.

Requests of priority >= 0 are always admitted. A sheddable one (priority < 0) is refused (429,
`rejected-saturated`) with probability `p = min(saturation ** power * k, 1)`, where saturation is the
mean over the candidates of `max(waiting / queueDepthThreshold, kvCacheUsage / kvCacheUtilThreshold)`
(an endpoint without fresh metrics counts 1.0, as utilization-detector rates it). With the defaults
(`power` 5, `k` 300) nothing is shed below about 0.15 and everything from about 0.34: a gradual
ramp instead of the saturation admitter's all-or-nothing cut at 1.0. No candidates: admitted.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter

from epp.framework import (
    Admitter,
    ConfigError,
    CycleState,
    DropReason,
    Endpoint,
    ErrorCode,
    InferenceError,
    InferenceRequest,
    PluginContext,
    PluginParams,
    PluginRegistry,
    once_per_registry,
)
from epp.scorers.saturation import UtilizationDetector

SHED_MESSAGE = "request shed: the pool is near saturation (probabilistic admission of sheddable requests)"


def _counter(registry: CollectorRegistry | None) -> Counter:
    return Counter("epp_probabilistic_admission_shed", "Sheddable requests the probabilistic admitter refused",
                   registry=registry)


class ProbabilisticAdmitter(Admitter):
    """Refuses a sheddable request with probability min(saturation^power x k, 1)."""

    type_name = "probabilistic-admitter"

    def __init__(self, name: str, params: PluginParams, context: PluginContext) -> None:
        super().__init__(name)
        self.power = params.float("power", 5.0)
        self.k = params.float("k", 300.0)
        where = f"plugin {name!r}: parameter"
        if self.power <= 0:
            raise ConfigError(f"{where} 'power' must be > 0, got {self.power:g}")
        if self.k <= 0:
            raise ConfigError(f"{where} 'k' must be > 0, got {self.k:g}")
        self.detector = UtilizationDetector(f"{name}-saturation",
                                            queue_depth_threshold=params.float("queueDepthThreshold", 5.0),
                                            kv_cache_util_threshold=params.float("kvCacheUtilThreshold", 0.8))
        self.shed = once_per_registry(context.metrics_registry, "epp_probabilistic_admission", _counter)
        self._random = random.Random()

    def describe(self) -> str:
        return (f"queueDepthThreshold={self.detector.queue_depth_threshold:g} "
                f"kvCacheUtilThreshold={self.detector.kv_cache_util_threshold:g} power={self.power:g} k={self.k:g}")

    def probability(self, saturation: float) -> float:
        """The chance a sheddable request is refused at `saturation`."""
        return min(max(saturation, 0.0) ** self.power * self.k, 1.0)

    def admit(self, state: CycleState, request: InferenceRequest, endpoints: Sequence[Endpoint]) -> None:
        if request.priority >= 0 or not endpoints:
            return
        if self._random.random() < self.probability(self.detector.saturation(endpoints)):
            self.shed.inc()
            raise InferenceError(ErrorCode.RESOURCE_EXHAUSTED, SHED_MESSAGE, drop_reason=DropReason.SATURATED)


def register(registry: PluginRegistry) -> None:
    """Entry point of the `epp.plugins` group: registers the probabilistic admitter."""
    registry.register_class(ProbabilisticAdmitter)
