"""session-affinity-cost-scorer on a fleet whose costs the test sets: stay while waiting is cheaper than moving."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import pytest
from prometheus_client import CollectorRegistry

from epp.framework import (
    PREFIX_CACHE_FREE_BLOCKS,
    PREFIX_TIER_MATCH,
    SESSION,
    ConfigError,
    CycleState,
    Endpoint,
    PluginContext,
    ProfileRunResult,
    ResponseInfo,
    SchedulingResult,
    SessionKey,
    TierMatch,
)
from epp.framework.types import EndpointMetrics, InferenceRequest
from epp.scorers.predicted_ttft import PredictedTTFTScorer
from epp.scorers.session_routing import SessionAffinityCostScorer, SessionHome
from epp.scorers.ttft_calibration import features
from tests.support.scheduling import DirectorHarness, endpoint, make_plugin

# Costs the test sets: 1 ms per uncached prompt token, 1 s per waiting request, CPU/disk loads.
COSTS = {"baseSeconds": 0.01, "prefillSecondsPerToken": 0.001, "queueSecondsPerWaitingRequest": 1.0,
         "secondsPerRunningRequest": 0.0, "cpuLoadSecondsPerToken": 0.0001, "diskLoadSecondsPerToken": 0.0005}


def config(**scorer: object) -> str:
    params = ", ".join(f"{k}: {v}" for k, v in {"ttftScorerName": "predicted-ttft-scorer", **scorer}.items())
    costs = ", ".join(f"{k}: {v}" for k, v in COSTS.items())
    return f"""
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: agent-identity
- type: predicted-ttft-scorer
  parameters: {{{costs}}}
- type: session-affinity-cost-scorer
  parameters: {{{params}}}
schedulingProfiles:
- name: default
  plugins: [{{pluginRef: session-affinity-cost-scorer}}]
"""


def turn(tokens: int, session: str = "s1", rid: str = "r") -> InferenceRequest:
    """A chat turn of `tokens` prompt tokens (4 characters each) in `session`."""
    return InferenceRequest(rid, "completions", "m", "m", {"prompt": "x" * (4 * tokens)},
                            headers={"x-session-id": session})


class Fleet:
    """Two replicas A and B behind the real director; the test sets their queues, KV use and hit rates."""

    def __init__(self, **scorer: object) -> None:
        self.harness = DirectorHarness(config(**scorer))
        self.scorer = next(e.plugin for e in self.harness.loaded.plugins
                           if isinstance(e.plugin, SessionAffinityCostScorer))
        self.pool = [endpoint(0), endpoint(1)]
        self.harness.set_pool(self.pool)

    def set(self, index: int, **metrics: object) -> None:
        ep = self.pool[index]
        self.pool[index] = dataclasses.replace(ep, metrics=dataclasses.replace(ep.metrics, **metrics))
        self.harness.set_pool(self.pool)

    def index_of(self, name: str) -> int:
        return [ep.name for ep in self.pool].index(name)

    async def send(self, req: InferenceRequest, completion: int = 200) -> str:
        """One turn, answered with its usage (prompt and output tokens); returns where it went."""
        result, state = await self.harness.pick(req)
        target = result.targets[0]
        prompt = len(req.body["prompt"]) // 4
        self.harness.director.response_complete(state, req, ResponseInfo(
            status="200", end_of_stream=True, usage={"prompt_tokens": prompt, "completion_tokens": completion}),
            target)
        return target.name


async def first_turn(fleet: Fleet) -> tuple[int, int]:
    """Turn 1 (1000 prompt tokens, 200 out): returns (home, other) indexes."""
    home = fleet.index_of(await fleet.send(turn(1000)))
    return home, 1 - home


async def test_the_next_turn_stays_while_waiting_there_is_cheaper_than_recomputing_elsewhere():
    fleet = Fleet()
    home, other = await first_turn(fleet)
    # Turn 2: 1500 tokens, of which the 1200 of turn 1 (prompt + output) are cached at home.
    # Home: 0.01 + 1 waiting x 1 s + 300 x 1 ms = 1.31 s; other: 0.01 + 1500 x 1 ms = 1.51 s.
    fleet.set(home, waiting_queue_size=1)
    assert fleet.index_of(await fleet.send(turn(1500))) == home
    assert fleet.scorer.decisions["stay"] == 1


async def test_it_moves_when_waiting_costs_more_than_recomputing_and_is_sticky_at_its_new_home():
    fleet = Fleet()
    home, other = await first_turn(fleet)
    fleet.set(home, waiting_queue_size=2)  # 2.31 s at home against 1.51 s elsewhere
    assert fleet.index_of(await fleet.send(turn(1500))) == other
    assert fleet.scorer.decisions["move"] == 1
    # The session now lives on `other`: its next turn stays there though `home` is idle again.
    fleet.set(home, waiting_queue_size=0)
    assert fleet.index_of(await fleet.send(turn(2000))) == other


async def test_a_turn_that_arrives_before_its_previous_turns_completion_finds_that_prompt_at_home():
    # The agent has the whole answer before the picker reads the response's end: turn 2 can be picked first.
    fleet = Fleet()
    result, _ = await fleet.harness.pick(turn(1500))
    home = fleet.index_of(result.targets[0].name)
    fleet.set(home, waiting_queue_size=1)
    # Home: 0.01 + 1 s waiting + 100 x 1 ms = 1.11 s (turn 1's 1,500 prompt tokens are there); other: 1.61 s.
    assert fleet.index_of(await fleet.send(turn(1600))) == home
    assert fleet.scorer.decisions["stay"] == 1


def displacement_fleet(**params: object) -> tuple[SessionAffinityCostScorer, PredictedTTFTScorer, list[Endpoint]]:
    """The session scorer on the test's fixed costs; home A holds the session's 1,200 tokens, B is a hot, full cache.

    B: 100 blocks of 16 tokens (as `cache_config_info` says), 10 of them free as its prefix producer sees it,
    and 80 % of the prompt tokens it served found in its cache (the predictor learns that from usage).
    """
    context = PluginContext(metrics_registry=CollectorRegistry())
    predictor = make_plugin("predicted-ttft-scorer", COSTS, context=context)
    plugin = make_plugin("session-affinity-cost-scorer", {"ttftScorerName": "predicted-ttft-scorer", **params},
                         context=context)
    assert isinstance(plugin, SessionAffinityCostScorer) and isinstance(predictor, PredictedTTFTScorer)
    plugin.bind_plugins({"ttftScorerName": predictor})
    hot = Endpoint("10.0.0.2", 8000, metrics=EndpointMetrics(cache_num_blocks=100, cache_block_size=16))
    for _ in range(20):
        booking = context.load.pick(hot.name, prompt_tokens=1000, uncached_tokens=200)
        context.load.first_token(booking)
        context.load.complete(booking, ResponseInfo(status="200", usage={
            "prompt_tokens": 1000, "prompt_tokens_details": {"cached_tokens": 800}}))
    plugin.sessions.put("s1", SessionHome(A.name, 1200))
    return plugin, predictor, [A, hot]


def turn_state(hot: Endpoint) -> CycleState:
    state = state_for("s1", {})
    state.put_endpoint_data(PREFIX_CACHE_FREE_BLOCKS, hot.name, 10)
    return state


def test_moving_pays_for_what_it_would_displace_on_the_new_endpoint():
    plugin, predictor, (home, hot) = displacement_fleet()
    state = turn_state(hot)
    # Turn 2, 1,500 tokens, 1,200 at home. Home with 2 waiting: 0.01 + 2 x 1 s + 300 x 1 ms = 2.31 s.
    # B: 0.01 + 1,500 x 1 ms = 1.51 s, and its 94 new blocks evict 84 there, each read again with
    # chance 0.8: + 0.8 x 84 x 16 x 1 ms = 1.075 s, predicted-ttft-scorer's own term, charged once.
    home = dataclasses.replace(home, metrics=EndpointMetrics(waiting_queue_size=2))
    costs = plugin.costs(state, turn(1500), [home, hot], plugin.sessions.get("s1"))
    assert costs[home.name] == pytest.approx(2.31)
    assert costs[hot.name] == pytest.approx(1.51 + 0.8 * 84 * 16 * 0.001)
    charged = predictor.cost_terms(state, hot, TierMatch(0, 0, 0, 1500), 1500, "m")
    assert (charged.evicted_blocks, charged.reuse) == (84, pytest.approx(0.8))
    assert costs[hot.name] == pytest.approx(charged.ttft_s + charged.displacement_s)
    assert max(scores(plugin, state, [home, hot]).items(), key=lambda kv: kv[1])[0] == home.name
    # A third waiting request at home (3.31 s) costs more than the move with what it evicts (2.585 s).
    home = dataclasses.replace(home, metrics=EndpointMetrics(waiting_queue_size=3))
    assert max(scores(plugin, state, [home, hot]).items(), key=lambda kv: kv[1])[0] == hot.name


def test_without_displacement_the_same_fleet_moves():
    plugin, _, (home, hot) = displacement_fleet(displacement=False)
    home = dataclasses.replace(home, metrics=EndpointMetrics(waiting_queue_size=2))
    costs = plugin.costs(turn_state(hot), turn(1500), [home, hot], plugin.sessions.get("s1"))
    assert costs == pytest.approx({home.name: 2.31, hot.name: 1.51})


def test_the_predictors_weight_is_the_one_displacement_setting():
    # predicted-ttft-scorer's displacementWeight: 0 switches the term off for the session scorer too.
    plugin, predictor, (home, hot) = displacement_fleet()
    predictor.displacement_weight = 0.0
    costs = plugin.costs(turn_state(hot), turn(1500), [home, hot], plugin.sessions.get("s1"))
    assert costs[hot.name] == pytest.approx(1.51)


async def test_the_history_estimate_moves_the_context_to_the_cpu_tier_then_forgets_it():
    fleet = Fleet(gpuTierTokens=1600, cpuTierTokens=10000)
    home, other = await first_turn(fleet)
    scorer, home_ep = fleet.scorer, fleet.pool[home]
    record = scorer.sessions.get("s1")
    assert record == SessionHome(home_ep.name, 1200, scorer.written[home_ep.name], 0)
    # Nothing written since: all 1,200 tokens still on the GPU.
    assert scorer.home_tier(record, home_ep, 1200) == TierMatch(1200, 0, 0, 0)
    # 1,000 tokens computed there since (other requests): 2,200 > 1,600, so offloaded to the CPU tier.
    scorer.written[home_ep.name] += 1000
    assert scorer.home_tier(record, home_ep, 1200) == TierMatch(0, 1200, 0, 0)
    # Home costs 0.01 + 0.3 + 1,200 x 0.1 ms = 0.43 s with 0 waiting, 1.43 with 1: still cheaper than 1.51.
    fleet.set(home, waiting_queue_size=1)
    assert fleet.index_of(await fleet.send(turn(1500))) == home
    # Much more written since: gone from every tier, no reason to stay behind a queue.
    scorer.written[home_ep.name] += 20_000
    assert scorer.home_tier(scorer.sessions.get("s1"), home_ep, 1700) == TierMatch(0, 0, 0, 0)
    assert fleet.index_of(await fleet.send(turn(1800))) == other


async def test_requests_without_a_session_are_scored_on_cost_alone():
    fleet = Fleet()
    fleet.set(0, waiting_queue_size=1)
    req = dataclasses.replace(turn(1000), headers={})
    assert await fleet.send(req) == fleet.pool[1].name
    assert fleet.scorer.decisions == {"stay": 0, "move": 0, "new": 0, "none": 1}


def scorer(**params: object) -> SessionAffinityCostScorer:
    plugin = make_plugin("session-affinity-cost-scorer", params,
                         context=PluginContext(metrics_registry=CollectorRegistry()))
    assert isinstance(plugin, SessionAffinityCostScorer)
    return plugin


def state_for(session: str, tiers: dict[str, TierMatch]) -> CycleState:
    state = CycleState()
    state.put(SESSION, SessionKey(session))
    for name, match in tiers.items():
        state.put_endpoint_data(PREFIX_TIER_MATCH, name, match)
    return state


A, B = Endpoint("10.0.0.1", 8000), Endpoint("10.0.0.2", 8000)


def scores(plugin: SessionAffinityCostScorer, state: CycleState, endpoints: Sequence[Endpoint] = (A, B)):
    return plugin.score(state, turn(2000), endpoints)


def test_kv_events_give_the_tiers_exactly():
    plugin = scorer(tierSource="events")
    plugin.sessions.put("s1", SessionHome(A.name, 1800))
    # KV events: A holds the session's 1,800 tokens in its CPU tier; B holds nothing.
    state = state_for("s1", {A.name: TierMatch(0, 1800, 0, 2000), B.name: TierMatch(0, 0, 0, 2000)})
    costs = plugin.costs(state, turn(2000), [A, B], plugin.sessions.get("s1"))
    own = plugin.predictor
    assert own is not None and own.calibrate
    prior = own.calibrator.coefficients(A.name, "m")
    assert costs[A.name] == pytest.approx(prior[0] + 200 * prior[1] + 1800 * prior[3])
    assert costs[B.name] == pytest.approx(prior[0] + 2000 * prior[1])
    assert scores(plugin, state)[A.name] == 1.0


def test_the_home_keeps_the_turn_within_its_predictions_typical_error():
    plugin = scorer(tierSource="events")
    predictor = plugin.predictor
    assert predictor is not None
    # A's fit has seen noisy first tokens: its typical error is about 0.2 s.
    for i in range(60):
        x = features(1000, 0, 0, 0)
        predictor.calibrator.observe(A.name, "m", x, 0.25 + (0.4 if i % 2 else 0.0), now=float(i))
    margin = plugin.margin_s(A.name, "m")
    assert margin > 0.05
    plugin.sessions.put("s1", SessionHome(A.name, 1900))
    costs = plugin.costs(state_for("s1", {A.name: TierMatch(1900, 0, 0, 2000), B.name: TierMatch(1950, 0, 0, 2000)}),
                         turn(2000), [A, B], plugin.sessions.get("s1"))
    assert costs[B.name] < costs[A.name] < costs[B.name] + margin  # B looks cheaper, within A's error
    result = scores(plugin, state_for("s1", {A.name: TierMatch(1900, 0, 0, 2000),
                                             B.name: TierMatch(1950, 0, 0, 2000)}))
    assert result[A.name] == 1.0 and result[B.name] < 1.0


def test_a_new_sessions_first_turn_is_not_placed_by_calibration_noise():
    plugin = scorer(tierSource="events")
    predictor = plugin.predictor
    assert predictor is not None
    # Both fits have seen first tokens jittering by +-0.1 s just now; B's came out 5 ms dearer than A's.
    now = time.monotonic()
    for i in range(60):
        jitter = 0.1 if i % 2 else -0.1
        predictor.calibrator.observe(A.name, "m", features(1000, 0, 0, 0), 0.300 + jitter, now=now)
        predictor.calibrator.observe(B.name, "m", features(1000, 0, 0, 0), 0.305 + jitter, now=now)
    cold = {A.name: TierMatch(0, 0, 0, 2000), B.name: TierMatch(0, 0, 0, 2000)}
    costs = plugin.costs(state_for("new", cold), turn(2000), [A, B], None)
    assert costs[A.name] < costs[B.name]
    assert scores(plugin, state_for("new", cold)) == {A.name: 1.0, B.name: 1.0}


def crowded_fleet(**params: object) -> SessionAffinityCostScorer:
    """The test's fixed costs; A and B idle, each 1,600 GPU tokens and 2,000 CPU-tier tokens; A's active sessions
    keep 3,000 tokens of context there between their turns, B's none."""
    context = PluginContext(metrics_registry=CollectorRegistry())
    predictor = make_plugin("predicted-ttft-scorer", COSTS, context=context)
    plugin = make_plugin("session-affinity-cost-scorer", {"ttftScorerName": "predicted-ttft-scorer",
                                                          "gpuTierTokens": 1600, "cpuTierTokens": 2000, **params},
                         context=context)
    assert isinstance(plugin, SessionAffinityCostScorer) and isinstance(predictor, PredictedTTFTScorer)
    plugin.bind_plugins({"ttftScorerName": predictor})
    for _ in range(10):  # half the fleet's recent prompt tokens came from cache
        booking = context.load.pick(A.name, prompt_tokens=1000, uncached_tokens=500)
        context.load.first_token(booking)
        context.load.complete(booking, ResponseInfo(status="200", usage={
            "prompt_tokens": 1000, "prompt_tokens_details": {"cached_tokens": 500}}))
    for i in range(3):
        plugin.sessions.put(f"active{i}", SessionHome(A.name, 1000))
        plugin.footprint.record(f"active{i}", A.name, 1000)
    return plugin


def test_a_new_session_is_charged_the_contexts_it_would_push_out_of_a_crowded_replica():
    plugin = crowded_fleet()
    cold = {A.name: TierMatch(0, 0, 0, 1000), B.name: TierMatch(0, 0, 0, 1000)}
    # A first turn of 1,000 tokens; the active sessions' mean context is 1,000 tokens. On A, 3,000 + 1,000
    # tokens of context: 1,000 more beyond its GPU (into the CPU tier, 0.1 ms a token to load back) and 400
    # of them beyond its 3,600 tokens of tiers (1 ms a token to prefill again), each read again with the
    # fleet's reuse 0.5. B holds nothing: no charge. The prefill itself costs the same on both (1.01 s).
    costs = plugin.costs(state_for("new", cold), turn(1000), [A, B], None)
    assert costs[B.name] == pytest.approx(1.01)
    assert costs[A.name] == pytest.approx(1.01 + 0.5 * (600 * 0.0001 + 400 * 0.001))
    assert plugin.score(state_for("new", cold), turn(1000), [A, B])[B.name] == 1.0
    assert plugin.score(state_for("new", cold), turn(1000), [A, B])[A.name] < 1.0


def test_without_crowding_the_first_turn_is_a_tie():
    plugin = crowded_fleet(crowding=False)
    cold = {A.name: TierMatch(0, 0, 0, 1000), B.name: TierMatch(0, 0, 0, 1000)}
    assert plugin.score(state_for("new", cold), turn(1000), [A, B]) == {A.name: 1.0, B.name: 1.0}


def test_the_home_pays_no_crowding_for_the_session_it_already_holds():
    plugin = crowded_fleet()
    state = state_for("active0", {A.name: TierMatch(1000, 0, 0, 1200), B.name: TierMatch(0, 0, 0, 1200)})
    costs = plugin.costs(state, turn(1200), [A, B], plugin.sessions.get("active0"))
    assert costs[A.name] == pytest.approx(0.01 + 200 * 0.001)
    assert costs[B.name] == pytest.approx(0.01 + 1200 * 0.001)  # B has room for the session's 1,200 tokens


def test_sessions_idle_past_the_active_window_leave_the_footprint():
    plugin = crowded_fleet(activeWindow="30s")
    assert plugin.footprint.tokens_on(A.name) == 3000
    plugin.footprint.sweep(time.monotonic() + 31)
    assert plugin.footprint.tokens_on(A.name) == 0
    assert plugin.footprint.sessions.evictions["idle"] == 3


async def test_each_turn_moves_its_sessions_footprint_with_it():
    fleet = Fleet()
    home, other = await first_turn(fleet)
    footprint, names = fleet.scorer.footprint, [ep.name for ep in fleet.pool]
    assert footprint.tokens_on(names[home]) == 1200  # turn 1: 1,000 prompt + 200 output tokens
    fleet.set(home, waiting_queue_size=2)
    assert fleet.index_of(await fleet.send(turn(1500))) == other  # waiting costs more than moving
    assert (footprint.tokens_on(names[home]), footprint.tokens_on(names[other])) == (0, 1700)


def test_a_sub_agents_first_turn_prefers_its_parents_home_among_equals():
    plugin = scorer()
    plugin.sessions.put("parent", SessionHome(B.name, 500))
    state = CycleState()
    state.put(SESSION, SessionKey("child", "parent", "x-session-id"))
    result = plugin.score(state, turn(100), [A, B])
    assert result[B.name] > result[A.name]


def test_the_session_table_is_bounded():
    plugin = scorer(maxSessions=100)
    for i in range(5000):
        state = CycleState()
        state.put(SESSION, SessionKey(f"s{i}"))
        plugin.pre_request(state, turn(10), SchedulingResult({"default": ProfileRunResult((A,))}, "default"))
        plugin.on_response_complete(state, turn(10), ResponseInfo(status="200"), A)
    assert len(plugin.sessions) == 100 and plugin.sessions.evictions["capacity"] == 4900
    footprint = plugin.footprint.sessions
    assert len(footprint) == 100 and footprint.evictions["capacity"] == 4900
    assert plugin.footprint.tokens_on(A.name) == 100 * 10


def test_the_named_cost_source_must_be_a_predicted_ttft_scorer():
    harness_config = config().replace("predicted-ttft-scorer\n  parameters", "queue-scorer\n  parameters: {}\n"
                                      "- type: predicted-ttft-scorer\n  name: unused\n  parameters")
    harness_config = harness_config.replace("ttftScorerName: predicted-ttft-scorer", "ttftScorerName: queue-scorer")
    with pytest.raises(ConfigError, match="name a predicted-ttft-scorer"):
        DirectorHarness(harness_config)
