"""predicted-ttft-scorer: prefer the endpoint with the lowest predicted time to first token.

Per endpoint e, from `PREFIX_TIER_MATCH` (tokens cached by tier, consecutive from the start),
the picker's own in-flight work on e (`PluginContext.load`: prefill tokens it sent there whose
first token has not come back) and e's scraped metrics:

    T(e) = base
         + queuedPrefill(e) * ahead(e)                  (prefill queued ahead, in tokens)
         + prefill(e) * uncached(e)                     (our own prefill)
         + queueCost(e) * waiting(e)                    (requests queued ahead, e.g. for KV space)
         + runningCost(e) * running(e)                  (decoding requests share each step)
         + cpuLoad(e) * cpu(e) + diskLoad(e) * disk(e)  (load offloaded blocks back)

    ahead(e) = prefill tokens in flight on e (first token not seen yet) still to do now, as the
               ledger's backlog model estimates it (`epp.framework.load`)
    waiting(e) = e's scraped waiting queue (requests the engine holds back, e.g. for KV space; the
                 picker's own unseen and prefilling requests are already in ahead(e))

    score(e) = min over endpoints of T / T(e)     in (0, 1]; the fastest scores 1.

**Self-calibration** (default): the coefficients are learned per endpoint and model from the
picker's own requests (dispatch to first streamed token, see `ttft_calibration.py`), starting
from sane defaults (`prefill 2e-4 s/token`, ...) before the first observation. `queuedPrefill`
is learned apart from `prefill` (tokens in flight ahead are partly prefilled already when a
request arrives); before any observation it is `prefill`. They are exported
as `epp_ttft_calibration{plugin,endpoint,model,term}` and shown by `epp calibration`.

**Configured constants** (`prefillSecondsPerToken`, `queueSecondsPerWaitingRequest`,
`secondsPerRunningRequest`, `cpuLoadSecondsPerToken`, `diskLoadSecondsPerToken`, `baseSeconds`)
override learning: when any is given, `calibrate` defaults to false and the fixed formula is

    T(e) = base + max(waiting * queueSecondsPerWaitingRequest + running * secondsPerRunningRequest,
                      ahead(e) * prefillSecondsPerToken)
         + uncached * prefillSecondsPerToken + cpu * cpuLoad + disk * diskLoad

(the max, not the sum, because once scraped the same work shows in both; `trackPendingPrefill:
false` drops the in-flight term). With `calibrate: true` the given constants are the prior.

**Stickiness that pays** (`stickiness`, default 0 = off): an endpoint that holds fewer of the
request's prompt tokens than the best-matching endpoint is charged `stickiness` times the
prefill of the tokens it would throw away (`prefill(e) * (cached(best) - cached(e))`, in the
same seconds as T). At 1, a conversation's later turn moves from the replica holding its
history only when the predicted TTFT gain exceeds the recompute cost of the move: the request's
own T already pays its longer prefill, the charge adds the fleet's cost of doing that work again.

**Predictions for flow control** (`predict_latency`): the request's own prefill on its cheapest
endpoint (base, uncached tokens, tier loads; no queue ahead) and the best T over the endpoints,
which `slo-deadline-ordering-policy` orders and sheds by. With calibration the scorer also makes
the picker learn TPOT (`predicted_tpot.py`), so `epp calibration` shows it.

The ratio keeps a 5 % slower endpoint at 0.95 instead of stretching small differences to 0..1
as min-max would; `base` (> 0) keeps it finite. Without tier data for a request (no producer,
or an untokenizable prompt) every endpoint is charged the whole prompt as uncached.
"""

from __future__ import annotations

import math
import time
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from epp.framework import (
    PREFIX_TIER_MATCH,
    Booking,
    CycleState,
    Endpoint,
    InferenceRequest,
    InflightLedger,
    PluginContext,
    PluginParams,
    PluginRegistry,
    ResponseInfo,
    Scorer,
    TierMatch,
    estimate_prompt_tokens,
    once_per_registry,
)
from epp.scorers.predicted_tpot import TPOTObjectiveFilter, tpot_learner
from epp.scorers.ttft_calibration import TERMS, TTFTCalibrator, features

DEFAULTS = {"baseSeconds": 0.01, "prefillSecondsPerToken": 2e-4, "secondsPerRunningRequest": 0.005,
            "cpuLoadSecondsPerToken": 2e-5, "diskLoadSecondsPerToken": 1e-4, "queueSecondsPerWaitingRequest": 0.1}
# Fits `debug_state` lists (the calibrator keeps up to 1,024; the metrics page has them all).
DEBUG_FITS = 32
# Parameter names in TERMS order.
TERM_PARAMS = ("baseSeconds", "prefillSecondsPerToken", "secondsPerRunningRequest",
               "cpuLoadSecondsPerToken", "diskLoadSecondsPerToken", "queueSecondsPerWaitingRequest")


class PredictedTTFTScorer(Scorer):
    """min(T) / T(e), T = queue + prefill of uncached tokens + running share + CPU/disk loads; self-calibrating."""

    type_name = "predicted-ttft-scorer"

    def __init__(self, name: str, params: PluginParams, context: PluginContext) -> None:
        super().__init__(name)
        given = {key: params.float(key, math.nan, minimum=0.0)  # NaN: not configured
                 for key in TERM_PARAMS}
        given = {k: v for k, v in given.items() if not math.isnan(v)}
        values = {**DEFAULTS, **given}
        if values["baseSeconds"] <= 0:
            values["baseSeconds"] = 1e-6  # keeps T > 0
        self.base_s = values["baseSeconds"]
        self.prefill_s_per_token = values["prefillSecondsPerToken"]
        self.s_per_running = values["secondsPerRunningRequest"]
        self.cpu_load_s_per_token = values["cpuLoadSecondsPerToken"]
        self.disk_load_s_per_token = values["diskLoadSecondsPerToken"]
        self.queue_s_per_waiting = values["queueSecondsPerWaitingRequest"]
        self.track_pending = params.bool("trackPendingPrefill", True)
        self.stickiness = params.float("stickiness", 0.0, minimum=0.0)
        self.calibrate = params.bool("calibrate", not given)
        self.ledger: InflightLedger = context.load
        self.calibrator = TTFTCalibrator(tuple(values[k] for k in TERM_PARAMS),
                                         decay=params.float("calibrationDecay", 0.95, minimum=0.5, maximum=0.9999))
        if self.calibrate:
            self.ledger.add_observer(self._observe)
            _collector(context.metrics_registry).scorers.add(self)
            tpot_learner(context)  # TPOT is learned next to TTFT (epp calibration shows both)

    def describe(self) -> str:
        return (f"calibrate={str(self.calibrate).lower()} trackPendingPrefill={str(self.track_pending).lower()} "
                f"stickiness={self.stickiness:g}")

    def consumes(self) -> frozenset[str]:
        return frozenset({PREFIX_TIER_MATCH})

    def debug_state(self) -> Mapping[str, Any]:
        """The learned fits, most recently updated first (at most `DEBUG_FITS`)."""
        fits = self.calibrator.fits()
        return {"calibrate": self.calibrate, "fits": len(fits), "evicted": self.calibrator.evicted,
                "recent": [{"endpoint": ep, "model": model, "observations": fit.observations,
                            "residual_s": fit.residual_scale_s, "resets": fit.resets,
                            "coefficients": dict(zip(TERMS, fit.coefficients()))}
                           for ep, model, fit in reversed(fits[-DEBUG_FITS:])]}

    # -- prediction ---------------------------------------------------------------------------

    def _split(self, endpoint: Endpoint, match: TierMatch | None, total_tokens: int, model: str,
               now: float | None) -> tuple[float, float, float]:
        """(seconds of work ahead, the request's own seconds, prefill seconds per token) on `endpoint`."""
        if match is None:
            uncached, cpu, disk = total_tokens, 0, 0
        else:
            uncached = max(0, match.total_tokens - match.cached_tokens)
            cpu, disk = match.cpu_tokens, match.disk_tokens
        load = self.ledger.load(endpoint, now)
        m = endpoint.metrics
        own_ahead = load.prefill_backlog_tokens if self.track_pending else 0.0
        if not self.calibrate:
            scraped = m.waiting_queue_size * self.queue_s_per_waiting + m.running_requests_size * self.s_per_running
            queue = max(scraped, own_ahead * self.prefill_s_per_token)
            own = (self.base_s + uncached * self.prefill_s_per_token + cpu * self.cpu_load_s_per_token
                   + disk * self.disk_load_s_per_token)
            return queue, own, self.prefill_s_per_token
        base, prefill, running_cost, cpu_cost, disk_cost, queue_cost, queued_prefill = self.calibrator.coefficients(
            endpoint.name, model, now)
        ahead = queued_prefill * own_ahead + queue_cost * m.waiting_queue_size + running_cost * m.running_requests_size
        return ahead, max(base, 1e-6) + prefill * uncached + cpu_cost * cpu + disk_cost * disk, prefill

    def predict(self, endpoint: Endpoint, match: TierMatch | None, total_tokens: int, model: str = "",
                now: float | None = None) -> float:
        """Predicted seconds to the first token of this request on `endpoint`."""
        ahead, own, _ = self._split(endpoint, match, total_tokens, model, now)
        return ahead + own

    def predict_latency(self, state: CycleState, request: InferenceRequest,
                        endpoints: Sequence[Endpoint]) -> tuple[float, float]:
        """(the request's own prefill on its cheapest endpoint, the best predicted TTFT now), seconds, for flow control."""
        data = state.all_endpoint_data(PREFIX_TIER_MATCH)
        total = max((m.total_tokens for m in data.values()), default=0) if data else estimate_prompt_tokens(request)
        now = time.monotonic()
        splits = [self._split(ep, data.get(ep.name), total, request.target_model, now) for ep in endpoints]
        return min(own for _, own, _ in splits), min(ahead + own for ahead, own, _ in splits)

    def score(self, state: CycleState, request: InferenceRequest,
              endpoints: Sequence[Endpoint]) -> Mapping[str, float]:
        data = state.all_endpoint_data(PREFIX_TIER_MATCH)
        total = max((m.total_tokens for m in data.values()), default=0)
        if not data:
            total = estimate_prompt_tokens(request)
        now = time.monotonic()
        model = request.target_model
        best_cached = max((m.cached_tokens for m in data.values()), default=0) if self.stickiness else 0
        predicted = {}
        for ep in endpoints:
            match = data.get(ep.name)
            ahead, own, prefill = self._split(ep, match, total, model, now)
            # The recompute cost of leaving the endpoint that holds the most of this prompt (0 there).
            thrown_away = best_cached - (match.cached_tokens if match is not None else 0)
            predicted[ep.name] = ahead + own + self.stickiness * prefill * max(0, thrown_away)
        if not predicted:
            return {}
        best = min(predicted.values())
        return {name: best / t for name, t in predicted.items()}

    # -- learning -----------------------------------------------------------------------------

    def _observe(self, booking: Booking, response: Any) -> None:
        """Learn from a completed request whose first streamed token was timed."""
        if not booking.ttft_observed or booking.first_token_at is None:
            return
        uncached = booking.uncached_tokens
        usage = getattr(response, "usage", None) if isinstance(response, ResponseInfo) else None
        if usage and not booking.cpu_tokens and not booking.disk_tokens:
            prompt = usage.get("prompt_tokens")
            details = usage.get("prompt_tokens_details")
            cached = details.get("cached_tokens") if isinstance(details, dict) else None
            if isinstance(prompt, int) and isinstance(cached, int) and 0 <= cached <= prompt:
                uncached = prompt - cached  # what the server really computed
        x = features(uncached, booking.running, booking.cpu_tokens, booking.disk_tokens, booking.waiting,
                     ahead=booking.ahead_tokens)
        self.calibrator.observe(booking.endpoint, booking.model, x, booking.first_token_at - booking.picked_at,
                                now=booking.first_token_at)


class _CalibrationCollector(Collector):
    """`epp_ttft_calibration*` series of every calibrating scorer on one registry."""

    def __init__(self) -> None:
        self.scorers: weakref.WeakSet[PredictedTTFTScorer] = weakref.WeakSet()

    def collect(self) -> Iterator[GaugeMetricFamily]:
        coef = GaugeMetricFamily("epp_ttft_calibration",
                                 "Learned predicted-TTFT coefficient per endpoint and model (seconds, per token "
                                 "or per request, by term).", labels=["plugin", "endpoint", "model", "term"])
        count = GaugeMetricFamily("epp_ttft_calibration_observations",
                                  "Requests the predicted-TTFT calibration learned from.",
                                  labels=["plugin", "endpoint", "model"])
        scale = GaugeMetricFamily("epp_ttft_calibration_residual_seconds",
                                  "Typical absolute error of the calibrated TTFT prediction (running mean).",
                                  labels=["plugin", "endpoint", "model"])
        resets = GaugeMetricFamily("epp_ttft_calibration_resets",
                                   "Step changes the calibration detected (old observations forgotten).",
                                   labels=["plugin", "endpoint", "model"])
        for scorer in list(self.scorers):
            for endpoint, model, fit in scorer.calibrator.fits():
                labels = [scorer.name, endpoint, model]
                for term, value in zip(TERMS, fit.coefficients()):
                    coef.add_metric([*labels, term], value)
                count.add_metric(labels, fit.observations)
                scale.add_metric(labels, fit.residual_scale_s)
                resets.add_metric(labels, fit.resets)
        yield from (coef, count, scale, resets)


def _new_collector(registry: CollectorRegistry | None) -> _CalibrationCollector:
    collector = _CalibrationCollector()
    if registry is not None:
        registry.register(collector)
    return collector


def _collector(registry: CollectorRegistry | None) -> _CalibrationCollector:
    """The calibration collector of `registry` (none: a private one, exported nowhere)."""
    return once_per_registry(registry, "epp_predicted_ttft_calibration", _new_collector)


def register(registry: PluginRegistry) -> None:
    """Register `predicted-ttft-scorer` and `tpot-slo-filter` (its TPOT counterpart)."""
    registry.register_class(PredictedTTFTScorer)
    registry.register_class(TPOTObjectiveFilter)
