"""P/D disaggregation plugins: the profile handler's decision, the prefiller header, role filters."""

import pytest
from prometheus_client import CollectorRegistry

from epp.config import load_config_text
from epp.framework import (
    PREFILLER_HOST_PORT_HEADER,
    ConfigError,
    CycleState,
    ErrorCode,
    InferenceError,
    PluginContext,
    ProfileRunResult,
    SchedulingResult,
)
from epp.framework.datakeys import PREFIX_MATCH_INFO, PREFIX_TIER_MATCH, PrefixMatchInfo, TierMatch
from epp.scorers.pd import uncached_prompt_tokens
from tests.support.configs import as_yaml, pd_config, sample_config
from tests.support.scheduling import DirectorHarness, builtin_registry, endpoint, make_plugin, request

ROLE = "llm-d.ai/role"
PREFILL = [endpoint(0, labels={ROLE: "prefill"}), endpoint(1, labels={ROLE: "prefill"})]
DECODE = [endpoint(2, labels={ROLE: "decode"}), endpoint(3, labels={ROLE: "decode"})]


def load(threshold: int, registry: CollectorRegistry | None = None) -> DirectorHarness:
    return DirectorHarness(pd_config(threshold), source="pd.yaml", metrics_registry=registry)


def prompt(tokens: int, seed: str = "a") -> str:
    """About `tokens` tokens by the picker's 4-characters-per-token estimate."""
    return (seed * 4 * tokens)[: 4 * tokens]


def picked(result, profile):
    run = result.profile_results.get(profile)
    return run.targets[0].name if run is not None else None


# (case, prompt tokens, threshold, expect a remote prefill)
@pytest.mark.parametrize("case, tokens, threshold, remote", [
    ("long prompt, nothing cached", 2000, 512, True),
    ("short prompt stays on the decode replica", 100, 512, False),
    ("exactly the threshold disaggregates", 512, 512, True),
    ("threshold 0 always disaggregates", 3, 0, True),
])
async def test_decision_by_uncached_prompt_length(case, tokens, threshold, remote):
    picker = load(threshold)
    result, state = await picker.cycle(request(prompt(tokens)), PREFILL + DECODE)
    assert result.primary_profile == "decode", case
    assert result.targets[0].labels[ROLE] == "decode", case  # the decode endpoint is the destination
    prefill = picked(result, "prefill")
    if remote:
        assert prefill in {ep.name for ep in PREFILL}, case
        assert state.request_headers() == {PREFILLER_HOST_PORT_HEADER: prefill}, case
    else:
        assert prefill is None, case
        assert PREFILLER_HOST_PORT_HEADER not in state.request_headers(), case


async def test_a_prefix_cached_on_the_decode_replica_makes_the_remote_prefill_unnecessary():
    picker = load(512)
    shared = prompt(1500, "s")
    first, _ = await picker.cycle(request(shared), PREFILL + DECODE)
    assert picked(first, "prefill") is not None
    # The same long prompt again plus a short question: the decode pick already holds the prefix
    # (approximate index), so only ~100 tokens are uncached there.
    second, state = await picker.cycle(request(shared + prompt(100, "q")), PREFILL + DECODE)
    assert picked(second, "decode") == picked(first, "decode")
    assert picked(second, "prefill") is None
    decision = state.get("pd-profile-handler")
    assert decision.source == "approximate" and not decision.disaggregate
    assert decision.uncached_tokens < 512
    # A different long prompt is uncached everywhere: disaggregated again.
    third, _ = await picker.cycle(request(prompt(1500, "t")), PREFILL + DECODE)
    assert picked(third, "prefill") is not None


async def test_no_prefill_endpoint_leaves_the_request_aggregated():
    registry = CollectorRegistry()
    picker = load(0, registry)
    result, state = await picker.cycle(request(prompt(2000)), DECODE)
    assert picked(result, "decode") in {ep.name for ep in DECODE}
    assert "prefill" not in result.profile_results
    assert PREFILLER_HOST_PORT_HEADER not in state.request_headers()
    assert registry.get_sample_value("epp_pd_decisions_total", {"decision": "no-prefiller"}) == 1


async def test_decisions_are_counted():
    registry = CollectorRegistry()
    picker = load(512, registry)
    await picker.cycle(request(prompt(2000)), PREFILL + DECODE)
    await picker.cycle(request(prompt(10, "z")), PREFILL + DECODE)
    await picker.cycle(request(prompt(3000, "y")), PREFILL + DECODE)
    assert registry.get_sample_value("epp_pd_decisions_total", {"decision": "prefill-decode"}) == 2
    assert registry.get_sample_value("epp_pd_decisions_total", {"decision": "decode-only"}) == 1


async def test_unlabelled_replicas_only_decode_and_both_replicas_take_either_role():
    # llm-d's roles: no role label means decode only; the deprecated `both` is prefill and decode.
    pool = [endpoint(0), endpoint(1, labels={ROLE: "both"})]
    result, state = await load(0).cycle(request(prompt(2000)), pool)
    assert picked(result, "decode") in {ep.name for ep in pool}
    assert picked(result, "prefill") == pool[1].name
    assert state.request_headers()[PREFILLER_HOST_PORT_HEADER] == pool[1].hostport


async def test_only_prefill_replicas_is_unschedulable():
    with pytest.raises(InferenceError) as info:
        await load(0).cycle(request(prompt(2000)), PREFILL)
    assert info.value.code is ErrorCode.RESOURCE_EXHAUSTED


async def test_each_profile_runs_its_own_scorers():
    # Queue depth: prefill 0 is busy, prefill 1 idle; decode 2 busy, decode 3 idle.
    pool = [endpoint(0, queue=9, labels={ROLE: "prefill"}), endpoint(1, labels={ROLE: "prefill"}),
            endpoint(2, queue=9, labels={ROLE: "decode"}), endpoint(3, labels={ROLE: "decode"})]
    result, state = await load(0).cycle(request(prompt(2000)), pool)
    assert picked(result, "prefill") == pool[1].name
    assert picked(result, "decode") == pool[3].name
    assert state.request_headers()[PREFILLER_HOST_PORT_HEADER] == pool[1].hostport


# (case, tier match on the decode endpoint, expected uncached tokens)
@pytest.mark.parametrize("case, tiers, expected", [
    ("nothing cached", TierMatch(0, 0, 0, 4096), 4096),
    ("half on GPU", TierMatch(2048, 0, 0, 4096), 2048),
    ("CPU and disk count as cached", TierMatch(1024, 1024, 1024, 4096), 1024),
    ("all cached", TierMatch(4096, 0, 0, 4096), 0),
])
def test_precise_match_gives_exact_uncached_tokens(case, tiers, expected):
    state, ep = CycleState(), DECODE[0]
    state.put_endpoint_data(PREFIX_TIER_MATCH, ep.name, tiers)
    # A tier-weighted block count is there too; the exact token counts win over it.
    state.put_endpoint_data(PREFIX_MATCH_INFO, ep.name, PrefixMatchInfo(1.0, 256, 16))
    assert uncached_prompt_tokens(state, request("x" * 10), ep) == (expected, "precise"), case


def test_approximate_and_estimated_uncached_tokens():
    state, ep = CycleState(), DECODE[0]
    req = request("x" * 4000)  # about 1000 tokens
    assert uncached_prompt_tokens(state, req, ep) == (1000, "estimate")
    state.put_endpoint_data(PREFIX_MATCH_INFO, ep.name, PrefixMatchInfo(40, 62, 16))
    assert uncached_prompt_tokens(state, req, ep) == (1000 - 640, "approximate")


@pytest.mark.parametrize("params, message", [
    ({"threshold": -1}, "must be >= 0"),
    ({"threshold": "long"}, "must be an integer"),
    ({"decodeProfile": "x", "prefillProfile": "x"}, "must differ"),
])
def test_handler_parameters_are_checked(params, message):
    with pytest.raises(ConfigError, match=message):
        make_plugin("pd-profile-handler", params, context=PluginContext())


def test_handler_needs_both_profiles():
    document = sample_config("pd")
    next(p for p in document["schedulingProfiles"] if p["name"] == "prefill")["name"] = "prefil"
    text = as_yaml(document)
    with pytest.raises(ConfigError, match=r"missing \['prefill'\], unexpected \['prefil'\]"):
        load_config_text(text, source="pd.yaml", registry=builtin_registry())


def test_header_handler_ignores_a_result_without_prefill():
    hook = make_plugin("prefill-header-handler")
    state = CycleState()
    hook.pre_request(state, request(), SchedulingResult({"decode": ProfileRunResult((DECODE[0],))}, "decode"))
    assert not state.request_headers()
    hook.pre_request(state, request(), SchedulingResult(
        {"decode": ProfileRunResult((DECODE[0],)), "prefill": ProfileRunResult((PREFILL[1],))}, "decode"))
    assert state.request_headers() == {PREFILLER_HOST_PORT_HEADER: PREFILL[1].hostport}


@pytest.mark.parametrize("name", [":path", "Content-Length", "host", ""])
def test_plugins_cannot_set_framing_or_pseudo_headers(name):
    with pytest.raises(ValueError, match="may not set the request header"):
        CycleState().set_request_header(name, "x")
