"""What a pick displaces: predicted-ttft-scorer charges the expected recompute of the prefixes a request's new
KV blocks would evict, from each endpoint's KV capacity, what the index sees resident and how hot it is."""

from __future__ import annotations

import time

import pytest

from epp.framework import CycleState, PluginContext, ResponseInfo
from epp.framework.datakeys import PREFIX_CACHE_FREE_BLOCKS, PREFIX_TIER_MATCH, TierMatch
from epp.framework.types import Endpoint, EndpointMetrics, InferenceRequest
from tests.support.scheduling import make_plugin

FULL, ROOMY = "10.0.0.1:8000", "10.0.0.2:8000"
PREFILL = 3e-4  # seconds per token, configured
BLOCK = 32
PROMPT = 576  # 18 blocks: a shared-prefix group's system prompt and question


def fleet(cpu_blocks: int = 0) -> list[Endpoint]:
    """Two replicas of 64 KV blocks of 32 tokens each (as `vllm:cache_config_info` says), scraped a second ago."""
    now = time.monotonic()
    return [Endpoint(host, 8000, metrics=EndpointMetrics(update_time=now - 1, cache_num_blocks=64,
                                                         cache_block_size=BLOCK, cache_num_cpu_blocks=cpu_blocks))
            for host in ("10.0.0.1", "10.0.0.2")]


def served(context: PluginContext, endpoint: str, prompt: int, cached: int, times: int = 20) -> None:
    """`times` requests completed on `endpoint`, `cached` of their `prompt` tokens found in its cache."""
    for _ in range(times):
        booking = context.load.pick(endpoint, prompt_tokens=prompt, uncached_tokens=prompt - cached)
        context.load.first_token(booking)
        usage = {"prompt_tokens": prompt, "prompt_tokens_details": {"cached_tokens": cached}}
        context.load.complete(booking, ResponseInfo(status="200", usage=usage))


def pick(params: dict, free: dict[str, int], hot: dict[str, float], *, cpu_blocks: int = 0,
         held: dict[str, int] | None = None) -> tuple[str, dict[str, float], object]:
    """Score a 576-token request no endpoint holds (or `held` tokens of it) with the residency the test sets."""
    context = PluginContext()
    scorer = make_plugin("predicted-ttft-scorer", {"prefillSecondsPerToken": PREFILL, "baseSeconds": 0.01,
                                                   "traceCapacity": 8, **params}, context=context)
    for endpoint, hit_rate in hot.items():
        served(context, endpoint, PROMPT, int(PROMPT * hit_rate))
    state = CycleState()
    for endpoint in (FULL, ROOMY):
        state.put_endpoint_data(PREFIX_TIER_MATCH, endpoint, TierMatch((held or {}).get(endpoint, 0), 0, 0, PROMPT))
        state.put_endpoint_data(PREFIX_CACHE_FREE_BLOCKS, endpoint, free[endpoint])
    request = InferenceRequest("r", "completions", "m", "m", {"prompt": "x"})
    scores = scorer.score(state, request, fleet(cpu_blocks))
    return max(scores, key=scores.__getitem__), scores, scorer


def displacement(scorer: object, endpoint: str) -> float:
    [entry] = scorer.trace.pending.values()  # type: ignore[attr-defined]
    return entry["candidates"][endpoint]["displacement_s"]


def test_a_pick_that_evicts_a_hot_prefix_costs_more_than_one_into_free_space():
    # FULL holds hot prefixes (87.5 % of its tokens served from cache) and has 2 blocks free; ROOMY 40.
    # Both are equally hot: only the room decides.
    choice, scores, scorer = pick({}, free={FULL: 2, ROOMY: 40}, hot={FULL: 0.875, ROOMY: 0.875})
    assert choice == ROOMY and scores[FULL] < scores[ROOMY]
    # 18 new blocks, 2 free: 16 evicted, each read again with chance 0.875 and then 32 tokens of prefill.
    assert displacement(scorer, FULL) == pytest.approx(0.875 * 16 * BLOCK * PREFILL)
    assert displacement(scorer, ROOMY) == 0.0


def test_without_the_term_the_same_pick_is_a_coin_toss_and_it_went_to_the_full_replica_on_noise():
    _, scores, _ = pick({"displacementWeight": 0}, free={FULL: 2, ROOMY: 40}, hot={FULL: 0.875, ROOMY: 0.875})
    assert scores[FULL] == scores[ROOMY] == 1.0


def test_evicting_costs_nothing_where_the_traffic_never_hits():
    # No request ever found anything cached (no sharing): what an eviction pushes out is read by no one.
    _, scores, scorer = pick({}, free={FULL: 0, ROOMY: 40}, hot={FULL: 0.0, ROOMY: 0.0})
    assert displacement(scorer, FULL) == displacement(scorer, ROOMY) == 0.0
    assert scores[FULL] == scores[ROOMY]


def test_a_thrashing_replica_is_no_cheaper_place_to_evict():
    # Both full; FULL's own hit rate is low because its cache thrashes. The chance an evicted block is read
    # again is the fleet's, so both are charged alike and the thrash does not attract the new prefix.
    _, _, scorer = pick({}, free={FULL: 0, ROOMY: 0}, hot={FULL: 0.2, ROOMY: 0.875})
    assert displacement(scorer, FULL) == pytest.approx(displacement(scorer, ROOMY))
    assert displacement(scorer, FULL) == pytest.approx(scorer.reuse.rate() * 18 * BLOCK * PREFILL)
    assert 0.2 < scorer.reuse.rate() < 0.875


def test_a_later_turn_stays_home_on_a_full_cache_its_few_new_blocks_evict_little():
    # FULL holds 512 of the prompt's tokens and has no room: 2 new blocks evict 2 hot ones (0.017 s), against a
    # whole prefill elsewhere (0.17 s) that also evicts 18 blocks from a full ROOMY.
    choice, _, scorer = pick({}, free={FULL: 0, ROOMY: 0}, hot={FULL: 0.875, ROOMY: 0.875}, held={FULL: 512})
    assert choice == FULL
    assert displacement(scorer, FULL) == pytest.approx(0.875 * 2 * BLOCK * PREFILL)


def test_an_offload_tier_makes_an_eviction_cost_its_load_back_not_its_prefill():
    _, _, scorer = pick({"cpuLoadSecondsPerToken": 2e-5}, free={FULL: 2, ROOMY: 40}, hot={FULL: 0.875, ROOMY: 0.875},
                        cpu_blocks=1024)
    assert displacement(scorer, FULL) == pytest.approx(0.875 * 16 * BLOCK * 2e-5)


def test_unknown_capacity_or_residency_charges_nothing():
    context = PluginContext()
    scorer = make_plugin("predicted-ttft-scorer", {"prefillSecondsPerToken": PREFILL}, context=context)
    served(context, FULL, PROMPT, 500)
    state = CycleState()
    state.put_endpoint_data(PREFIX_TIER_MATCH, FULL, TierMatch(0, 0, 0, PROMPT))
    state.put_endpoint_data(PREFIX_TIER_MATCH, ROOMY, TierMatch(0, 0, 0, PROMPT))
    request = InferenceRequest("r", "completions", "m", "m", {"prompt": "x"})
    # No producer said what is free: no displacement, both score alike.
    assert set(scorer.score(state, request, fleet()).values()) == {1.0}


def test_reuse_is_the_fleets_recent_token_hit_rate_from_usage():
    context = PluginContext()
    scorer = make_plugin("predicted-ttft-scorer", {"prefillSecondsPerToken": PREFILL}, context=context)
    assert scorer.reuse.rate() == 0.0  # nothing served: no evidence of reuse
    served(context, FULL, 100, 80, times=60)
    served(context, ROOMY, 100, 0, times=60)
    # The decayed sums weigh recent requests most: ROOMY's misses came last.
    assert 0.0 < scorer.reuse.rate() < 0.4
    served(context, ROOMY, 100, 100, times=2000)
    assert scorer.reuse.rate() == pytest.approx(1.0, abs=1e-3)


def test_the_trace_holds_each_picks_terms_beside_what_happened_bounded():
    context = PluginContext()
    scorer = make_plugin("predicted-ttft-scorer", {"prefillSecondsPerToken": PREFILL, "traceCapacity": 2},
                         context=context)
    request = InferenceRequest("r", "completions", "m", "m", {"prompt": "x"})
    for i in range(3):
        state = CycleState()
        for endpoint in (FULL, ROOMY):
            state.put_endpoint_data(PREFIX_TIER_MATCH, endpoint, TierMatch(64 * i, 0, 0, PROMPT))
            state.put_endpoint_data(PREFIX_CACHE_FREE_BLOCKS, endpoint, 10)
        scorer.score(state, request, fleet())
        booking = context.load.pick(ROOMY, prompt_tokens=PROMPT, uncached_tokens=PROMPT - 64 * i)
        context.load.first_token(booking)
        usage = {"prompt_tokens": PROMPT, "prompt_tokens_details": {"cached_tokens": 32 * i}}
        context.load.complete(booking, ResponseInfo(status="200", usage=usage))
    state = scorer.debug_state()["trace"]
    assert state["capacity"] == 2 and state["pending"] == 0 and state["dropped"] == 0
    first, second = state["picks"]  # the oldest of three went out of the ring
    assert second["picked"] == ROOMY and second["cached_tokens"] == 64 and second["ttft_s"] >= 0
    assert second["candidates"][FULL]["uncached"] == PROMPT - 128 and second["candidates"][FULL]["free_blocks"] == 10
    assert first["candidates"][ROOMY]["uncached"] == PROMPT - 64
    # A pick whose outcome never comes back is dropped once the trace is full.
    for _ in range(3):
        scorer.score(CycleState(), request, fleet())
    assert scorer.trace.dropped == 1 and len(scorer.trace.pending) == 2
