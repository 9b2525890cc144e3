"""Active requests, in-flight load, session affinity and the no-hit LRU scorer."""

import base64

import pytest
from prometheus_client import CollectorRegistry

from epp.framework import (
    ConfigError,
    CycleState,
    PluginContext,
    ProfileRunResult,
    ResponseInfo,
    SchedulingResult,
    parse_duration,
)
from epp.framework.datakeys import INFLIGHT_LOAD, PREFIX_MATCH_INFO, InflightLoad, PrefixMatchInfo
from epp.scorers.inflight_tracker import InflightTracker
from tests.support.scheduling import endpoint, make_plugin, request

EPS = [endpoint(0), endpoint(1), endpoint(2)]


def result_for(target, prefill=None):
    profiles = {"default": ProfileRunResult((target,))}
    if prefill is not None:
        profiles["prefill"] = ProfileRunResult((prefill,))
    return SchedulingResult(profiles, "default")


def start(plugin, target, req=None, prefill=None):
    """Pre-request for one pick; returns the request's state (its key for completion)."""
    state = CycleState()
    plugin.pre_request(state, req or request(), result_for(target, prefill))
    return state


def test_active_request_scorer_counts_until_completion():
    scorer = make_plugin("active-request-scorer")
    assert scorer.score(CycleState(), request(), EPS) == {ep.name: 1.0 for ep in EPS}
    states = [start(scorer, EPS[0]), start(scorer, EPS[0]), start(scorer, EPS[0]), start(scorer, EPS[1])]
    got = scorer.score(CycleState(), request(), EPS)
    assert got == {EPS[0].name: 0.0, EPS[1].name: pytest.approx(2 / 3), EPS[2].name: 1.0}
    for state in states[:2]:
        scorer.on_response_complete(state, request(), ResponseInfo(), EPS[0])
        scorer.on_response_complete(state, request(), ResponseInfo(), EPS[0])  # a second completion is a no-op
    got = scorer.score(CycleState(), request(), EPS)
    assert got == {EPS[0].name: 0.0, EPS[1].name: 0.0, EPS[2].name: 1.0}


def test_active_request_scorer_counts_every_profile_target():
    scorer = make_plugin("active-request-scorer")
    start(scorer, EPS[0], prefill=EPS[1])
    assert scorer.tracker.requests(EPS[0].name) == 1 and scorer.tracker.requests(EPS[1].name) == 1


def test_tracker_expires_lost_requests_and_caps_entries():
    tracker = InflightTracker(timeout_s=10, capacity=2)
    tracker.start(["a"], tokens=5, now=0.0)
    tracker.start(["a"], tokens=7, now=5.0)
    assert (tracker.requests("a"), tracker.tokens("a")) == (2, 12)
    tracker.expire(now=10.5)
    assert (tracker.requests("a"), tracker.tokens("a")) == (1, 7)
    tracker.start(["b"], now=11.0)
    tracker.start(["b"], now=12.0)  # over capacity: the oldest entry ("a") is dropped
    assert (tracker.requests("a"), tracker.requests("b"), len(tracker)) == (0, 2, 2)


@pytest.mark.parametrize("text, seconds", [("2m", 120.0), ("1h30m", 5400.0), ("500ms", 0.5), ("1.5s", 1.5),
                                           ("0", 0.0)])
def test_go_durations(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["2", "2 m", "m", "", "1d"])
def test_bad_durations(text):
    with pytest.raises(ConfigError, match="is not a duration"):
        parse_duration(text)


def test_active_request_timeout_parameter():
    assert make_plugin("active-request-scorer", {"requestTimeout": "30s"}).tracker.timeout_s == 30.0
    with pytest.raises(ConfigError, match="'requestTimeout': '30' is not a duration"):
        make_plugin("active-request-scorer", {"requestTimeout": "30"})


async def test_inflight_load_producer_publishes_requests_and_prompt_tokens():
    metrics = CollectorRegistry()
    producer = make_plugin("inflight-load-producer", context=PluginContext(metrics_registry=metrics))
    assert producer.produces() == {INFLIGHT_LOAD}
    state = start(producer, EPS[1], req=request("x" * 400))  # 100 prompt tokens, no output estimate (llm-d)
    view = CycleState()
    await producer.prepare(view, request("y" * 40), EPS)  # the next request's own 10 tokens
    assert view.endpoint_data(INFLIGHT_LOAD, EPS[1].name) == InflightLoad(1, 100, 10)
    assert view.endpoint_data(INFLIGHT_LOAD, EPS[0].name) == InflightLoad(0, 0, 10)
    assert metrics.get_sample_value("epp_plugin_inflight_tracked_requests",
                                    {"plugin": "inflight-load-producer"}) == 1
    producer.on_response_complete(state, request(), ResponseInfo(), EPS[1])
    view = CycleState()
    await producer.prepare(view, request("y" * 40), EPS)
    assert view.endpoint_data(INFLIGHT_LOAD, EPS[1].name) == InflightLoad(0, 0, 10)


def test_session_affinity_scores_the_named_endpoint_and_sets_the_token():
    scorer = make_plugin("session-affinity-scorer")
    token = base64.b64encode(b"192.168.1.2:8000").decode()
    got = scorer.score(CycleState(), request(headers={"x-session-token": token}), EPS)
    assert got == {EPS[0].name: 0.0, EPS[1].name: 1.0, EPS[2].name: 0.0}
    assert set(scorer.score(CycleState(), request(headers={"x-session-token": "!!"}), EPS).values()) == {0.0}
    assert set(scorer.score(CycleState(), request(), EPS).values()) == {0.0}
    response = ResponseInfo()
    scorer.on_response_headers(CycleState(), request(), response, EPS[2])
    assert base64.b64decode(response.set_headers["x-session-token"]) == b"192.168.1.3:8000"


def prefix_state(matches):
    state = CycleState()
    for ep, matched in zip(EPS, matches):
        state.put_endpoint_data(PREFIX_MATCH_INFO, ep.name, PrefixMatchInfo(matched, 4, 16))
    return state


def test_no_hit_lru_spreads_cold_requests_and_ignores_warm_ones():
    scorer = make_plugin("no-hit-lru-scorer")
    assert scorer.consumes() == {PREFIX_MATCH_INFO}
    warm = prefix_state([0, 2, 0])
    assert scorer.score(warm, request(), EPS) == {ep.name: 0.5 for ep in EPS}
    scorer.pre_request(warm, request(), result_for(EPS[0]))  # warm picks do not touch the LRU
    cold = prefix_state([0, 0, 0])
    assert scorer.score(cold, request(), EPS) == {EPS[0].name: 1.0, EPS[1].name: 0.5, EPS[2].name: 0.0}
    scorer.pre_request(cold, request(), result_for(EPS[0]))
    cold = prefix_state([0, 0, 0])
    # Never-used endpoints first (in order), then the least recently used.
    assert scorer.score(cold, request(), EPS) == {EPS[1].name: 1.0, EPS[2].name: 0.5, EPS[0].name: 0.0}
    scorer.pre_request(cold, request(), result_for(EPS[2], prefill=EPS[1]))
    cold = prefix_state([0, 0, 0])
    assert scorer.score(cold, request(), EPS) == {EPS[0].name: 1.0, EPS[2].name: 0.5, EPS[1].name: 0.0}


def test_no_hit_lru_size_bounds_memory():
    scorer = make_plugin("no-hit-lru-scorer", {"lruSize": 1})
    for target in EPS:
        state = prefix_state([0, 0, 0])
        scorer.score(state, request(), EPS)
        scorer.pre_request(state, request(), result_for(target))
    assert list(scorer._lru) == [EPS[2].name]
