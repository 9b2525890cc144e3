"""llm-d plugin types route as their llm-d meaning says, loaded from configs in llm-d's shape and run by the
real director: the prefix scorer's match length, active-request's idle gap, session affinity by session id,
context-length ranges, the disaggregation handler with its deciders, the data-parallel handler."""

from __future__ import annotations

import time

import pytest

from epp.framework import PREFILLER_HOST_PORT_HEADER, CycleState
from epp.framework.datakeys import PREFIX_MATCH_INFO, PrefixMatchInfo
from tests.support.scheduling import DirectorHarness, endpoint, make_plugin, request

HEADER = "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\n"
ROLE = "llm-d.ai/role"


def names(endpoints):
    return [ep.name for ep in endpoints]


def test_prefix_scorer_match_length_weight_favours_long_absolute_matches():
    scorer = make_plugin("prefix-cache-scorer", {"matchLengthWeight": 0.5, "matchLengthScaleTokens": 256})
    short, long = endpoint(0), endpoint(1)
    state = CycleState()
    # Both hold a quarter of their prompt; one prompt is 4x longer, so its match is 4x more tokens.
    state.put_endpoint_data(PREFIX_MATCH_INFO, short.name, PrefixMatchInfo(8, 32, 16))   # 128 tokens
    state.put_endpoint_data(PREFIX_MATCH_INFO, long.name, PrefixMatchInfo(16, 64, 16))   # 256 tokens
    scores = scorer.score(state, request(), [short, long])
    assert scores[short.name] == pytest.approx(0.5 * 0.25 + 0.5 * (128 / 256) ** 2)
    assert scores[long.name] == pytest.approx(0.5 * 0.25 + 0.5 * 1.0)
    plain = make_plugin("prefix-cache-scorer").score(state, request(), [short, long])
    assert plain == {short.name: 0.25, long.name: 0.25}


@pytest.mark.parametrize("counts, idle, busy, expected", [
    ([0, 1, 3], 1, 0.5, [1.0, 1.0, 0.0]),            # at or under idleThreshold: idle
    ([0, 2, 4], 0, 0.5, [1.0, 0.25, 0.0]),           # busy endpoints top out at maxBusyScore
    ([0, 2, 4], 0, 1.0, [1.0, 0.5, 0.0]),            # the defaults: (max - n) / max
])
def test_active_request_idle_threshold_and_max_busy_score(counts, idle, busy, expected):
    scorer = make_plugin("active-request-scorer", {"idleThreshold": idle, "maxBusyScore": busy})
    pool = [endpoint(i) for i in range(3)]
    for ep, count in zip(pool, counts):
        for _ in range(count):
            scorer.tracker.start([ep.name])
    scores = scorer.score(CycleState(), request(), pool)
    assert [scores[ep.name] for ep in pool] == pytest.approx(expected)


async def test_active_request_reads_the_named_inflight_load_producer():
    harness = DirectorHarness(HEADER + """plugins:
- type: inflight-load-producer
- type: active-request-scorer
  parameters: {inFlightLoadProducerName: inflight-load-producer}
schedulingProfiles:
- name: default
  plugins: [{pluginRef: active-request-scorer}]
""")
    pool = [endpoint(0), endpoint(1)]
    first, _ = await harness.pick(request(request_id="a"), pool)  # in flight, not answered
    second, _ = await harness.pick(request(request_id="b"))
    assert second.targets[0].name != first.targets[0].name


async def test_session_id_strategy_keeps_a_session_on_its_endpoint_until_it_idles_out():
    harness = DirectorHarness(HEADER + """plugins:
- type: session-affinity-scorer
  parameters: {strategy: session_id, sessionIdConfig: {sources: [{header: x-conversation}], evictionTtlSeconds: 0.3,
               evictionSweepSeconds: 0.1}}
- type: queue-scorer
schedulingProfiles:
- name: default
  plugins: [{pluginRef: session-affinity-scorer, weight: 10}, {pluginRef: queue-scorer, weight: 1}]
""")
    a, b = endpoint(0, queue=0), endpoint(1, queue=5)
    session = {"x-conversation": "chat-1"}
    result, _ = await harness.cycle(request(headers=session), [a, b])
    assert result.targets[0].name == a.name  # the shorter queue, first turn
    # A's queue grows: the session stays on A, another session goes to the shorter queue.
    result, _ = await harness.cycle(request(headers=session), [endpoint(0, queue=9), endpoint(1, queue=1)])
    assert result.targets[0].name == a.name
    other, _ = await harness.cycle(request(headers={"x-conversation": "chat-2"}))
    assert other.targets[0].name == b.name
    time.sleep(0.35)  # idle past evictionTtlSeconds: the binding is gone
    result, _ = await harness.cycle(request(headers=session))
    assert result.targets[0].name == b.name


async def test_encoded_endpoint_header_strategy_with_a_custom_header():
    from epp.framework import ResponseInfo

    scorer = make_plugin("session-affinity-scorer", {"encodedEndpointHeaderConfig": {"header": "X-Sticky"}})
    a, b = endpoint(0), endpoint(1)
    response = ResponseInfo(status="200")
    scorer.on_response_headers(CycleState(), request(), response, b)
    token = response.set_headers["x-sticky"]
    assert scorer.score(CycleState(), request(headers={"x-sticky": token}), [a, b]) == {a.name: 0.0, b.name: 1.0}


CONTEXT = HEADER + """plugins:
- type: token-producer
- type: context-length-aware
  parameters: {{label: llm-d.ai/context-length-range, enableFiltering: {filtering}}}
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins: [{{pluginRef: context-length-aware}}, {{pluginRef: max-score-picker}}]
"""
CONTEXT_POOL = [endpoint(0, labels={"llm-d.ai/context-length-range": "0-2048"}),
                endpoint(1, labels={"llm-d.ai/context-length-range": "2048-8192"}),
                endpoint(2, labels={"llm-d.ai/context-length-range": "0-100000"}),
                endpoint(3)]


@pytest.mark.parametrize("tokens, expected", [(100, 0), (3000, 1), (20_000, 2)])
async def test_context_length_aware_routes_to_the_tightest_range_that_fits(tokens, expected):
    harness = DirectorHarness(CONTEXT.format(filtering="false"))
    result, _ = await harness.cycle(request("x" * (4 * tokens)), CONTEXT_POOL)  # estimate: 4 bytes per token
    assert result.targets[0].name == CONTEXT_POOL[expected].name


async def test_context_length_aware_filtering_keeps_only_ranges_that_fit_and_unlabelled_endpoints():
    harness = DirectorHarness(CONTEXT.format(filtering="true"))
    picks = {(await harness.cycle(request("x" * 4 * 200_000), CONTEXT_POOL))[0].targets[0].name for _ in range(8)}
    assert picks == {CONTEXT_POOL[3].name}  # no range holds 200k tokens: only the unlabelled endpoint is left


DISAGG = HEADER + """plugins:
- type: prefill-filter
- type: decode-filter
- type: queue-scorer
- type: prefix-cache-scorer
- type: {decider}
  parameters: {params}
- type: disagg-profile-handler
  parameters:
    deciders: {{prefill: {decider}}}
schedulingProfiles:
- name: prefill
  plugins: [{{pluginRef: prefill-filter}}, {{pluginRef: queue-scorer}}]
- name: decode
  plugins: [{{pluginRef: decode-filter}}, {{pluginRef: prefix-cache-scorer}}, {{pluginRef: queue-scorer}}]
"""
PD_POOL = [endpoint(0, labels={ROLE: "prefill"}), endpoint(1, queue=3, labels={ROLE: "prefill"}),
           endpoint(2, labels={ROLE: "decode"})]


@pytest.mark.parametrize("non_cached, prompt_tokens, disaggregated", [
    (512, 2000, True),     # 2000 uncached tokens >= 512: prefill on the prefill pool
    (512, 100, False),     # a short prompt is prefilled by the decode endpoint
    (0, 2000, False),      # nonCachedTokens 0 disables the decider (llm-d)
])
async def test_prefix_based_pd_decider(non_cached, prompt_tokens, disaggregated):
    harness = DirectorHarness(DISAGG.format(decider="prefix-based-pd-decider",
                                            params=f"{{nonCachedTokens: {non_cached}}}"))
    result, state = await harness.cycle(request("y" * 4 * prompt_tokens), PD_POOL)
    assert result.targets[0].name == PD_POOL[2].name and result.primary_profile == "decode"
    if disaggregated:
        assert result.profile_results["prefill"].targets[0].name == PD_POOL[0].name  # the shorter queue
        assert state.request_headers() == {PREFILLER_HOST_PORT_HEADER: PD_POOL[0].hostport}
    else:
        assert "prefill" not in result.profile_results and not state.request_headers()


async def test_prefix_based_pd_decider_skips_prefill_once_the_decode_endpoint_holds_the_prefix():
    harness = DirectorHarness(DISAGG.format(decider="prefix-based-pd-decider", params="{nonCachedTokens: 256}"))
    prompt = "z" * 4 * 2000
    first, _ = await harness.cycle(request(prompt), PD_POOL)
    assert "prefill" in first.profile_results  # cold: disaggregated
    again, state = await harness.cycle(request(prompt + " and one more question"), PD_POOL)
    assert "prefill" not in again.profile_results and not state.request_headers()


async def test_always_disagg_pd_decider_and_no_decider():
    always = DirectorHarness(DISAGG.format(decider="always-disagg-pd-decider", params="{}"))
    result, _ = await always.cycle(request("short"), PD_POOL)
    assert result.profile_results["prefill"].targets[0].name == PD_POOL[0].name
    decode_only = DirectorHarness(HEADER + """plugins:
- type: decode-filter
- type: disagg-profile-handler
schedulingProfiles:
- name: decode
  plugins: [{pluginRef: decode-filter}]
""")
    result, state = await decode_only.cycle(request("y" * 40_000), PD_POOL)
    assert names(result.targets) == [PD_POOL[2].name] and not state.request_headers()


async def test_data_parallel_handler_sends_to_the_primary_port_and_names_the_rank():
    harness = DirectorHarness(HEADER + """plugins:
- type: queue-scorer
- type: data-parallel-profile-handler
  parameters: {primaryPort: 8000}
schedulingProfiles:
- name: default
  plugins: [{pluginRef: queue-scorer}]
""")
    ranks = [endpoint(0, queue=4, port=8001), endpoint(0, queue=0, port=8002), endpoint(0, queue=9, port=8003)]
    result, state = await harness.cycle(request(), ranks)
    assert names(result.targets) == ["192.168.1.1:8000"]
    assert state.request_headers() == {"x-data-parallel-host-port": "192.168.1.1:8002"}


async def test_picker_max_num_of_endpoints_gives_fallbacks_in_score_order():
    harness = DirectorHarness(HEADER + """plugins:
- type: queue-scorer
- type: max-score-picker
  parameters: {maxNumOfEndpoints: 2}
""")
    result, _ = await harness.cycle(request(), [endpoint(0, queue=5), endpoint(1, queue=0), endpoint(2, queue=9)])
    assert names(result.targets) == ["192.168.1.2:8000", "192.168.1.1:8000"]
