"""Gaps within the prediction's typical error: predicted-ttft-scorer scores endpoints alike when their learned
predictions differ by less than what the fits typically miss by, so calibration noise does not pick the replica."""

from __future__ import annotations

import random
import time

from epp.framework import CycleState, PluginContext
from epp.framework.datakeys import PREFIX_TIER_MATCH, TierMatch
from epp.framework.types import Endpoint, EndpointMetrics, InferenceRequest
from epp.scorers.ttft_calibration import features
from tests.support.requests import format_of
from tests.support.scheduling import make_plugin

A, B = "10.0.0.1:8000", "10.0.0.2:8000"
PROMPT = 600


def learned_scorer(params: dict, base_s: dict[str, float], jitter_s: float) -> object:
    """A calibrating scorer that has learned, per endpoint, TTFT = base + 3e-4 s/token +- `jitter_s` (seeded)."""
    scorer = make_plugin("predicted-ttft-scorer", params, context=PluginContext())
    rng = random.Random(7)
    for endpoint, base in base_s.items():
        for _ in range(300):
            uncached = rng.randint(50, 1000)
            ttft = base + 3e-4 * uncached + rng.uniform(-jitter_s, jitter_s)
            scorer.calibrator.observe(endpoint, "m", features(uncached, 0, 0, 0, 0), ttft)
    return scorer


def scores_of(scorer: object, backlog_on_a: int = 0) -> dict[str, float]:
    """The scores of a 600-token prompt no endpoint holds (A with `backlog_on_a` prefill tokens in flight)."""
    now = time.monotonic()
    if backlog_on_a:
        scorer.ledger.pick(A, prompt_tokens=backlog_on_a, now=now)  # type: ignore[attr-defined]
    endpoints = [Endpoint(host, 8000, metrics=EndpointMetrics(update_time=now - 1)) for host in ("10.0.0.1", "10.0.0.2")]
    state = CycleState()
    for endpoint in (A, B):
        state.put_endpoint_data(PREFIX_TIER_MATCH, endpoint, TierMatch(0, 0, 0, PROMPT))
    request = InferenceRequest("cold", "completions", "m", "m", {"prompt": "x"}, format=format_of("completions"))
    return dict(scorer.score(state, request, endpoints))  # type: ignore[attr-defined]


def test_a_gap_within_the_typical_error_is_a_tie():
    # B's fit came out 3 ms dearer than A's; the fits typically miss by ~10 ms: no evidence either way.
    scorer = learned_scorer({}, {A: 0.020, B: 0.023}, jitter_s=0.02)
    predicted = {e: scorer.predict(Endpoint(e.split(":")[0], 8000), None, PROMPT, "m") for e in (A, B)}
    fit_error = min(scorer.calibrator.fit(e, "m").residual_scale_s for e in (A, B))
    assert 0 < predicted[B] - predicted[A] < fit_error
    assert scores_of(scorer) == {A: 1.0, B: 1.0}


def test_without_the_rule_the_noise_decides():
    scorer = learned_scorer({"tiesWithinError": False}, {A: 0.020, B: 0.023}, jitter_s=0.02)
    scores = scores_of(scorer)
    assert scores[A] == 1.0 and scores[B] < 1.0


def test_a_gap_beyond_the_typical_error_still_ranks():
    # A has 1,000 tokens of prefill in flight ahead (~0.3 s): far more than the fits' error.
    scorer = learned_scorer({}, {A: 0.020, B: 0.020}, jitter_s=0.02)
    scores = scores_of(scorer, backlog_on_a=1000)
    assert scores[B] == 1.0 and scores[A] < 0.7


def test_precise_fits_keep_small_gaps():
    # Fits that miss by ~0.1 ms: a 3 ms gap is evidence.
    scorer = learned_scorer({}, {A: 0.020, B: 0.023}, jitter_s=0.0002)
    scores = scores_of(scorer)
    assert scores[A] == 1.0 and scores[B] < 1.0


def test_configured_constants_have_no_error_to_tie_within():
    scorer = make_plugin("predicted-ttft-scorer", {"prefillSecondsPerToken": 3e-4, "baseSeconds": 0.02},
                         context=PluginContext())
    scores = scores_of(scorer, backlog_on_a=10)
    assert scores[B] == 1.0 and scores[A] < 1.0
