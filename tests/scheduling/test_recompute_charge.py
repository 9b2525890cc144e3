"""predicted-ttft-scorer's recompute charge: a move away from the cached prefix pays for the prefill it adds."""

from __future__ import annotations

import pytest

from epp.framework import CycleState
from epp.framework.datakeys import PREFIX_TIER_MATCH, TierMatch
from tests.scheduling.sched_fixtures import endpoint, make_plugin, request

COSTS = {"prefillSecondsPerToken": 1e-3, "queueSecondsPerWaitingRequest": 0.5, "secondsPerRunningRequest": 0.0,
         "baseSeconds": 0.01}


def best(charge: float, home_waiting: int) -> tuple[str, dict[str, float]]:
    """The endpoint scored best when the home holds 800 of 1,000 tokens behind `home_waiting` requests."""
    scorer = make_plugin("predicted-ttft-scorer", {**COSTS, "recomputeCharge": charge})
    home, cold = endpoint(0, queue=home_waiting), endpoint(1)
    state = CycleState()
    state.put_endpoint_data(PREFIX_TIER_MATCH, home.name, TierMatch(800, 0, 0, 1000))
    state.put_endpoint_data(PREFIX_TIER_MATCH, cold.name, TierMatch(0, 0, 0, 1000))
    scores = scorer.score(state, request(), [home, cold])
    return ("home" if scores[home.name] > scores[cold.name] else "cold"), scores


def test_without_a_charge_a_short_queue_sends_the_request_to_a_cold_prefill():
    # T(home) = 0.01 + 2 x 0.5 + 200 x 1e-3 = 1.21; T(cold) = 0.01 + 1,000 x 1e-3 = 1.01
    winner, scores = best(0.0, home_waiting=2)
    assert winner == "cold" and scores["192.168.1.1:8000"] == pytest.approx(1.01 / 1.21)


def test_a_charge_keeps_it_home_until_the_queue_costs_more_than_twice_the_added_prefill():
    # The cold endpoint is charged 800 extra tokens x 1e-3: T(cold) = 1.81.
    winner, scores = best(1.0, home_waiting=2)
    assert winner == "home" and scores["192.168.1.2:8000"] == pytest.approx(1.21 / 1.81)
    assert best(1.0, home_waiting=4)[0] == "cold"  # T(home) = 2.21: spill
    assert "recomputeCharge=1" in make_plugin("predicted-ttft-scorer", {"recomputeCharge": 1}).describe()
