"""Predicted time per output token: learned from the picker's own streams, and `tpot-slo-filter`."""

from __future__ import annotations

import random
import time

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from epp.calibration_cli import format_tpot_table, read_tpot_calibration
from epp.framework import CycleState, PluginContext
from epp.framework.load import InflightLedger
from epp.framework.types import Endpoint, EndpointMetrics, InferenceRequest, ResponseInfo
from epp.scorers.predicted_tpot import TPOT_PRIOR, TPOT_TERMS, TPOTCalibrator, TPOTLearner, tpot_features
from tests.support.scheduling import make_plugin

ENDPOINTS = [f"10.0.0.{i}:8000" for i in range(1, 5)]


def decode_tpot(rng: random.Random, base: float, per_running: float, running: int) -> float:
    """A replica's time per output token: a step's fixed cost plus a share per running request, 10 % noise,
    and 5 % of streams stalled (a long prefill in the batch) at three times the time."""
    tpot = (base + per_running * running) * rng.lognormvariate(0.0, 0.1)
    return tpot * 3 if rng.random() < 0.05 else tpot


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_converges_to_each_endpoints_decode_speed_within_20_percent_after_200_streams(seed):
    rng = random.Random(seed)
    truth = {ep: (0.03 + 0.01 * i, 0.002) for i, ep in enumerate(ENDPOINTS)}  # the last replica is 2x slower
    calibrator = TPOTCalibrator(TPOT_PRIOR)
    for i in range(200):
        ep = ENDPOINTS[i % len(ENDPOINTS)]
        running = rng.randint(0, 24)
        calibrator.observe(ep, "m", tpot_features(running), decode_tpot(rng, *truth[ep], running))
    for ep, (base, per_running) in truth.items():
        learned_base, learned_per_running = calibrator.coefficients(ep, "m")
        for running in (1, 8, 24):
            assert learned_base + learned_per_running * running == pytest.approx(base + per_running * running, rel=0.2)


def test_before_any_stream_the_prior_is_used_and_a_wrong_prior_is_a_clear_error():
    assert TPOTCalibrator(TPOT_PRIOR).coefficients(ENDPOINTS[0], "m") == TPOT_PRIOR
    with pytest.raises(ValueError, match="2 terms"):
        TPOTCalibrator((0.01,))


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def stream(ledger: InflightLedger, clock: Clock, endpoint: str, *, running: int, tokens: int | None, tpot: float,
           first_token: bool = True) -> None:
    """One request through the ledger as the director books it: picked, first token, end of stream with usage."""
    booking = ledger.pick(endpoint, model="m", prompt_tokens=100, running=running, now=clock.now)
    clock.now += 0.05
    ledger.first_token(booking, observed=first_token, now=clock.now)
    clock.now += tpot * ((tokens or 1) - 1)
    usage = {"prompt_tokens": 100, "completion_tokens": tokens} if tokens is not None else None
    ledger.complete(booking, ResponseInfo(status="200", usage=usage, end_of_stream=True))


def test_learns_from_the_ledger_only_what_a_stream_shows():
    ledger, clock = InflightLedger(), Clock()
    learner = TPOTLearner(ledger, clock=clock)
    stream(ledger, clock, ENDPOINTS[0], running=4, tokens=1, tpot=0.05)  # one token: no time per token
    stream(ledger, clock, ENDPOINTS[0], running=4, tokens=None, tpot=0.05)  # no usage: token count unknown
    stream(ledger, clock, ENDPOINTS[0], running=4, tokens=50, tpot=0.05, first_token=False)  # not streamed
    assert learner.calibrator.fits() == []
    for _ in range(40):
        stream(ledger, clock, ENDPOINTS[0], running=4, tokens=50, tpot=0.05)
    [(endpoint, model, fit)] = learner.calibrator.fits()
    assert (endpoint, model, fit.observations) == (ENDPOINTS[0], "m", 40)
    assert fit.predict(tpot_features(4)) == pytest.approx(0.05, rel=0.05)


def endpoint(name: str, running: int) -> Endpoint:
    host, _, port = name.partition(":")
    return Endpoint(host, int(port), metrics=EndpointMetrics(running_requests_size=running,
                                                             update_time=time.monotonic()))


def request(tpot_ms: float | None) -> InferenceRequest:
    return InferenceRequest("r", "completions", "m", "m", {"prompt": "hi"}, slo_tpot_ms=tpot_ms)


@pytest.mark.parametrize("case, tpot_ms, running, kept", [
    ("no objective: every endpoint", None, (2, 30, 60), (0, 1, 2)),
    ("the endpoints predicted to meet it", 70.0, (2, 30, 60), (0, 1)),
    ("a tight objective: only the small decode batch", 40.0, (2, 30, 60), (0,)),
    ("none meets it: the nearest (within 10 %)", 5.0, (10, 11, 60), (0, 1)),
])
def test_tpot_slo_filter(case, tpot_ms, running, kept):
    context = PluginContext()
    tpot_filter = make_plugin("tpot-slo-filter", context=context)
    ledger, clock = context.load, Clock()
    # Learned: 20 ms a token plus 1 ms per running request, on every endpoint.
    for i in range(60):
        r = i % 40
        booking = ledger.pick(ENDPOINTS[i % 3], model="m", prompt_tokens=10, running=r, now=clock.now)
        ledger.first_token(booking, now=clock.now)
        clock.now += 9 * (0.02 + 0.001 * r)
        tpot_filter.learner.clock = clock
        ledger.complete(booking, ResponseInfo(status="200", usage={"completion_tokens": 10}, end_of_stream=True))
    endpoints = [endpoint(ep, n) for ep, n in zip(ENDPOINTS, running)]
    out = tpot_filter.filter(CycleState(), request(tpot_ms), endpoints)
    assert [endpoints.index(ep) for ep in out] == list(kept)


def test_the_learned_tpot_is_exported_and_shown_by_epp_calibration():
    registry = CollectorRegistry()
    context = PluginContext(metrics_registry=registry)
    scorer = make_plugin("predicted-ttft-scorer", context=context)  # calibrating: learns TPOT next to TTFT
    ledger, clock = context.load, Clock()
    from epp.scorers.predicted_tpot import tpot_learner

    tpot_learner(context).clock = clock
    for _ in range(30):
        stream(ledger, clock, ENDPOINTS[0], running=0, tokens=20, tpot=0.025)
    rows = read_tpot_calibration(generate_latest(registry).decode())
    assert set(rows) == {(ENDPOINTS[0], "m")}
    values = rows[(ENDPOINTS[0], "m")]
    assert values[TPOT_TERMS[0]] == pytest.approx(0.025, rel=0.1) and values["observations"] == 30
    table = format_tpot_table(rows)
    assert "TPOT base ms/token" in table and ENDPOINTS[0] in table
    assert scorer is not None
