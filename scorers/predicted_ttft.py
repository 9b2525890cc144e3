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

The queue term also knows the picker's own recent work: scraped queue depth is up to one scrape
interval old, so a burst of requests all see the same "least loaded" endpoint and queue behind
each other's prefill. After each pick the scorer books the request's predicted prefill on the
chosen endpoint (`busy_until = max(now, busy_until) + prefill`), and the queue term becomes
`max(scraped queue terms, busy_until - now)`: the max, not the sum, because once scraped the
same work shows in both (`trackPendingPrefill: false` turns this off).

The ratio keeps a 5 % slower endpoint at 0.95 instead of stretching small differences to 0..1
as min-max would; `base` (> 0) keeps it finite when nothing is queued or uncached. Without
tier data for a request (no producer, or an untokenizable prompt) only the load terms count.
The per-token costs are calibrations for the model and hardware (measure prefill throughput and
offload read bandwidth); the defaults only set a plausible order: GPU hit < CPU load < disk
load < recompute.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

from epp.framework.datakeys import PREFIX_TIER_MATCH, TierMatch
from epp.framework.plugin import CycleState, PluginContext, PreRequestHook, SchedulingResult, Scorer, ScorerCategory
from epp.framework.registry import PluginParams, PluginRegistry
from epp.framework.types import Endpoint, InferenceRequest


class PredictedTTFTScorer(Scorer, PreRequestHook):
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
        self.track_pending = params.bool("trackPendingPrefill", True)
        # Per endpoint: when the prefills this picker sent there should be done (time.monotonic()).
        # One entry per endpoint picked; entries in the past are dropped as they are met.
        self._busy_until: dict[str, float] = {}

    def consumes(self) -> frozenset[str]:
        return frozenset({PREFIX_TIER_MATCH})

    def own_work(self, match: TierMatch | None, total_tokens: int) -> float:
        """Seconds of prefill (and tier loads) this request itself needs on an endpoint."""
        if match is None:
            return total_tokens * self.prefill_s_per_token
        uncached = max(0, match.total_tokens - match.cached_tokens)
        return (uncached * self.prefill_s_per_token + match.cpu_tokens * self.cpu_load_s_per_token
                + match.disk_tokens * self.disk_load_s_per_token)

    def queue_wait(self, endpoint: Endpoint, now: float | None = None) -> float:
        """Seconds this request would wait before its own prefill starts on `endpoint`."""
        m = endpoint.metrics
        scraped = m.waiting_queue_size * self.queue_s_per_waiting + m.running_requests_size * self.s_per_running
        if not self.track_pending:
            return scraped
        pending = self._busy_until.get(endpoint.name, 0.0) - (time.monotonic() if now is None else now)
        return max(scraped, pending)

    def predict(self, endpoint: Endpoint, match: TierMatch | None, total_tokens: int,
                now: float | None = None) -> float:
        """Predicted seconds to the first token of this request on `endpoint`."""
        return self.base_s + self.queue_wait(endpoint, now) + self.own_work(match, total_tokens)

    def score(self, state: CycleState, request: InferenceRequest,
              endpoints: Sequence[Endpoint]) -> Mapping[str, float]:
        data = state.all_endpoint_data(PREFIX_TIER_MATCH)
        total = max((m.total_tokens for m in data.values()), default=0)
        now = time.monotonic()
        predicted = {ep.name: self.predict(ep, data.get(ep.name), total, now) for ep in endpoints}
        if not predicted:
            return {}
        best = min(predicted.values())
        return {name: best / t for name, t in predicted.items()}

    def pre_request(self, state: CycleState, request: InferenceRequest, result: SchedulingResult) -> None:
        """Book the picked request's prefill on its endpoint, until the next scrape can show it."""
        if not self.track_pending or not result.targets:
            return
        target = result.targets[0].name
        data = state.all_endpoint_data(PREFIX_TIER_MATCH)
        total = max((m.total_tokens for m in data.values()), default=0)
        now = time.monotonic()
        busy = self._busy_until
        busy[target] = max(now, busy.get(target, 0.0)) + self.own_work(data.get(target), total)
        if len(busy) > 64:  # drop finished bookings (endpoints that left, or are idle)
            for name in [n for n, until in busy.items() if until <= now]:
                del busy[name]


def register(registry: PluginRegistry) -> None:
    """Register `predicted-ttft-scorer`."""
    registry.register_class(PredictedTTFTScorer)
