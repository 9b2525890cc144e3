"""Formulas of the scorers over scraped metrics: one table per scorer."""

import pytest

from epp.framework import ConfigError, CycleState
from epp.framework.datakeys import INFLIGHT_LOAD, InflightLoad
from tests.support.scheduling import endpoint, make_plugin, request


def scores(type_name, endpoints, params=None, req=None, state=None):
    scorer = make_plugin(type_name, params)
    out = scorer.score(state or CycleState(), req or request(), endpoints)
    return [round(out[ep.name], 6) for ep in endpoints]


@pytest.mark.parametrize("queues, expected", [
    ([3, 0, 10], [0.7, 1.0, 0.0]),
    ([5, 5, 5], [1.0, 1.0, 1.0]),
    ([0], [1.0]),
    ([2, 4], [1.0, 0.0]),
    ([1, 2, 3, 5], [1.0, 0.75, 0.5, 0.0]),
])
def test_queue_scorer_is_min_max_inverted(queues, expected):
    assert scores("queue-scorer", [endpoint(i, queue=q) for i, q in enumerate(queues)]) == expected


@pytest.mark.parametrize("running, expected", [
    ([0, 4, 8], [1.0, 0.5, 0.0]),
    ([7, 7], [1.0, 1.0]),
])
def test_running_requests_size_scorer_is_min_max_inverted(running, expected):
    assert scores("running-requests-size-scorer",
                  [endpoint(i, running=r) for i, r in enumerate(running)]) == expected


@pytest.mark.parametrize("kv, expected", [
    ([0.2, 0.1, 0.0, 1.0], [0.8, 0.9, 1.0, 0.0]),
    ([0.85], [0.15]),
])
def test_kv_cache_utilization_scorer_is_free_fraction(kv, expected):
    assert scores("kv-cache-utilization-scorer", [endpoint(i, kv=k) for i, k in enumerate(kv)]) == expected


@pytest.mark.parametrize("params, queues, expected", [
    (None, [0, 64, 128, 500], [0.5, 0.25, 0.0, 0.0]),
    ({"threshold": 10}, [0, 1, 5, 10], [0.5, 0.45, 0.25, 0.0]),
])
def test_load_aware_scorer(params, queues, expected):
    assert scores("load-aware-scorer", [endpoint(i, queue=q) for i, q in enumerate(queues)], params) == expected


@pytest.mark.parametrize("threshold", [0, -5])
def test_load_aware_threshold_of_zero_or_less_is_the_default_as_in_llm_d(threshold):
    assert make_plugin("load-aware-scorer", {"threshold": threshold}).threshold == 128


@pytest.mark.parametrize("active, waiting, max_active, expected", [
    (["target"], [], 0, 1.0),           # adapter loaded
    (["a"], [], 4, 0.8),                # a free adapter slot
    (["a", "b"], ["target"], 2, 0.6),   # queued for loading, no free slot
    (["a", "b"], [], 2, 0.0),           # full, not there
    (["a"], ["target"], 4, 0.8),        # free slot outranks waiting
    ([], [], 0, 0.0),                   # no LoRA metrics at all
])
def test_lora_affinity_scorer(active, waiting, max_active, expected):
    ep = endpoint(0, active=active, waiting=waiting, max_active=max_active)
    assert scores("lora-affinity-scorer", [ep], req=request(target="target")) == [expected]


def test_token_load_scorer_reads_inflight_tokens():
    eps = [endpoint(0), endpoint(1), endpoint(2)]
    state = CycleState()
    state.put_endpoint_data(INFLIGHT_LOAD, eps[0].name, InflightLoad(1, 1000))
    state.put_endpoint_data(INFLIGHT_LOAD, eps[1].name, InflightLoad(3, 5000))
    assert scores("token-load-scorer", eps, {"queueThresholdTokens": 10000}, state=state) == [0.9, 0.5, 1.0]
    assert make_plugin("token-load-scorer").consumes() == {INFLIGHT_LOAD}


@pytest.mark.parametrize("type_name", ["queue-scorer", "kv-cache-utilization-scorer", "lora-affinity-scorer",
                                       "prefix-cache-scorer", "running-requests-size-scorer"])
def test_parameterless_scorers_reject_unknown_parameters(type_name):
    with pytest.raises(ConfigError, match="unknown parameter"):
        make_plugin(type_name, {"bogus": 1})
