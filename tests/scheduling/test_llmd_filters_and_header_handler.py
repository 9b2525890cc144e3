"""llm-d's session-affinity-filter, utilization-filter and header-profile-handler, against their READMEs."""

from __future__ import annotations

import base64
import re
import time

import pytest

from epp.config import load_config_text
from epp.framework import (
    INFLIGHT_LOAD,
    SESSION,
    ConfigError,
    CycleState,
    InferenceError,
    InflightLoad,
    ProfileRunResult,
    ResponseInfo,
    SchedulingResult,
    SessionKey,
)
from tests.support.scheduling import DirectorHarness, endpoint, make_plugin, request

EPS = [endpoint(i) for i in range(3)]
HEAD = "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\n"


def token(i: int) -> str:
    return base64.b64encode(EPS[i].name.encode()).decode()


def names(endpoints) -> list[int]:
    return [EPS.index(ep) for ep in endpoints]


def picked(i: int, prefill: int | None = None) -> SchedulingResult:
    results = {"decode": ProfileRunResult((EPS[i],))}
    if prefill is not None:
        results["prefill"] = ProfileRunResult((EPS[prefill],))
    return SchedulingResult(results, "decode")


# -- session-affinity-filter ---------------------------------------------------------------------

def test_encoded_endpoint_header_pins_the_named_candidate_else_keeps_all():
    flt = make_plugin("session-affinity-filter")
    state = CycleState()
    assert names(flt.filter(state, request(headers={"x-session-token": token(1)}), EPS)) == [1]
    assert names(flt.filter(state, request(headers={"x-session-token": token(1)}), [EPS[0], EPS[2]])) == [0, 2]
    assert names(flt.filter(state, request(headers={"x-session-token": "%%%"}), EPS)) == [0, 1, 2]
    assert names(flt.filter(state, request(), EPS)) == [0, 1, 2]


def test_the_response_carries_the_token_of_the_profiles_pick():
    decode = make_plugin("session-affinity-filter")
    prefill = make_plugin("session-affinity-filter", {"profileName": "prefill",
                                                      "encodedEndpointHeaderConfig": {"header": "X-Session-Token-Prefill"}},
                          name="session-affinity-prefill")
    state, response = CycleState(), ResponseInfo(status="200")
    for flt in (decode, prefill):
        flt.pre_request(state, request(), picked(0, prefill=2))
        flt.on_response_headers(state, request(), response, EPS[0])
    assert response.set_headers == {"x-session-token": token(0), "x-session-token-prefill": token(2)}


def test_session_id_binds_after_the_first_pick_and_rebinds_when_its_endpoint_leaves():
    flt = make_plugin("session-affinity-filter", {"strategy": "session_id"})
    req = request(headers={"x-session-id": "s1"})
    assert names(flt.filter(CycleState(), req, EPS)) == [0, 1, 2]  # unbound: no preference
    flt.pre_request(CycleState(), req, picked(2))
    assert names(flt.filter(CycleState(), req, EPS)) == [2]
    assert names(flt.filter(CycleState(), req, EPS[:2])) == [0, 1]  # gone: all, then bound anew
    flt.pre_request(CycleState(), req, picked(1))
    assert names(flt.filter(CycleState(), req, EPS)) == [1]
    response = ResponseInfo(status="200")
    flt.on_response_headers(CycleState(), req, response, EPS[1])
    assert response.set_headers == {}  # nothing is written back to the client


def test_session_id_bindings_idle_out():
    flt = make_plugin("session-affinity-filter", {"strategy": "session_id",
                                                   "sessionIdConfig": {"evictionTtlSeconds": 0.05}})
    req = request(headers={"x-session-id": "s1"})
    flt.pre_request(CycleState(), req, picked(2))
    assert names(flt.filter(CycleState(), req, EPS)) == [2]
    time.sleep(0.06)
    assert names(flt.filter(CycleState(), req, EPS)) == [0, 1, 2]


def test_the_agent_identity_attribute_is_the_session_the_session_producer_found():
    flt = make_plugin("session-affinity-filter", {"strategy": "session_id", "sessionIdConfig": {
        "sources": [{"header": "x-session-id"}, {"attribute": "agent-identity"}]}})
    state = CycleState()
    state.put(SESSION, SessionKey("claude-42", source="x-claude-code-session-id"))
    flt.pre_request(state, request(), picked(1))
    again = CycleState()
    again.put(SESSION, SessionKey("claude-42"))
    assert names(flt.filter(again, request(), EPS)) == [1]
    assert names(flt.filter(CycleState(), request(), EPS)) == [0, 1, 2]  # no session producer ran: no session
    with pytest.raises(ConfigError, match="'tenant' is not published here; allowed: agent-identity"):
        make_plugin("session-affinity-filter", {"strategy": "session_id",
                                                "sessionIdConfig": {"sources": [{"attribute": "tenant"}]}})


# -- utilization-filter --------------------------------------------------------------------------

def test_drops_endpoints_over_any_cap_as_in_the_readme_example():
    flt = make_plugin("utilization-filter", {"conditions": [
        {"metric": "running-requests", "maxValue": 40}, {"metric": "waiting-queue", "maxValue": 0},
        {"metric": "kv-cache-utilization", "maxValue": 0.8}]})
    pool = [endpoint(0, running=40), endpoint(1, running=41), endpoint(2, queue=1), endpoint(3, kv=0.81),
            endpoint(4, kv=0.8)]
    assert [ep.name for ep in flt.filter(CycleState(), request(), pool)] == [pool[0].name, pool[4].name]


def test_none_left_is_none_unless_fallback_on_empty():
    busy = [endpoint(0, queue=3), endpoint(1, queue=5)]
    caps = {"conditions": [{"metric": "waiting-queue", "maxValue": 2}]}
    assert make_plugin("utilization-filter", caps).filter(CycleState(), request(), busy) == []
    assert make_plugin("utilization-filter", {**caps, "fallbackOnEmpty": True}).filter(
        CycleState(), request(), busy) == busy


def test_active_requests_come_from_the_in_flight_load_and_are_zero_without_it():
    flt = make_plugin("utilization-filter", {"conditions": [{"metric": "active-requests", "maxValue": 2}]})
    assert flt.consumes() == {INFLIGHT_LOAD}
    state = CycleState()
    state.put_endpoint_data(INFLIGHT_LOAD, EPS[0].name, InflightLoad(3, 0))
    state.put_endpoint_data(INFLIGHT_LOAD, EPS[1].name, InflightLoad(2, 0))
    assert names(flt.filter(state, request(), EPS)) == [1, 2]


@pytest.mark.parametrize("params, message", [
    ({}, "'conditions' needs at least one"),
    ({"conditions": [{"metric": "gpu", "maxValue": 1}]}, "'conditions[0].metric' must be one of"),
    ({"conditions": [{"metric": "waiting-queue"}]}, "'conditions[0].maxValue' is required"),
    ({"conditions": [{"metric": "waiting-queue", "maxValue": -1}]}, "must be a non-negative number"),
    ({"conditions": [{"metric": "kv-cache-utilization", "maxValue": 80}]}, "must be at most 1"),
])
def test_conditions_are_checked(params, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        make_plugin("utilization-filter", params)


# -- header-profile-handler ----------------------------------------------------------------------

STAGES = HEAD + """plugins:
- type: prefill-filter
- type: decode-filter
- type: header-profile-handler
schedulingProfiles:
- name: prefill
  plugins:
  - pluginRef: prefill-filter
- name: decode
  plugins:
  - pluginRef: decode-filter
"""
ROLES = [endpoint(0, labels={"llm-d.ai/role": "prefill"}), endpoint(1, labels={"llm-d.ai/role": "decode"})]


async def test_the_header_names_the_one_profile_that_runs_and_decode_is_the_default():
    harness = DirectorHarness(STAGES)
    harness.set_pool(ROLES)
    result, _ = await harness.pick(request(headers={"epp-profile": "prefill"}))
    assert (result.primary_profile, result.targets[0].name) == ("prefill", ROLES[0].name)
    assert list(result.profile_results) == ["prefill"]
    result, _ = await harness.pick(request(headers={"epp-profile": "  "}))
    assert (result.primary_profile, result.targets[0].name) == ("decode", ROLES[1].name)


async def test_a_profile_no_one_configured_is_the_clients_error():
    harness = DirectorHarness(STAGES)
    harness.set_pool(ROLES)
    with pytest.raises(InferenceError) as err:
        await harness.pick(request(headers={"epp-profile": "encode"}))
    assert err.value.code.http_status == 400 and "'encode', which is no scheduling profile" in str(err.value)
    other_default = STAGES.replace("- type: header-profile-handler\n",
                                   "- type: header-profile-handler\n  parameters: {defaultProfile: encode, "
                                   "headerName: X-Stage}\n")
    harness = DirectorHarness(other_default)
    harness.set_pool(ROLES)
    with pytest.raises(InferenceError, match="no 'x-stage' header, and defaultProfile 'encode'"):
        await harness.pick(request())
    result, _ = await harness.pick(request(headers={"x-stage": "decode"}))
    assert result.primary_profile == "decode"


async def test_with_one_profile_it_always_runs():
    one = HEAD + "plugins:\n- type: header-profile-handler\n- type: queue-scorer\nschedulingProfiles:\n" \
                 "- name: only\n  plugins:\n  - pluginRef: queue-scorer\n"
    loaded = load_config_text(one)
    assert loaded.scheduler.handler.type_name == "header-profile-handler"
    harness = DirectorHarness(one)
    harness.set_pool(EPS)
    result, _ = await harness.pick(request(headers={"epp-profile": "prefill"}))
    assert result.primary_profile == "only"
