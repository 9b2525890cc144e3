"""predicted-ttft-scorer: prefer the endpoint with the lowest predicted time to first token.

Per endpoint e, from `PREFIX_TIER_MATCH` (tokens cached by tier, consecutive from the start)
and the endpoint's scraped metrics:

    T(e) = base
         + waiting(e) * queueSecondsPerWaitingRequest      (queue wait)
         + running(e) * secondsPerRunningRequest           (prefill shares the batch)
         + (total - gpu - cpu - disk)(e) * prefillSecondsPerToken   (recompute the uncached)
         + cpu(e) * cpuLoadSecondsPerToken                 (load offloaded blocks back)
         + disk(e) * diskLoadSecondsPerToken

    score(e) = min over endpoints of T / T(e)     in (0, 1]; the fastest scores 1.

The ratio keeps a 5 % slower endpoint at 0.95 instead of stretching small differences to 0..1
as min-max would; `base` (> 0) keeps it finite when nothing is queued or uncached. Without
tier data for a request (no producer, or an untokenizable prompt) only the load terms count.
The per-token costs are calibrations for the model and hardware (measure prefill throughput and
offload read bandwidth); the defaults only set a plausible order: GPU hit < CPU load < disk
load < recompute.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from epp.framework.datakeys import PREFIX_TIER_MATCH, TierMatch
from epp.framework.plugin import CycleState, PluginContext, Scorer, ScorerCategory
from epp.framework.registry import PluginParams, PluginRegistry
from epp.framework.types import Endpoint, InferenceRequest


class PredictedTTFTScorer(Scorer):
    """min(T) / T(e), T = queue wait + prefill of uncached tokens + load of CPU/disk tokens."""

    type_name = "predicted-ttft-scorer"
    category = ScorerCategory.AFFINITY

    def __init__(self, name: str, params: PluginParams, context: PluginContext) -> None:
        super().__init__(name)
        self.prefill_s_per_token = params.float("prefillSecondsPerToken", 2e-4, minimum=0.0)
        self.cpu_load_s_per_token = params.float("cpuLoadSecondsPerToken", 2e-5, minimum=0.0)
        self.disk_load_s_per_token = params.float("diskLoadSecondsPerToken", 1e-4, minimum=0.0)
        self.queue_s_per_waiting = params.float("queueSecondsPerWaitingRequest", 0.1, minimum=0.0)
        self.s_per_running = params.float("secondsPerRunningRequest", 0.005, minimum=0.0)
        self.base_s = params.float("baseSeconds", 0.01, minimum=1e-6)

    def consumes(self) -> frozenset[str]:
        return frozenset({PREFIX_TIER_MATCH})

    def predict(self, endpoint: Endpoint, match: TierMatch | None, total_tokens: int) -> float:
        """Predicted seconds to the first token of this request on `endpoint`."""
        m = endpoint.metrics
        t = (self.base_s + m.waiting_queue_size * self.queue_s_per_waiting
             + m.running_requests_size * self.s_per_running)
        if match is None:
            return t + total_tokens * self.prefill_s_per_token
        uncached = max(0, match.total_tokens - match.cached_tokens)
        return (t + uncached * self.prefill_s_per_token + match.cpu_tokens * self.cpu_load_s_per_token
                + match.disk_tokens * self.disk_load_s_per_token)

    def score(self, state: CycleState, request: InferenceRequest,
              endpoints: Sequence[Endpoint]) -> Mapping[str, float]:
        data = state.all_endpoint_data(PREFIX_TIER_MATCH)
        total = max((m.total_tokens for m in data.values()), default=0)
        predicted = {ep.name: self.predict(ep, data.get(ep.name), total) for ep in endpoints}
        if not predicted:
            return {}
        best = min(predicted.values())
        return {name: best / t for name, t in predicted.items()}


def register(registry: PluginRegistry) -> None:
    """Register `predicted-ttft-scorer`."""
    registry.register_class(PredictedTTFTScorer)
