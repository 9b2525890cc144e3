"""Predicted time per output token (TPOT), learned online per endpoint and model, and `tpot-slo-filter`.

Model (seconds per output token after the first, as the client sees the stream):

    tpot = base + per_running * running

`running`: the endpoint's running requests when the request was picked (its decode batch: every
running request shares each decode step). Learned from the picker's own streamed responses,
like the TTFT calibration (`ttft_calibration.py`: the same forgetting, Huber-weighted ridge fit,
per endpoint towards its model's pooled fit): the ledger reports each request's first token
and, when the stream ends, the response's `usage.completion_tokens`, so

    observed tpot = (end of stream - first token) / (completion tokens - 1)

(requests with fewer than 2 output tokens, or without a timed first token or usage, teach
nothing). Predicted with the endpoint's running requests now (scraped plus the picker's own
picks the scrape cannot show yet).

One learner per picker (per in-flight ledger), shared by every plugin that asks for it
(`predicted-ttft-scorer` with calibration, `tpot-slo-filter`); exported as
`epp_tpot_calibration{endpoint,model,term}` and shown by `epp calibration`.

`tpot-slo-filter`: a request with a TPOT objective (`x-llm-d-slo-tpot-ms`) keeps only the
endpoints predicted to meet it, so a latency-sensitive request does not land on a replica with a
large decode batch; when none is predicted to meet it, the endpoints within `tolerance` of the
lowest prediction. Requests without a TPOT objective pass untouched.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from epp.framework import (
    Booking,
    CycleState,
    Endpoint,
    Filter,
    InferenceRequest,
    InflightLedger,
    PluginContext,
    PluginParams,
    ResponseInfo,
    once_per_registry,
)
from epp.scorers.ttft_calibration import RobustLinearFit, TTFTCalibrator

TPOT_TERMS = ("base_seconds_per_token", "seconds_per_token_per_running_request")
TPOT_SCALE = (1.0, 0.1)  # feature scales (tens of running requests), so one prior weight suits both terms
# Before any observation: 20 ms a token plus 0.5 ms per running request (an 8B model on one GPU is faster;
# a slow guess keeps the filter from trusting an unmeasured replica with a TPOT objective).
TPOT_PRIOR = (0.02, 5e-4)


def tpot_features(running: float) -> tuple[float, float]:
    """The feature vector of the TPOT model (unscaled, TPOT_TERMS order)."""
    return (1.0, float(running))


def _equal_weight(_x: Sequence[float]) -> float:
    return 1.0


class TPOTCalibrator(TTFTCalibrator):
    """Per (endpoint, model) TPOT fits, each regularised towards its model's pooled fit."""

    # An endpoint's decode speed is its own (another GPU, another load): both terms follow it.
    endpoint_prior_weights = (0.5, 0.5)

    def _full_prior(self, prior: Sequence[float]) -> tuple[float, ...]:
        if len(prior) != len(TPOT_TERMS):
            raise ValueError(f"a TPOT prior has {len(TPOT_TERMS)} terms ({', '.join(TPOT_TERMS)}), got {len(prior)}")
        return tuple(prior)

    def _new_fit(self, prior: Sequence[float], weights: float | Sequence[float] | None = None) -> RobustLinearFit:
        return RobustLinearFit(prior, prior_weight=self.prior_weight if weights is None else weights,
                               decay=self.decay, initial_scale_s=0.005, scale=TPOT_SCALE, weight_of=_equal_weight)


class TPOTLearner:
    """Learns TPOT from the ledger's completed bookings and predicts it for an endpoint now."""

    def __init__(self, ledger: InflightLedger, *, prior: Sequence[float] = TPOT_PRIOR,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._ledger = weakref.ref(ledger)  # weak: the ledger keys the learners' registry and holds this learner
        self.calibrator = TPOTCalibrator(prior)
        self.clock = clock
        ledger.add_observer(self.observe)

    def observe(self, booking: Booking, response: Any) -> None:
        """Learn from one completed request (called by the ledger when its stream ends)."""
        if not booking.ttft_observed or booking.first_token_at is None or not isinstance(response, ResponseInfo):
            return
        tokens = (response.usage or {}).get("completion_tokens")
        if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 2:
            return
        now = self.clock()
        tpot = (now - booking.first_token_at) / (tokens - 1)
        self.calibrator.observe(booking.endpoint, booking.model, tpot_features(booking.running), tpot, now=now)

    def predict(self, endpoint: Endpoint, model: str, now: float | None = None) -> float:
        """Predicted seconds per output token of a request sent to `endpoint` now."""
        ledger = self._ledger()
        load = ledger.load(endpoint, now) if ledger is not None else None
        running = load.running_estimate(endpoint.metrics) if load is not None else endpoint.metrics.running_requests_size
        base, per_running = self.calibrator.coefficients(endpoint.name, model, now)
        return base + per_running * running


_learners: weakref.WeakKeyDictionary[InflightLedger, TPOTLearner] = weakref.WeakKeyDictionary()


def tpot_learner(context: PluginContext) -> TPOTLearner:
    """The picker's one TPOT learner (on `context.load`), exported on `context.metrics_registry`."""
    learner = _learners.get(context.load)
    if learner is None:
        learner = _learners[context.load] = TPOTLearner(context.load)
    _collector(context.metrics_registry).learners.add(learner)
    return learner


class TPOTObjectiveFilter(Filter):
    """Keeps the endpoints predicted to meet the request's TPOT objective (else the nearest to it)."""

    type_name = "tpot-slo-filter"

    def __init__(self, name: str, params: PluginParams, context: PluginContext) -> None:
        super().__init__(name)
        self.tolerance = params.float("tolerance", 0.1, minimum=0.0)
        self.learner = tpot_learner(context)

    def describe(self) -> str:
        return f"tolerance={self.tolerance:g}"

    def filter(self, state: CycleState, request: InferenceRequest, endpoints: Sequence[Endpoint]) -> list[Endpoint]:
        if request.slo_tpot_ms is None or len(endpoints) < 2:
            return list(endpoints)
        objective = request.slo_tpot_ms / 1000.0
        now = time.monotonic()
        predicted = [(self.learner.predict(ep, request.target_model, now), ep) for ep in endpoints]
        meeting = [ep for tpot, ep in predicted if tpot <= objective]
        if meeting:
            return meeting
        best = min(tpot for tpot, _ in predicted)
        return [ep for tpot, ep in predicted if tpot <= best * (1.0 + self.tolerance)]


class _TPOTCollector(Collector):
    """`epp_tpot_calibration*` series of the picker's TPOT learner(s) on one registry."""

    def __init__(self) -> None:
        self.learners: weakref.WeakSet[TPOTLearner] = weakref.WeakSet()

    def collect(self) -> Iterator[GaugeMetricFamily]:
        coef = GaugeMetricFamily("epp_tpot_calibration",
                                 "Learned predicted-TPOT coefficient per endpoint and model (seconds per output "
                                 "token, and per running request, by term).", labels=["endpoint", "model", "term"])
        count = GaugeMetricFamily("epp_tpot_calibration_observations",
                                  "Streamed requests the predicted-TPOT calibration learned from.",
                                  labels=["endpoint", "model"])
        scale = GaugeMetricFamily("epp_tpot_calibration_residual_seconds",
                                  "Typical absolute error of the calibrated TPOT prediction (running mean).",
                                  labels=["endpoint", "model"])
        for learner in list(self.learners):
            for endpoint, model, fit in learner.calibrator.fits():
                for term, value in zip(TPOT_TERMS, fit.coefficients()):
                    coef.add_metric([endpoint, model, term], value)
                count.add_metric([endpoint, model], fit.observations)
                scale.add_metric([endpoint, model], fit.residual_scale_s)
        yield from (coef, count, scale)


def _new_collector(registry: CollectorRegistry | None) -> _TPOTCollector:
    collector = _TPOTCollector()
    if registry is not None:
        registry.register(collector)
    return collector


def _collector(registry: CollectorRegistry | None) -> _TPOTCollector:
    return once_per_registry(registry, "epp_tpot_calibration", _new_collector)
