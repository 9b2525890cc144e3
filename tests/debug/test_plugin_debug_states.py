"""Each stateful plugin's `debug_state`: sizes, capacities, counts and learned values, never request content."""

from __future__ import annotations

import json

from prometheus_client import CollectorRegistry

from epp.framework import PluginContext, ProfileRunResult, ResponseInfo, SchedulingResult
from epp.framework.plugin import CycleState
from epp.kvevents import producer as precise_prefix
from epp.kvevents.decoding import decode_batch
from epp.scorers.ttft_calibration import TERMS
from tests.kvevents import wire
from tests.support.scheduling import DirectorHarness, endpoint, make_plugin, request

SECRET = "a prompt the debug state must never contain"
A, B = endpoint(0), endpoint(1)


def shown(plugin) -> dict:
    """The plugin's state as the debug page shows it (JSON), checked free of request content."""
    text = json.dumps(plugin.debug_state())
    assert SECRET not in text and "session-" not in text
    return json.loads(text)


def picked(ep, profile: str = "default") -> SchedulingResult:
    return SchedulingResult({profile: ProfileRunResult((ep,))}, profile)


def test_the_precise_producer_shows_its_index_blocks_per_endpoint():
    registry = precise_prefix.PluginRegistry()
    precise_prefix.register(registry)
    prod = registry.build("precise-prefix-cache-producer", "precise",
                          {"blockSizeTokens": 4, "subscribe": False}, PluginContext(metrics_registry=CollectorRegistry()))
    for ep, event in ((A, wire.stored([1, 2], list(range(8)))), (B, wire.stored([7, 8, 9], list(range(100, 112))))):
        prod.index.apply_batch(ep.name, decode_batch(wire.encode_batch([event])), "m")
    assert shown(prod) == {"index_backend": "InMemoryKVIndex", "block_size_tokens": 4,
                           "engine_blocks": {A.name: 2, B.name: 3}}


async def test_the_approximate_producer_shows_what_each_endpoint_holds():
    harness = DirectorHarness()  # GIE's default pipeline: approx-prefix-cache-producer
    harness.set_pool([endpoint(0, block_size=16, num_blocks=1000), endpoint(1, block_size=16, num_blocks=1000)])
    result, _ = await harness.cycle(request(SECRET * 20))
    state = shown(harness.loaded.plugin("approx-prefix-cache-producer"))
    [(holder, held)] = state["endpoints"].items()
    assert holder == result.targets[0].name
    assert state["entries"] == held["held"] > 0 and held["capacity"] == 1000
    assert state["chain_aware"] is True and state["chars_per_token"] == 4.0


async def test_in_flight_trackers_show_requests_and_tokens_per_endpoint():
    for type_name in ("active-request-scorer", "inflight-load-producer"):
        plugin = make_plugin(type_name)
        state = CycleState()
        plugin.pre_request(state, request(SECRET), picked(A))
        tracked = shown(plugin)
        assert (tracked["tracked"], tracked["capacity"], tracked["requests"]) == (1, 100_000, {A.name: 1})
        assert set(tracked["tokens"]) <= {A.name} and tracked["timeout_s"] == plugin.tracker.timeout_s
        plugin.on_response_complete(state, request(SECRET), ResponseInfo(status="200"), A)
        assert shown(plugin)["tracked"] == 0 and shown(plugin)["requests"] == {}


def test_session_affinity_counts_sessions_without_naming_them():
    scorer = make_plugin("session-affinity-scorer", {"strategy": "session_id"})
    for i in range(3):
        scorer.pre_request(CycleState(), request(headers={"x-session-id": f"session-{i}"}), picked(A))
    assert shown(scorer) == {"strategy": "session_id", "sessions": 3, "max_sessions": 100_000, "ttl_s": 300.0}


def test_no_hit_lru_lists_its_latest_cold_picks():
    scorer = make_plugin("no-hit-lru-scorer")
    for ep in (A, B, A):
        state = CycleState()
        state.put(scorer.name, True)  # the request found no prefix anywhere
        scorer.pre_request(state, request(), picked(ep))
    assert shown(scorer) == {"lru_size": 1024, "tracked": 2, "most_recent_cold_picks": [A.name, B.name]}


async def test_the_ttft_scorer_shows_its_learned_fits():
    config = "\n".join(["apiVersion: inference.networking.x-k8s.io/v1alpha1", "kind: EndpointPickerConfig",
                        "plugins:", "- type: approx-prefix-cache-producer", "  parameters: {publishTierMatch: true}",
                        "- type: predicted-ttft-scorer", "- type: max-score-picker",
                        "schedulingProfiles:", "- name: default", "  plugins:",
                        "  - pluginRef: predicted-ttft-scorer", "  - pluginRef: max-score-picker"])
    harness = DirectorHarness(config)
    scorer = harness.loaded.plugin("predicted-ttft-scorer")
    assert shown(scorer) == {"calibrate": True, "fits": 0, "evicted": 0, "recent": []}
    result, state = await harness.pick(request(SECRET * 10, model="m"), [A])
    harness.director.first_token(state)
    harness.answer(state, request(SECRET * 10, model="m"), result)
    fits = shown(scorer)
    assert fits["fits"] == 1
    [fit] = fits["recent"]
    assert (fit["endpoint"], fit["model"], fit["observations"]) == (A.name, "m", 1)
    assert list(fit["coefficients"]) == list(TERMS)
