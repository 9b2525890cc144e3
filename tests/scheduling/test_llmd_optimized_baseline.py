"""llm-d's optimized-baseline pipeline: prefix-cache-affinity-filter, token-load-scorer, inflight-load-producer.

The behaviour tests follow the plugins' documented examples (llm-d-router READMEs and tests): the
affinity gate, its load gates, token load with the request's own uncached tokens, and in-flight
tokens released at a stream's first token. The whole pipeline is loaded from our config of the
guide (bench/routing/configs/llmd-optimized-baseline.yaml) and routes through the real director.
"""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from bench.routing.contenders import LLMD_CONFIGS
from epp.config import load_config
from epp.config.describe import describe
from epp.framework import (
    INFLIGHT_LOAD,
    PREFIX_MATCH_INFO,
    ConfigError,
    CycleState,
    InflightLoad,
    PluginContext,
    PrefixMatchInfo,
    ProfileRunResult,
    PromptTokens,
    ResponseInfo,
    SchedulingResult,
)
from epp.framework.datakeys import PROMPT_TOKENS
from tests.support.scheduling import DirectorHarness, endpoint, make_plugin, request

# The benchmark's copy of the guide's pipeline is the one source (the benchmark must not depend on tests/).
BASELINE = LLMD_CONFIGS / "llmd-optimized-baseline.yaml"
EPS = [endpoint(i) for i in range(3)]


def state_with(matched: dict[int, int], tokens: dict[int, int] | None = None, total: int = 100) -> CycleState:
    """Prefix match (blocks of `total`) and in-flight tokens per endpoint index, as the producers publish them."""
    state = CycleState()
    for i, blocks in matched.items():
        state.put_endpoint_data(PREFIX_MATCH_INFO, EPS[i].name, PrefixMatchInfo(blocks, total, 16))
    for i, count in (tokens or {}).items():
        state.put_endpoint_data(INFLIGHT_LOAD, EPS[i].name, InflightLoad(1, count))
    return state


def kept(params: dict, state: CycleState, endpoints=EPS) -> list[int]:
    flt = make_plugin("prefix-cache-affinity-filter", params)
    return [EPS.index(ep) for ep in flt.filter(state, request(), endpoints)]


# -- prefix-cache-affinity-filter: llm-d's documented examples ------------------------------------

def test_narrows_to_the_endpoints_at_or_above_the_threshold():
    assert kept({}, state_with({0: 90, 1: 80, 2: 10})) == [0, 1]


def test_keeps_all_when_no_endpoint_is_sticky_or_there_is_no_prefix_info():
    assert kept({}, state_with({0: 10, 1: 20, 2: 79})) == [0, 1, 2]
    assert kept({}, CycleState()) == [0, 1, 2]


def test_a_single_endpoint_and_a_threshold_of_zero_keep_everything():
    assert kept({}, state_with({0: 90}), EPS[:1]) == [0]
    assert kept({"affinityThreshold": 0}, state_with({0: 90, 1: 0})) == [0, 1, 2]


def test_exploration_probability_one_always_skips_the_gate():
    assert kept({"explorationProbability": 1.0}, state_with({0: 90, 1: 10})) == [0, 1, 2]


def test_ttft_gate_breaks_stickiness_on_in_flight_tokens_over_peak_throughput():
    # Sticky endpoint 0 has 20,000 tokens more than endpoint 2: 20000 / 10000 tok/s = 2000 ms of TTFT.
    state = state_with({0: 90, 1: 10, 2: 10}, {0: 25_000, 1: 30_000, 2: 5_000})
    params = {"peakPrefillThroughput": 10_000}
    assert kept({**params, "maxTTFTPenaltyMs": 1999}, state) == [0, 1, 2]
    assert kept({**params, "maxTTFTPenaltyMs": 2000}, state) == [0]
    assert kept({**params, "maxTTFTPenaltyMs": 0}, state) == [0]  # 0: never break on TTFT


def test_ttft_gate_uses_the_default_peak_throughput_and_penalty():
    # 18000 ms at 15928 tokens/s is 286,704 tokens.
    assert kept({}, state_with({0: 90, 1: 10}, {0: 286_704, 1: 0})) == [0]
    assert kept({}, state_with({0: 90, 1: 10}, {0: 286_720, 1: 0})) == [0, 1, 2]


def test_in_flight_token_gate_follows_llm_d_examples():
    state = state_with({0: 90, 1: 10}, {0: 500, 1: 50})
    assert kept({"maxTokensInFlightPenalty": 100, "maxTTFTPenaltyMs": 0}, state) == [0, 1, 2]
    assert kept({"maxTokensInFlightPenalty": 1000, "maxTTFTPenaltyMs": 0}, state) == [0]
    huge = state_with({0: 90, 1: 10}, {0: 5000, 1: 50})
    assert kept({"maxTokensInFlightPenalty": 0, "maxTTFTPenaltyMs": 0}, huge) == [0]


def test_without_in_flight_counts_the_load_gates_never_break():
    assert kept({"maxTokensInFlightPenalty": 1, "maxTTFTPenaltyMs": 1}, state_with({0: 90, 1: 10})) == [0]


def test_the_gates_compare_the_least_loaded_of_each_side():
    # The busiest sticky endpoint does not matter: the least loaded sticky one is close to the best other.
    state = state_with({0: 90, 1: 95, 2: 0}, {0: 900_000, 1: 1_000, 2: 0})
    assert kept({"maxTokensInFlightPenalty": 5_000, "maxTTFTPenaltyMs": 0}, state) == [0, 1]


def test_parameters_are_checked_as_llm_d_checks_them():
    with pytest.raises(ConfigError, match="'affinityThreshold' must be <= 1.0"):
        make_plugin("prefix-cache-affinity-filter", {"affinityThreshold": 1.5})
    with pytest.raises(ConfigError, match="'explorationProbability' must be >= 0.0"):
        make_plugin("prefix-cache-affinity-filter", {"explorationProbability": -0.1})
    with pytest.raises(ConfigError, match="'peakPrefillThroughput' must be > 0 when ttftSource is prefillThroughput"):
        make_plugin("prefix-cache-affinity-filter", {"peakPrefillThroughput": 0})
    with pytest.raises(ConfigError, match="'ttftSource' must be one of"):
        make_plugin("prefix-cache-affinity-filter", {"ttftSource": "sidecar"})
    with pytest.raises(ConfigError, match="latencyPredictionInfoProducerName"):
        make_plugin("prefix-cache-affinity-filter", {"latencyPredictionInfoProducerName": "p"})
    make_plugin("prefix-cache-affinity-filter", {"peakPrefillThroughput": 0, "maxTTFTPenaltyMs": 0})


def test_the_in_flight_load_is_consumed_only_when_a_gate_reads_it():
    def consumed(params):
        return make_plugin("prefix-cache-affinity-filter", params).consumes()

    assert consumed({"maxTTFTPenaltyMs": 0}) == {PREFIX_MATCH_INFO}
    assert consumed({}) == {PREFIX_MATCH_INFO, INFLIGHT_LOAD}
    assert consumed({"maxTTFTPenaltyMs": 0, "maxTokensInFlightPenalty": 10}) == {PREFIX_MATCH_INFO, INFLIGHT_LOAD}
    assert consumed({"ttftSource": "latencyPredictor"}) == {PREFIX_MATCH_INFO}


def test_latency_predictor_source_is_our_predicted_ttft():
    metrics = CollectorRegistry()
    flt = make_plugin("prefix-cache-affinity-filter", {"ttftSource": "latencyPredictor", "maxTTFTPenaltyMs": 50},
                      context=PluginContext(metrics_registry=metrics))
    assert "not llm-d's latency-predictor sidecar" in flt.describe()
    # Endpoint 0 holds the prompt but has a long waiting queue; the others are idle.
    busy = [endpoint(0, queue=40), endpoint(1), endpoint(2)]
    state = CycleState()
    for ep, blocks in zip(busy, (95, 0, 0)):
        state.put_endpoint_data(PREFIX_MATCH_INFO, ep.name, PrefixMatchInfo(blocks, 100, 16))
    prompt = "x" * 6400  # 1,600 tokens
    assert [ep.name for ep in flt.filter(state, request(prompt), busy)] == [ep.name for ep in busy]
    idle = [endpoint(0), endpoint(1), endpoint(2)]
    assert [ep.name for ep in flt.filter(state, request(prompt), idle)] == [idle[0].name]
    assert metrics.get_sample_value("epp_prefix_affinity_decisions_total",
                                    {"plugin": "prefix-cache-affinity-filter", "decision": "load_override"}) == 1


# -- token-load-scorer -------------------------------------------------------------------------

def test_token_load_counts_in_flight_and_the_requests_own_uncached_tokens():
    state = CycleState()
    state.put_endpoint_data(INFLIGHT_LOAD, EPS[0].name, InflightLoad(2, 1_000, 1_000))
    state.put_endpoint_data(INFLIGHT_LOAD, EPS[1].name, InflightLoad(1, 3_000, 2_000))
    scorer = make_plugin("token-load-scorer", {"queueThresholdTokens": 10_000})
    assert scorer.score(state, request(), EPS) == {EPS[0].name: 0.8, EPS[1].name: 0.5, EPS[2].name: 1.0}
    assert make_plugin("token-load-scorer").threshold == 4_194_304
    assert make_plugin("token-load-scorer", {"queueThresholdTokens": 0}).threshold == 4_194_304


# -- inflight-load-producer --------------------------------------------------------------------

def picks(*profiles: tuple[str, int]) -> SchedulingResult:
    return SchedulingResult({p: ProfileRunResult((EPS[i],)) for p, i in profiles}, profiles[0][0])


async def loads(producer, req=None) -> dict[int, InflightLoad]:
    view = CycleState()
    await producer.prepare(view, req or request(""), EPS)
    return {i: view.endpoint_data(INFLIGHT_LOAD, ep.name) for i, ep in enumerate(EPS)}


async def test_only_the_uncached_part_of_the_prompt_is_counted():
    producer = make_plugin("inflight-load-producer")
    state = state_with({0: 60, 1: 0})  # 100 blocks of 16 tokens; endpoint 0 holds 60 of them
    req = request("x" * 8000)  # 2,000 tokens: 1,600 indexed, a 400-token tail beyond the index
    await producer.prepare(state, req, EPS)
    assert state.endpoint_data(INFLIGHT_LOAD, EPS[0].name).request_tokens == 40 * 16 + 400
    assert state.endpoint_data(INFLIGHT_LOAD, EPS[1].name).request_tokens == 2_000
    assert state.endpoint_data(INFLIGHT_LOAD, EPS[2].name).request_tokens == 2_000  # no match info: all of it
    producer.pre_request(state, req, picks(("default", 0)))
    assert (await loads(producer))[0] == InflightLoad(1, 1_040, 0)


async def test_prompt_tokens_are_the_token_producers_when_it_ran():
    producer = make_plugin("inflight-load-producer")
    state = CycleState()
    state.put(PROMPT_TOKENS, PromptTokens(tuple(range(321)), exact=True))
    producer.pre_request(state, request("x" * 8000), picks(("default", 1)))
    assert (await loads(producer))[1].tokens == 321


async def test_prompt_tokens_are_released_at_the_first_token_and_the_request_at_the_end():
    producer = make_plugin("inflight-load-producer")
    state = CycleState()
    req = request("x" * 4000)
    producer.pre_request(state, req, picks(("default", 0)))
    assert (await loads(producer))[0] == InflightLoad(1, 1_000)
    producer.on_first_token(state, req, EPS[0])
    assert (await loads(producer))[0] == InflightLoad(1, 0)
    producer.on_first_token(state, req, EPS[0])  # once only
    producer.on_response_complete(state, req, ResponseInfo(status="200"), EPS[0])
    assert (await loads(producer))[0] == InflightLoad(0, 0)


async def test_prefill_pick_is_released_whole_at_the_first_token():
    producer = make_plugin("inflight-load-producer")
    state = CycleState()
    req = request("x" * 4000)
    producer.pre_request(state, req, picks(("decode", 0), ("prefill", 1)))
    assert [(await loads(producer))[i] for i in (0, 1)] == [InflightLoad(1, 1_000), InflightLoad(1, 1_000)]
    producer.on_first_token(state, req, EPS[0])
    assert [(await loads(producer))[i] for i in (0, 1)] == [InflightLoad(1, 0), InflightLoad(0, 0)]


async def test_estimated_output_tokens_stay_until_the_end_capped_by_the_request_and_the_operator():
    producer = make_plugin("inflight-load-producer", {"addEstimatedOutputTokens": True})
    state = CycleState()
    req = request("x" * 4000)  # 1,000 prompt tokens, 1,500 estimated output
    producer.pre_request(state, req, picks(("default", 0)))
    assert (await loads(producer))[0].tokens == 2_500
    producer.on_first_token(state, req, EPS[0])
    assert (await loads(producer))[0].tokens == 2_500  # only a prefill pick goes at the first token
    producer.on_response_complete(state, req, ResponseInfo(status="200"), EPS[0])
    assert (await loads(producer))[0].tokens == 0
    capped = request(body={"model": "m", "prompt": "x" * 4000, "max_tokens": 100})
    producer.pre_request(CycleState(), capped, picks(("default", 1)))
    assert (await loads(producer))[1].tokens == 1_100
    operator = make_plugin("inflight-load-producer", {"addEstimatedOutputTokens": True, "outputRatio": 0.5,
                                                      "maxEstimatedOutputTokens": 300})
    operator.pre_request(CycleState(), req, picks(("default", 2)))
    assert (await loads(operator))[2].tokens == 1_300
    with pytest.raises(ConfigError, match="'outputRatio' must be >= 0.0"):
        make_plugin("inflight-load-producer", {"outputRatio": -1})


async def test_endpoints_leaving_the_pool_are_dropped_from_the_counters():
    harness = DirectorHarness(BASELINE.read_text())
    harness.set_pool(EPS)
    producer = harness.loaded.plugin("inflight-load-producer")
    state = CycleState()
    producer.pre_request(state, request("x" * 400), picks(("default", 0)))
    assert producer.tracker.requests(EPS[0].name) == 1
    harness.set_pool(EPS[1:])
    assert producer.tracker.requests(EPS[0].name) == 0
    harness.set_pool(EPS)  # it comes back: the old request's end releases nothing there
    producer.pre_request(CycleState(), request("x" * 40), picks(("default", 0)))
    producer.on_response_complete(state, request(), ResponseInfo(status="200"), EPS[0])
    assert (producer.tracker.requests(EPS[0].name), producer.tracker.tokens(EPS[0].name)) == (1, 10)


# -- the whole pipeline ------------------------------------------------------------------------

def test_the_guide_pipeline_loads_with_its_producers_ordered():
    loaded = load_config(BASELINE)
    assert [p.name for p in loaded.data_producers] == ["approx-prefix-cache-producer", "inflight-load-producer"]
    profile = loaded.scheduler.profiles["default"]
    assert [f.type_name for f in profile.filters] == ["prefix-cache-affinity-filter"]
    assert [(ws.scorer.type_name, ws.weight) for ws in profile.scorers] == [("token-load-scorer", 1.0)]
    assert profile.picker.type_name == "max-score-picker"
    text = describe(loaded)
    assert "llm-d prefix-cache-affinity-filter -> prefix-cache-affinity-filter" in text
    assert "maxTokensInFlightPenalty=286720" in text


LONG = "You are a careful assistant. Answer the question about the attached report. " * 60  # ~1,100 tokens


def index_of(name: str) -> int:
    return [ep.name for ep in EPS].index(name)


@pytest.mark.parametrize("with_filter", [True, False], ids=["guide", "token-load-alone"])
async def test_sticky_until_saturated_through_the_director(with_filter):
    text = BASELINE.read_text()
    if not with_filter:
        text = text.replace("  - pluginRef: prefix-cache-affinity-filter\n", "")
    harness = DirectorHarness(text)
    harness.set_pool(EPS)
    first, _ = await harness.cycle(request(LONG + "Q1"))
    home = first.targets[0].name
    # Unrelated work in flight on the home endpoint (10,000 tokens): token load alone moves the next turns.
    producer = harness.loaded.plugin("inflight-load-producer")
    producer.pre_request(CycleState(), request("z" * 40_000), picks(("default", index_of(home))))
    held = []
    for i in range(4):
        req = request(LONG + f"Q{i + 2}")
        result, state = await harness.pick(req)
        held.append((req, result, state))
    assert all(result.targets[0].name == home for _, result, _ in held) is with_filter
    if not with_filter:
        return
    # A stream's first token releases its prompt tokens from the counters.
    before = producer.tracker.tokens(home)
    req, result, state = held[0]
    harness.director.first_token(state, request=req, target=result.targets[0])
    assert producer.tracker.tokens(home) < before
    for req, result, state in held:
        harness.answer(state, req, result)
    assert producer.tracker.tokens(home) == 10_000 and producer.tracker.requests(home) == 1


async def test_stickiness_breaks_when_the_sticky_endpoint_is_saturated():
    text = BASELINE.read_text().replace("maxTokensInFlightPenalty: 286720", "maxTokensInFlightPenalty: 2000")
    harness = DirectorHarness(text)
    harness.set_pool(EPS)
    first, _ = await harness.cycle(request(LONG + "Q1"))
    home = first.targets[0].name
    # Unrelated long prompts held in flight on the home endpoint: over 2,000 tokens more than elsewhere.
    producer = harness.loaded.plugin("inflight-load-producer")
    producer.pre_request(CycleState(), request("z" * 12_000), picks(("default", index_of(home))))
    result, _ = await harness.pick(request(LONG + "Q2"))
    assert result.targets[0].name != home
    assert harness.metrics.registry.get_sample_value(
        "epp_prefix_affinity_decisions_total",
        {"plugin": "prefix-cache-affinity-filter", "decision": "load_override"}) == 1
