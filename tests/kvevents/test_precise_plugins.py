"""precise-prefix-cache-producer and predicted-ttft-scorer: tier weights, speculation, TTFT ranking."""

from __future__ import annotations

import asyncio
import base64
import json
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from epp.datalayer.registry import EndpointRegistry, EndpointSpec
from epp.engine.tinymodel import write_tiny_model
from epp.framework import PluginParams, PluginRegistry
from epp.framework.datakeys import PREFIX_CACHE_FREE_BLOCKS, PREFIX_MATCH_INFO, PREFIX_TIER_MATCH, TierMatch
from epp.framework.errors import ConfigError
from epp.framework.plugin import (
    CycleState,
    PluginContext,
    ProfileRunResult,
    SchedulingResult,
)
from epp.framework.types import Endpoint, EndpointMetrics, InferenceRequest
from epp.kvevents import producer as precise_prefix
from epp.kvevents.decoding import decode_batch
from epp.scorers import predicted_ttft
from epp.scorers.prefix import PrefixCacheScorer
from tests.kvevents import wire
from tests.kvevents.publisher import FakePublisher
from tests.support.requests import format_of

BS = 4
TOKENS = list(range(500, 532))  # 8 blocks of 4
A = Endpoint("10.0.0.1", 8000)
B = Endpoint("10.0.0.2", 8000)


def registry() -> PluginRegistry:
    reg = PluginRegistry()
    precise_prefix.register(reg)
    predicted_ttft.register(reg)
    return reg


def build(type_name, params=None, context=None):
    return registry().build(type_name, type_name, params or {},
                            context or PluginContext(metrics_registry=CollectorRegistry()))


def producer(**params):
    return build("precise-prefix-cache-producer", {"blockSizeTokens": BS, "subscribe": False, **params})


def request(tokens=TOKENS, model="m", salt=None):
    return InferenceRequest("r1", "completions", model, model, {"prompt": list(tokens)}, cache_salt=salt, format=format_of("completions"))


def feed(prod, endpoint, *events):
    prod.index.apply_batch(endpoint.name, decode_batch(wire.encode_batch(list(events))), "m")


async def produce(prod, req=None, endpoints=(A, B)):
    state = CycleState()
    await prod.prepare(state, req or request(), list(endpoints))
    return state


def fractions(state, endpoints=(A, B)):
    scorer = PrefixCacheScorer("p", PluginParams("p", {}), PluginContext())
    return scorer.score(state, request(), list(endpoints))


async def test_both_plugin_types_register_with_their_names():
    assert {"precise-prefix-cache-producer", "predicted-ttft-scorer"} <= set(registry().types())


async def test_match_info_is_tier_weighted_and_tier_match_counts_tokens():
    prod = producer()
    feed(prod, A, wire.stored([1, 2], TOKENS[:8]))                     # 2 blocks on GPU
    feed(prod, B, wire.stored([1, 2, 3, 4], TOKENS[:16], medium="CPU"))  # 4 blocks on CPU
    state = await produce(prod)
    info_a = state.endpoint_data(PREFIX_MATCH_INFO, A.name)
    info_b = state.endpoint_data(PREFIX_MATCH_INFO, B.name)
    assert (info_a.matched_blocks, info_a.total_blocks) == (2.0, 8)
    assert info_b.matched_blocks == pytest.approx(4 * 0.8)
    assert state.endpoint_data(PREFIX_TIER_MATCH, B.name) == TierMatch(0, 16, 0, 32)
    assert state.endpoint_data(PREFIX_TIER_MATCH, A.name) == TierMatch(8, 0, 0, 32)


async def test_free_cache_is_the_scraped_block_count_less_the_blocks_events_stored():
    prod = producer()
    feed(prod, A, wire.stored([1, 2, 3], TOKENS[:12]))
    sized = [Endpoint(ep.address, ep.port, metrics=EndpointMetrics(cache_num_blocks=10, cache_block_size=BS))
             for ep in (A, B)]
    state = await produce(prod, endpoints=sized)
    assert state.all_endpoint_data(PREFIX_CACHE_FREE_BLOCKS) == {A.name: 7, B.name: 10}
    # Cache size not scraped (yet): no room is claimed for the tie-break to read.
    assert (await produce(prod)).all_endpoint_data(PREFIX_CACHE_FREE_BLOCKS) == {}


async def test_tier_weights_change_the_decision_as_configured():
    for weights, winner in (({"cpu": 0.8}, B), ({"cpu": 0.3}, A)):
        prod = producer(tierWeights=weights)
        feed(prod, A, wire.stored([1, 2], TOKENS[:8]))
        feed(prod, B, wire.stored([1, 2, 3, 4], TOKENS[:16], medium="CPU"))
        scores = fractions(await produce(prod))
        assert max(scores, key=scores.get) == winner.name, weights
    prod = producer(tierWeights={"gpu": 1.0, "cpu": 0.8, "disk": 0.25})
    feed(prod, A, wire.stored([1, 2, 3, 4], TOKENS[:16], medium="STORAGE"))
    assert fractions(await produce(prod))[A.name] == pytest.approx(4 * 0.25 / 8)


async def test_salt_and_model_scope_the_match():
    prod = producer()
    feed(prod, A, wire.stored([1, 2], TOKENS[:8]))
    assert (await produce(prod, request(salt="t"))).endpoint_data(PREFIX_MATCH_INFO, A.name).matched_blocks == 0
    assert (await produce(prod, request(model="x"))).endpoint_data(PREFIX_MATCH_INFO, A.name).matched_blocks == 0


async def test_pre_request_claims_the_prefix_on_the_chosen_endpoint_for_the_ttl():
    prod = producer(speculativeTTL="2s")
    state = await produce(prod)
    assert state.endpoint_data(PREFIX_MATCH_INFO, B.name).matched_blocks == 0
    prod.pre_request(state, request(), SchedulingResult({"default": ProfileRunResult((B,))}, "default"))
    again = await produce(prod)
    assert again.endpoint_data(PREFIX_MATCH_INFO, B.name).matched_blocks == 8
    assert again.endpoint_data(PREFIX_MATCH_INFO, A.name).matched_blocks == 0
    prod0 = producer(speculativeTTL=0)
    state0 = await produce(prod0)
    prod0.pre_request(state0, request(), SchedulingResult({"default": ProfileRunResult((B,))}, "default"))
    assert (await produce(prod0)).endpoint_data(PREFIX_MATCH_INFO, B.name).matched_blocks == 0


async def test_claims_skip_the_run_the_endpoint_holds_confirmed_and_renew_a_run_held_by_claims_only():
    prod = producer(speculativeTTL="2s")
    feed(prod, A, wire.stored([1, 2, 3, 4], TOKENS[:16], block_size=BS))  # A holds the first 4 blocks
    claimed: list[tuple[str, list[int]]] = []
    prod.sharing.publish_claim = lambda endpoint, keys: claimed.append((endpoint, list(keys)))
    state = await produce(prod)
    prod.pre_request(state, request(), SchedulingResult({"default": ProfileRunResult((A,))}, "default"))
    keys = list(prod.index.keyer.request_keys(TOKENS, "m"))
    assert claimed == [(A.name, keys[4:])]  # the 4 held blocks are not claimed again
    claimed.clear()
    state = await produce(prod)  # B holds nothing; after the claim on it, it holds all 8 by claim
    prod.pre_request(state, request(), SchedulingResult({"default": ProfileRunResult((B,))}, "default"))
    state = await produce(prod)
    assert state.endpoint_data(PREFIX_MATCH_INFO, B.name).matched_blocks == 8
    prod.pre_request(state, request(), SchedulingResult({"default": ProfileRunResult((B,))}, "default"))
    assert claimed == [(B.name, keys), (B.name, keys)]  # a run held by claims alone is claimed anew


async def test_two_producers_share_one_metrics_registry(tmp_path):
    context = PluginContext(metrics_registry=CollectorRegistry())
    model_dir = write_tiny_model(tmp_path / "tiny", weights=False)
    params = {"blockSizeTokens": BS, "subscribe": False, "tokenizers": {"tiny": str(model_dir)}}
    first = build("precise-prefix-cache-producer", params, context)
    second = build("precise-prefix-cache-producer", params, context)
    feed(second, A, wire.stored([1], TOKENS[:4]))
    assert second.index.entries == 1
    assert context.metrics_registry.get_sample_value("epp_kv_index_entries") == first.index.entries == 0


async def test_bad_parameters_fail_with_the_field_named():
    with pytest.raises(ConfigError, match="tierWeights"):
        producer(tierWeights={"hbm": 1.0})
    with pytest.raises(ConfigError, match="mode"):
        producer(mode="broadcast")
    with pytest.raises(ConfigError, match="unknown parameter"):
        producer(blockSize=16)


async def test_string_prompts_are_tokenized_with_the_models_tokenizer(tmp_path):
    model_dir = write_tiny_model(tmp_path / "tiny", weights=False)
    prod = producer(tokenizers={"tiny": str(model_dir)})
    await prod.start()
    try:
        req = InferenceRequest("r", "completions", "tiny", "tiny", {"prompt": "the cache block " * 20}, format=format_of("completions"))
        tokens = await prod.prompt_tokens(req)
        assert tokens and tokens[0] == prod.tokenizers.load("tiny").special_prefix[0]
        prod.index.apply_batch(A.name, decode_batch(wire.encode_batch([wire.stored([1], list(tokens[:BS]))])), "tiny")
        state = CycleState()
        await prod.prepare(state, req, [A])
        assert state.endpoint_data(PREFIX_MATCH_INFO, A.name).matched_blocks == 1
    finally:
        await prod.stop()


async def test_producer_subscribes_per_endpoint_and_indexes_live_events():
    pub = FakePublisher("kv@10.0.0.1:8000@m")
    endpoints = EndpointRegistry()
    endpoints.set_endpoints([EndpointSpec("127.0.0.1", 8000, {"kv-events-port": str(pub.port),
                                                            "kv-replay-port": str(pub.replay_port)})])
    ep = endpoints.snapshot()[0]
    metrics = CollectorRegistry()
    prod = build("precise-prefix-cache-producer", {"blockSizeTokens": BS},
                 PluginContext(metrics_registry=metrics, endpoints=endpoints))
    await prod.start()
    try:
        def live() -> float:
            return metrics.get_sample_value("epp_kv_events_messages_total", {"source": "live"}) or 0

        await pub.heartbeat_until(lambda: live() > 0)
        await pub.publish([wire.stored([1, 2, 3], TOKENS[:12])])
        for _ in range(500):
            state = await produce(prod, endpoints=[ep])
            if state.endpoint_data(PREFIX_MATCH_INFO, ep.name).matched_blocks == 3:
                break
            await asyncio.sleep(0.01)
        assert state.endpoint_data(PREFIX_MATCH_INFO, ep.name).matched_blocks == 3
    finally:
        await prod.stop()
        await pub.close()


def _ttft(params=None, context=None):
    return build("predicted-ttft-scorer", params, context)


def _endpoint(ip, waiting=0, running=0):
    return Endpoint(ip, 8000, metrics=EndpointMetrics(waiting_queue_size=waiting, running_requests_size=running))


def test_predicted_ttft_prefers_cached_tokens_then_weighs_queue_and_tier_costs():
    scorer = _ttft({"prefillSecondsPerToken": 1e-3, "cpuLoadSecondsPerToken": 1e-4,
                    "diskLoadSecondsPerToken": 5e-4, "queueSecondsPerWaitingRequest": 0.5,
                    "secondsPerRunningRequest": 0.0, "baseSeconds": 0.01})
    gpu, cpu, cold = _endpoint("10.0.0.1"), _endpoint("10.0.0.2"), _endpoint("10.0.0.3")
    state = CycleState()
    state.put_endpoint_data(PREFIX_TIER_MATCH, gpu.name, TierMatch(1000, 0, 0, 1000))
    state.put_endpoint_data(PREFIX_TIER_MATCH, cpu.name, TierMatch(0, 1000, 0, 1000))
    state.put_endpoint_data(PREFIX_TIER_MATCH, cold.name, TierMatch(0, 0, 0, 1000))
    scores = scorer.score(state, request(), [gpu, cpu, cold])
    # T: gpu 0.01, cpu 0.01 + 0.1 = 0.11, cold 0.01 + 1.0 = 1.01
    assert scores[gpu.name] == 1.0
    assert scores[cpu.name] == pytest.approx(0.01 / 0.11)
    assert scores[cold.name] == pytest.approx(0.01 / 1.01)
    # a long queue on the GPU holder makes loading from CPU elsewhere the faster choice
    busy_gpu = _endpoint("10.0.0.1", waiting=2)
    scores = scorer.score(state, request(), [busy_gpu, cpu, cold])
    assert max(scores, key=scores.get) == cpu.name


def test_predicted_ttft_disk_versus_recompute_follows_the_calibration():
    disk, cold = _endpoint("10.0.0.1"), _endpoint("10.0.0.2", waiting=0)
    state = CycleState()
    state.put_endpoint_data(PREFIX_TIER_MATCH, disk.name, TierMatch(0, 0, 1000, 1000))
    state.put_endpoint_data(PREFIX_TIER_MATCH, cold.name, TierMatch(0, 0, 0, 1000))
    fast_disk = _ttft({"diskLoadSecondsPerToken": 1e-5, "prefillSecondsPerToken": 1e-4})
    slow_disk = _ttft({"diskLoadSecondsPerToken": 1e-3, "prefillSecondsPerToken": 1e-4})
    assert fast_disk.score(state, request(), [disk, cold])[disk.name] == 1.0
    assert slow_disk.score(state, request(), [disk, cold])[cold.name] == 1.0


def test_predicted_ttft_without_tier_data_ranks_by_load():
    idle, busy = _endpoint("10.0.0.1"), _endpoint("10.0.0.2", waiting=3, running=4)
    scores = _ttft().score(CycleState(), request(), [idle, busy])
    assert scores[idle.name] == 1.0 and 0.0 < scores[busy.name] < 1.0


def test_predicted_ttft_counts_the_pickers_own_prefills_until_the_next_scrape_shows_them():
    """A burst must not pile onto the endpoint that looked idle at the last scrape."""
    context = PluginContext(metrics_registry=CollectorRegistry())
    scorer = _ttft({"prefillSecondsPerToken": 1e-3, "queueSecondsPerWaitingRequest": 0.5,
                    "secondsPerRunningRequest": 0.0, "baseSeconds": 0.01}, context)
    a, b = _endpoint("10.0.0.1"), _endpoint("10.0.0.2")
    state = CycleState()
    for ep in (a, b):
        state.put_endpoint_data(PREFIX_TIER_MATCH, ep.name, TierMatch(0, 0, 0, 1000))
    assert scorer.score(state, request(), [a, b]) == {a.name: 1.0, b.name: 1.0}
    booking = context.load.pick(a.name, prompt_tokens=1000)  # the director books every pick
    # a now has 1,000 tokens (1 s) of prefill ahead: the next identical request prefers b.
    scores = scorer.score(state, request(), [a, b])
    assert scores[b.name] == 1.0 and scores[a.name] == pytest.approx(1.01 / 2.01, rel=0.01)
    # Once a scrape shows a longer queue than the booking, the scrape wins (max, not sum).
    scraped = _endpoint("10.0.0.1", waiting=4)
    assert scorer.predict(scraped, TierMatch(0, 0, 0, 0), 0) == pytest.approx(0.01 + 2.0)
    # Its first token came back: nothing is ahead any more.
    context.load.first_token(booking)
    assert scorer.score(state, request(), [a, b]) == {a.name: 1.0, b.name: 1.0}
    untracked = _ttft({"trackPendingPrefill": False, "prefillSecondsPerToken": 1e-3}, context)
    context.load.pick(a.name, prompt_tokens=1000)
    assert untracked.predict(a, TierMatch(0, 0, 0, 0), 0) == pytest.approx(0.01)


def test_predicted_ttft_sends_the_next_request_where_the_prefill_ahead_is_nearly_done():
    """Equal work in flight on both: the endpoint that started its prefill first is free first."""
    context = PluginContext(metrics_registry=CollectorRegistry())
    scorer = _ttft({"prefillSecondsPerToken": 2e-4, "baseSeconds": 0.01, "secondsPerRunningRequest": 0.0}, context)
    early, late = _endpoint("10.0.0.1"), _endpoint("10.0.0.2")
    state = CycleState()
    for ep in (early, late):
        state.put_endpoint_data(PREFIX_TIER_MATCH, ep.name, TierMatch(0, 0, 0, 2000))
    now = time.monotonic()
    context.load.pick(early.name, prompt_tokens=2000, now=now - 0.35)  # 0.4 s of prefill at 2e-4
    context.load.pick(late.name, prompt_tokens=2000, now=now)
    scores = scorer.score(state, request(), [early, late])
    assert scores[early.name] == 1.0 and scores[late.name] < 0.75


def test_predicted_ttft_calibrates_itself_from_timed_first_tokens():
    """Without constants it learns the endpoint's prefill cost from the ledger's completed bookings."""
    context = PluginContext(metrics_registry=CollectorRegistry())
    scorer = _ttft({}, context)
    assert scorer.calibrate
    a = _endpoint("10.0.0.1")
    for i in range(60):
        tokens = 500 + 100 * (i % 7)
        booking = context.load.pick(a.name, model="m", prompt_tokens=tokens, now=100.0 + i)
        context.load.first_token(booking, now=100.0 + i + 0.02 + 5e-4 * tokens)  # 0.5 ms/token
        context.load.complete(booking)
    prefill = scorer.calibrator.coefficients(a.name, "m")[1]
    assert prefill == pytest.approx(5e-4, rel=0.05)
    exported = {s.labels["term"]: s.value for m in context.metrics_registry.collect()
                if m.name == "epp_ttft_calibration" for s in m.samples}
    assert exported["prefill_seconds_per_token"] == pytest.approx(prefill)
    # An untimed response (non-streamed: only its end was seen) teaches nothing.
    booking = context.load.pick(a.name, model="m", prompt_tokens=500, now=200.0)
    context.load.first_token(booking, observed=False, now=260.0)
    context.load.complete(booking)
    assert scorer.calibrator.coefficients(a.name, "m")[1] == prefill


CAPTURE = Path(__file__).parents[1] / "fixtures" / "vllm_capture"


@pytest.mark.skipif(not (CAPTURE / "events.json").exists(), reason="no vLLM capture recorded")
async def test_real_vllm_events_and_requests_match_end_to_end(tmp_path):
    """Our tokenizer + key chain on the captured requests finds exactly what vLLM said it cached."""
    manifest = json.loads((CAPTURE / "manifest.json").read_text())
    requests = {r["name"]: r for r in json.loads((CAPTURE / "requests.json").read_text())}
    frames = json.loads((CAPTURE / "events.json").read_text())
    model_dir = write_tiny_model(tmp_path / "tiny", seed=manifest["tiny_model"]["seed"], weights=False)
    block = manifest["block_size"]
    prod = build("precise-prefix-cache-producer", {
        "blockSizeTokens": block, "subscribe": False, "tokenizers": {"tiny": str(model_dir)}})
    replica = Endpoint("127.0.0.1", manifest["http_port"])
    try:
        for frame in frames[:4]:  # prefix_a, prefix_b, chat_turn1, chat_turn2
            prod.index.apply_batch(replica.name, decode_batch(base64.b64decode(frame["payload_b64"])), "tiny")
        for name, blocks in (("chat_turn2", 293 // block), ("prefix_a", 385 // block), ("salted_prefix_a", 0)):
            body = requests[name]["body"]
            api = "chat/completions" if requests[name]["kind"] == "chat" else "completions"
            req = InferenceRequest("r", api, "tiny", "tiny", body, cache_salt=body.get("cache_salt"), format=format_of(api))
            state = CycleState()
            await prod.prepare(state, req, [replica])
            info = state.endpoint_data(PREFIX_MATCH_INFO, replica.name)
            assert info.matched_blocks == blocks, name
            assert state.endpoint_data(PREFIX_TIER_MATCH, replica.name).total_tokens == \
                len(requests[name]["prompt_token_ids"])
    finally:
        await prod.stop()


async def test_a_prompt_no_endpoint_holds_gets_one_rendezvous_home_in_every_picker():
    from epp.framework.datakeys import PREFIX_HOME

    pickers = [producer(rendezvousHome=True), producer(rendezvousHome=True)]
    states = [await produce(p) for p in pickers]
    homes = [dict(s.all_endpoint_data(PREFIX_HOME)) for s in states]
    assert len(homes[0]) == 1 and homes[0] == homes[1]
    [home] = homes[0]
    assert fractions(states[0]) == {A.name: float(home == A.name), B.name: float(home == B.name)}
    # Held somewhere (here: the other endpoint, from its KV events): the index decides, no home.
    other = B if home == A.name else A
    feed(pickers[0], other, wire.stored(list(range(1, 9)), TOKENS))
    held = await produce(pickers[0])
    assert not held.all_endpoint_data(PREFIX_HOME)
    assert fractions(held)[other.name] == 1.0
    # Alone (no peers) and unset: no home, as before the rule.
    assert not (await produce(producer())).all_endpoint_data(PREFIX_HOME)
