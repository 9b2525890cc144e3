"""Stickiness that pays: a conversation's later turn leaves the replica holding its history only when the
predicted TTFT gain exceeds the recompute cost of the prefill it throws away."""

from __future__ import annotations

import time

import pytest

from epp.framework import CycleState, PluginContext
from epp.framework.datakeys import PREFIX_TIER_MATCH, TierMatch
from epp.framework.types import Endpoint, EndpointMetrics, InferenceRequest
from tests.support.requests import format_of
from tests.support.scheduling import make_plugin

HOME, OTHER = "10.0.0.1:8000", "10.0.0.2:8000"
PREFILL = 1e-4  # seconds per token, configured (no learning in this table)


def choose(stickiness: float, backlog_tokens: int, cached: int, prompt: int = 4000) -> str:
    """Where predicted-ttft-scorer sends a turn of `prompt` tokens whose first `cached` are on HOME,
    while HOME still has `backlog_tokens` of other requests' prefill to do (OTHER is idle and holds nothing)."""
    context = PluginContext()
    scorer = make_plugin("predicted-ttft-scorer", {"prefillSecondsPerToken": PREFILL, "baseSeconds": 0.01,
                                                   "stickiness": stickiness}, context=context)
    now = time.monotonic()
    if backlog_tokens:
        context.load.pick(HOME, prompt_tokens=backlog_tokens, now=now)
    endpoints = [Endpoint(host, 8000, metrics=EndpointMetrics(update_time=now - 1))
                 for host in ("10.0.0.1", "10.0.0.2")]
    state = CycleState()
    state.put_endpoint_data(PREFIX_TIER_MATCH, HOME, TierMatch(cached, 0, 0, prompt))
    state.put_endpoint_data(PREFIX_TIER_MATCH, OTHER, TierMatch(0, 0, 0, prompt))
    request = InferenceRequest("turn", "completions", "m", "m", {"prompt": "x"}, format=format_of("completions"))
    scores = scorer.score(state, request, endpoints)
    return max(scores, key=scores.__getitem__)


# The turn's own TTFT at HOME is 0.01 + backlog x 1e-4 + 1,000 x 1e-4; at OTHER 0.01 + 4,000 x 1e-4 = 0.41 s.
# Moving throws away the 3,000 cached tokens: a recompute cost of 0.3 s.
@pytest.mark.parametrize("backlog_tokens, without, with_stickiness", [
    (0, HOME, HOME),         # gain -0.3 s
    (2000, HOME, HOME),      # gain -0.1 s
    (4000, OTHER, HOME),     # gain 0.1 s: faster for this turn, but less than the 0.3 s recompute
    (5500, OTHER, HOME),     # gain 0.25 s < 0.3 s
    (7000, OTHER, OTHER),    # gain 0.4 s > 0.3 s: the move pays
])
def test_a_later_turn_moves_only_when_the_gain_exceeds_the_recompute_cost(backlog_tokens, without, with_stickiness):
    assert choose(0.0, backlog_tokens, cached=3000) == without
    assert choose(1.0, backlog_tokens, cached=3000) == with_stickiness


def test_a_first_turn_with_nothing_cached_anywhere_is_not_held_back():
    # No endpoint holds the prompt: no recompute cost, the least busy endpoint wins as before.
    assert choose(1.0, 2000, cached=0) == OTHER
