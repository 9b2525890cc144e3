"""Load scorers over scraped metrics: queue depth, KV-cache use, running requests, llm-d load-aware."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from epp.framework.datakeys import INFLIGHT_LOAD, InflightLoad
from epp.framework.plugin import CycleState, PluginContext, Scorer, ScorerCategory
from epp.framework.registry import PluginParams
from epp.framework.types import Endpoint, InferenceRequest


def min_max_inverted(values: Sequence[float]) -> list[float]:
    """`(max - v) / (max - min)` per value; all 1.0 when every value is equal (GIE queue-scorer)."""
    if not values:
        return []
    low, high = min(values), max(values)
    if high == low:
        return [1.0] * len(values)
    span = high - low
    return [(high - v) / span for v in values]


class _MinMaxScorer(Scorer):
    category = ScorerCategory.DISTRIBUTION
    _metric: Callable[[Endpoint], float]

    def __init__(self, name: str, params: PluginParams, context: PluginContext) -> None:
        super().__init__(name)

    def score(self, state: CycleState, request: InferenceRequest,
              endpoints: Sequence[Endpoint]) -> Mapping[str, float]:
        scores = min_max_inverted([type(self)._metric(ep) for ep in endpoints])
        return {ep.name: s for ep, s in zip(endpoints, scores)}


class QueueScorer(_MinMaxScorer):
    """Shorter waiting queue scores higher: (maxQ - q) / (maxQ - minQ), all 1 when equal."""

    type_name = "queue-scorer"

    @staticmethod
    def _metric(ep: Endpoint) -> float:
        return ep.metrics.waiting_queue_size


class RunningRequestsSizeScorer(_MinMaxScorer):
    """Fewer running requests scores higher: min-max like queue-scorer, on running requests."""

    type_name = "running-requests-size-scorer"

    @staticmethod
    def _metric(ep: Endpoint) -> float:
        return ep.metrics.running_requests_size


class KVCacheUtilizationScorer(Scorer):
    """Free KV cache scores higher: 1 - kv_cache_usage."""

    type_name = "kv-cache-utilization-scorer"
    category = ScorerCategory.DISTRIBUTION

    def __init__(self, name: str, params: PluginParams, context: PluginContext) -> None:
        super().__init__(name)

    def score(self, state: CycleState, request: InferenceRequest,
              endpoints: Sequence[Endpoint]) -> Mapping[str, float]:
        return {ep.name: 1.0 - ep.metrics.kv_cache_usage for ep in endpoints}


class LoadAwareScorer(Scorer):
    """llm-d load-aware: empty queue 0.5, else 0.5 × (1 - min(q, threshold) / threshold)."""

    type_name = "load-aware-scorer"
    category = ScorerCategory.DISTRIBUTION

    def __init__(self, name: str, params: PluginParams, context: PluginContext) -> None:
        super().__init__(name)
        self.threshold = params.int("threshold", 128, minimum=1)

    def score(self, state: CycleState, request: InferenceRequest,
              endpoints: Sequence[Endpoint]) -> Mapping[str, float]:
        out: dict[str, float] = {}
        for ep in endpoints:
            q = ep.metrics.waiting_queue_size
            out[ep.name] = 0.5 if q <= 0 else 0.5 * (1.0 - min(q, self.threshold) / self.threshold)
        return out


class TokenLoadScorer(Scorer):
    """Fewer in-flight tokens scores higher: 1 - min(1, tokens / queueThresholdTokens)."""

    type_name = "token-load-scorer"
    category = ScorerCategory.DISTRIBUTION

    def __init__(self, name: str, params: PluginParams, context: PluginContext) -> None:
        super().__init__(name)
        self.threshold = params.int("queueThresholdTokens", 4194304, minimum=1)

    def consumes(self) -> frozenset[str]:
        return frozenset({INFLIGHT_LOAD})

    def score(self, state: CycleState, request: InferenceRequest,
              endpoints: Sequence[Endpoint]) -> Mapping[str, float]:
        out: dict[str, float] = {}
        for ep in endpoints:
            load: InflightLoad | None = state.endpoint_data(INFLIGHT_LOAD, ep.name)
            tokens = load.tokens if load else 0
            out[ep.name] = 1.0 - min(1.0, tokens / self.threshold)
        return out
