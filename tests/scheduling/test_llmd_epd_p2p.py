"""llm-d's E/PD encode stage (encode-filter, always-disagg-multimodal-decider, disagg-profile-handler's
deciders.encode, x-encoder-hosts-ports), the deprecated disagg-headers-handler, and p2p-source-producer."""

from __future__ import annotations

import logging

import pytest

from epp.datalayer.inference_pool import LABEL_ENDPOINT
from epp.framework import (
    ENCODER_HOSTS_PORTS_HEADER,
    KV_CACHE_SOURCE_HEADER,
    KV_CACHE_SOURCE_P2P_PORT_HEADER,
    PREFILLER_HOST_PORT_HEADER,
    PREFIX_MATCH_INFO,
    PREFIX_TIER_MATCH,
    ConfigError,
    CycleState,
    PrefixMatchInfo,
    ProfileRunResult,
    SchedulingResult,
    TierMatch,
)
from epp.scorers.p2p import ENDPOINT_LABEL, endpoint_rank, spread_fraction
from tests.support.scheduling import DirectorHarness, endpoint, make_plugin, request

HEAD = "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\n"
EPD = HEAD + """plugins:
- type: encode-filter
- type: prefill-filter
- type: decode-filter
- type: always-disagg-multimodal-decider
- type: always-disagg-pd-decider
- type: max-score-picker
  name: two
  parameters: {maxNumOfEndpoints: 2}
- type: disagg-profile-handler
  parameters:
    deciders: {prefill: always-disagg-pd-decider, encode: always-disagg-multimodal-decider}
schedulingProfiles:
- name: decode
  plugins: [{pluginRef: decode-filter}]
- name: encode
  plugins: [{pluginRef: encode-filter}, {pluginRef: two}]
- name: prefill
  plugins: [{pluginRef: prefill-filter}]
"""
ROLE = "llm-d.ai/role"
POOL = [endpoint(0, labels={ROLE: "encode"}), endpoint(1, labels={ROLE: "encode"}),
        endpoint(2, labels={ROLE: "prefill"}), endpoint(3, labels={ROLE: "decode"}),
        endpoint(4, labels={ROLE: "encode-prefill-decode"})]
IMAGE = {"type": "image_url", "image_url": {"url": "http://x/cat.png"}}


def chat(*content) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": list(content)}]}


def test_encode_filter_keeps_the_encode_roles():
    kept = make_plugin("encode-filter").filter(CycleState(), request(), POOL)
    assert [ep.name for ep in kept] == [POOL[i].name for i in (0, 1, 4)]


def test_the_multimodal_decider_approves_image_audio_and_video_content_only():
    decider = make_plugin("always-disagg-multimodal-decider")

    def approves(body):
        return decider.disaggregate(CycleState(), request(body=body), POOL[3])

    assert approves(chat({"type": "text", "text": "hi"}, IMAGE))
    assert approves(chat({"type": "input_audio", "input_audio": {"data": "AA", "format": "wav"}}))
    assert approves(chat({"type": "video_url", "video_url": {"url": "http://x/v.mp4"}}))
    assert not approves(chat({"type": "text", "text": "hi"}))
    assert not approves({"model": "m", "prompt": "hi"})


async def test_a_multimodal_request_runs_decode_encode_and_prefill():
    harness = DirectorHarness(EPD)
    harness.set_pool(POOL)
    result, state = await harness.pick(request(body=chat({"type": "text", "text": "what is this?"}, IMAGE)))
    assert result.primary_profile == "decode" and set(result.profile_results) == {"decode", "encode", "prefill"}
    encoders = result.profile_results["encode"].targets
    assert len(encoders) == 2 and all(ep.labels[ROLE].startswith("encode") for ep in encoders)
    headers = state.request_headers()
    assert headers[ENCODER_HOSTS_PORTS_HEADER] == ",".join(ep.hostport for ep in encoders)
    assert headers[PREFILLER_HOST_PORT_HEADER] == result.profile_results["prefill"].targets[0].hostport


async def test_a_text_request_skips_the_encode_stage():
    harness = DirectorHarness(EPD)
    harness.set_pool(POOL)
    result, state = await harness.pick(request(body=chat({"type": "text", "text": "hello"})))
    assert set(result.profile_results) == {"decode", "prefill"}
    assert ENCODER_HOSTS_PORTS_HEADER not in state.request_headers()


def test_an_encode_decider_needs_the_encode_profile():
    without = EPD.replace("- name: encode\n  plugins: [{pluginRef: encode-filter}, {pluginRef: two}]\n", "")
    with pytest.raises(ConfigError, match="missing \\['encode'\\]"):
        DirectorHarness(without)


async def test_the_deprecated_headers_handler_loads_with_a_warning_and_sets_both_headers(caplog):
    config = EPD.replace("- type: disagg-profile-handler", "- type: disagg-headers-handler\n- type: disagg-profile-handler")
    with caplog.at_level(logging.WARNING):
        harness = DirectorHarness(config)
    assert "disagg-headers-handler is deprecated in llm-d; disagg-profile-handler sets" in caplog.text
    handler = harness.loaded.plugin("disagg-headers-handler")
    state = CycleState()
    result = SchedulingResult({"decode": ProfileRunResult((POOL[3],)), "prefill": ProfileRunResult((POOL[2],)),
                               "encode": ProfileRunResult((POOL[0], POOL[1]))}, "decode")
    handler.pre_request(state, request(), result)
    assert state.request_headers() == {PREFILLER_HOST_PORT_HEADER: POOL[2].hostport,
                                       ENCODER_HOSTS_PORTS_HEADER: f"{POOL[0].hostport},{POOL[1].hostport}"}


# -- p2p-source-producer -------------------------------------------------------------------------

PEERS = [endpoint(i) for i in range(4)]


def matched(blocks: dict[int, int], tiers: dict[int, tuple[int, int]] | None = None) -> CycleState:
    """Prefix match (16-token blocks of 100) per endpoint index; `tiers`: (gpu, cpu) tokens per index."""
    state = CycleState()
    for i, count in blocks.items():
        state.put_endpoint_data(PREFIX_MATCH_INFO, PEERS[i].name, PrefixMatchInfo(count, 100, 16))
    for i, (gpu, cpu) in (tiers or {}).items():
        state.put_endpoint_data(PREFIX_TIER_MATCH, PEERS[i].name, TierMatch(gpu, cpu, 0, 1600))
    return state


def computing(i: int, prefill: int | None = None) -> SchedulingResult:
    results = {"decode": ProfileRunResult((PEERS[i],))}
    if prefill is not None:
        results["prefill"] = ProfileRunResult((PEERS[prefill],))
    return SchedulingResult(results, "decode")


async def hint(producer, state, result, req=None) -> str | None:
    req = req or request(request_id="r-1")
    await producer.prepare(state, req, PEERS)
    producer.pre_request(state, req, result)
    return state.request_headers().get(KV_CACHE_SOURCE_HEADER)


async def test_names_the_peer_that_out_caches_the_computing_endpoint():
    producer = make_plugin("p2p-source-producer")
    assert await hint(producer, matched({0: 80, 1: 10}), computing(1)) == PEERS[0].hostport
    assert await hint(producer, matched({0: 80, 1: 10}), computing(0)) is None  # it computes there itself
    assert await hint(producer, matched({}), computing(1)) is None


async def test_min_cached_token_delta_suppresses_short_pulls():
    producer = make_plugin("p2p-source-producer", {"minCachedTokenDelta": 161})
    assert await hint(producer, matched({0: 20, 1: 10}), computing(1)) is None  # 160 tokens more
    producer = make_plugin("p2p-source-producer", {"minCachedTokenDelta": 160})
    assert await hint(producer, matched({0: 20, 1: 10}), computing(1)) == PEERS[0].hostport
    with pytest.raises(ConfigError, match="'minCachedTokenDelta' must be >= 1"):
        make_plugin("p2p-source-producer", {"minCachedTokenDelta": 0})


async def test_the_computing_endpoint_is_the_prefill_pick_when_there_is_one():
    producer = make_plugin("p2p-source-producer")
    assert await hint(producer, matched({0: 80, 2: 80}), computing(1, prefill=2)) is None
    assert await hint(producer, matched({0: 80, 2: 10}), computing(0, prefill=2)) == PEERS[0].hostport


async def test_with_tiers_only_the_sources_cpu_tier_counts():
    producer = make_plugin("p2p-source-producer")
    # Endpoint 0 holds the whole prompt on GPU only: nothing to pull from it; endpoint 1 holds 800 on CPU.
    state = matched({0: 100, 1: 50, 2: 0}, {0: (1600, 0), 1: (0, 800), 2: (0, 0)})
    assert await hint(producer, state, computing(2)) == PEERS[1].hostport


async def test_sources_within_one_block_of_the_best_are_sampled_by_request_and_queue():
    producer = make_plugin("p2p-source-producer")
    ids = [f"req-{i}" for i in range(400)]
    # 0 and 1 are within a block of each other, 2 is two blocks short: never chosen.
    counts = {0: 0, 1: 0, 2: 0}
    for rid in ids:
        chosen = await hint(producer, matched({0: 80, 1: 79, 2: 78}), computing(3), request(request_id=rid))
        counts[[ep.hostport for ep in PEERS].index(chosen)] += 1
    assert counts[2] == 0 and 140 < counts[0] < 260 and counts[0] + counts[1] == 400
    # The same request id always names the same peer.
    first = await hint(producer, matched({0: 80, 1: 79}), computing(3), request(request_id="same"))
    assert all([await hint(producer, matched({0: 80, 1: 79}), computing(3), request(request_id="same"))
                == first for _ in range(5)])
    assert 0.0 <= spread_fraction("anything") < 1.0


async def test_a_queued_peer_is_chosen_less():
    producer = make_plugin("p2p-source-producer")
    queued = [endpoint(0, queue=9), endpoint(1), endpoint(2), endpoint(3)]
    picks = 0
    for i in range(300):
        state = matched({0: 80, 1: 80})
        req = request(request_id=f"q-{i}")
        await producer.prepare(state, req, queued)
        producer.pre_request(state, req, computing(3))
        picks += state.request_headers()[KV_CACHE_SOURCE_HEADER] == queued[0].hostport
    assert picks < 60  # weight 1/10 against 1: about 27 of 300


async def test_p2p_port_base_names_the_sources_p2p_port_by_its_rank():
    # No p2pPortBase: only the host:port hint; the sidecar's --p2p-connector-port applies.
    producer = make_plugin("p2p-source-producer")
    state = matched({0: 80, 1: 10})
    assert await hint(producer, state, computing(1)) == PEERS[0].hostport
    assert KV_CACHE_SOURCE_P2P_PORT_HEADER not in state.request_headers()
    # With it: the base for a one-rank endpoint, base + r for rank r of an InferencePool's targetPorts.
    producer = make_plugin("p2p-source-producer", {"p2pPortBase": 7777})
    state = matched({0: 80, 1: 10})
    assert await hint(producer, state, computing(1)) == PEERS[0].hostport
    assert state.request_headers()[KV_CACHE_SOURCE_P2P_PORT_HEADER] == "7777"
    ranked = [endpoint(0, labels={"llm-epp.io/endpoint": "vllm-0-rank-3"}), *PEERS[1:]]
    state, req = matched({0: 80, 1: 10}), request(request_id="r-1")
    await producer.prepare(state, req, ranked)
    producer.pre_request(state, req, computing(1))
    assert state.request_headers()[KV_CACHE_SOURCE_P2P_PORT_HEADER] == "7780"
    # No hint, no port.
    state = matched({0: 80, 1: 10})
    assert await hint(producer, state, computing(0)) is None and state.request_headers() == {}


def test_p2p_port_base_is_a_port_and_the_rank_comes_from_the_label():
    for bad in (0, 65536, "7777"):
        with pytest.raises(ConfigError, match="p2pPortBase"):
            make_plugin("p2p-source-producer", {"p2pPortBase": bad})
    assert "p2pPortBase=7000" in make_plugin("p2p-source-producer", {"p2pPortBase": 7000}).describe()
    assert ENDPOINT_LABEL == LABEL_ENDPOINT  # the label InferencePool discovery writes `<pod>-rank-<r>` under
    assert endpoint_rank(endpoint(0, labels={"llm-epp.io/endpoint": "pod-a-rank-12"})) == 12
    for label in ({}, {"llm-epp.io/endpoint": "pod-a"}, {"llm-epp.io/endpoint": "pod-rank-x"},
                  {"llm-epp.io/endpoint": "pod-rank-\u00b2"}):
        assert endpoint_rank(endpoint(0, labels=label)) == 0
