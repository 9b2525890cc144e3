"""llm-d plugin types no other module covered, with llm-d's documented semantics: multimodal embeddings
cache affinity, the soft reflective ceiling, topology-aware P/D, DCGM GPU utilization with the endpoint
attribute filter and scorer, the DisaggregatedSet rollout screener, the probabilistic admitter, the
token-producer's media estimate, and data-parallel rank ports for KV events."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import struct
import time
import zlib

import pytest

from epp.datalayer.dcgm import DcgmDataSource, DcgmExtractor, gpu_utilization
from epp.flowcontrol.soft_ceiling import SoftReflectiveCeilingPolicy
from epp.framework import PROFILE_RESULTS_STATE_KEY, ConfigError, CycleState, InferenceError
from epp.kvevents.subscriber import SubscriberConfig
from epp.scorers.endpoint_attributes import ENDPOINT_ATTRIBUTES
from epp.scorers.mm_embeddings import ENCODER_CACHE_MATCH, media_items
from epp.scorers.topology import TOPOLOGY, Topology
from epp.tokenization.estimate import EstimateSettings, image_size
from tests.support.scheduling import DirectorHarness, endpoint, make_plugin, request

V1 = "apiVersion: llm-d.ai/v1\nkind: EndpointPickerConfig\n"


def fresh(ep):
    """The endpoint with metrics scraped just now (detectors treat old metrics as saturation)."""
    return dataclasses.replace(ep, metrics=dataclasses.replace(ep.metrics, update_time=time.monotonic()))


def chat(*parts, request_id: str = "r1"):
    """A chat request whose one user message holds `parts` (content blocks)."""
    body = {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "what is this?"},
                                                                     *parts]}]}
    return request(body=body, model="m", request_id=request_id, api="chat/completions")


def image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


# ---- mm-embeddings-cache-producer / -scorer -------------------------------------------------------

MM = V1 + """plugins:
- {type: mm-embeddings-cache-producer, parameters: {cacheSizeInMBPerServer: 4}}
- type: mm-embeddings-cache-scorer
- type: queue-scorer
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - {pluginRef: mm-embeddings-cache-scorer, weight: 4}
  - {pluginRef: queue-scorer, weight: 1}
  - pluginRef: max-score-picker
"""


def test_media_items_are_identified_by_content_and_counted_once():
    items = media_items(chat(image("https://x/a.png"), image("https://x/a.png"),
                             {"type": "video_url", "video_url": {"url": "v.mp4"}},
                             {"type": "input_audio", "input_audio": {"data": "UklGR", "format": "wav"}}))
    assert sorted(items.values()) == ["audio", "image", "video"]
    anthropic = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBOR"}}]}]}
    assert list(media_items(request(body=anthropic, model="m", api="messages")).values()) == ["image"]
    assert media_items(chat()) == {}


async def test_a_repeated_image_goes_back_to_the_endpoint_that_encoded_it():
    harness = DirectorHarness(MM)
    pool = [fresh(endpoint(0, queue=0)), fresh(endpoint(1, queue=3))]
    first, _ = await harness.cycle(chat(image("https://x/cat.png")), pool)
    assert first.targets[0].name == pool[0].name  # no match anywhere: the shorter queue
    pool = [fresh(endpoint(0, queue=5)), fresh(endpoint(1, queue=0))]
    again, state = await harness.pick(chat(image("https://x/cat.png"), request_id="r2"), pool)
    matches = state.all_endpoint_data(ENCODER_CACHE_MATCH)
    assert (matches[pool[0].name].matched, matches[pool[0].name].total) == (1, 1)
    assert matches[pool[1].name].matched == 0
    assert again.targets[0].name == pool[0].name  # the cache outweighs the queue (weight 4)
    other, state = await harness.pick(chat(image("https://x/dog.png"), request_id="r3"), pool)
    assert other.targets[0].name == pool[1].name and not any(
        m.matched for m in state.all_endpoint_data(ENCODER_CACHE_MATCH).values())


async def test_the_cache_holds_size_over_2_mib_items_per_endpoint_and_forgets_a_removed_endpoint():
    harness = DirectorHarness(MM)
    producer = harness.loaded.plugin("mm-embeddings-cache-producer")
    assert producer.capacity == 2  # 4 MiB at llm-d's 2 MiB per item
    assert make_plugin("mm-embeddings-cache-producer", {"cacheSizeInMBPerServer": 0}).capacity == 2048
    pool = [fresh(endpoint(0))]
    for i, url in enumerate(("a", "b", "c")):
        await harness.cycle(chat(image(url), request_id=f"r{i}"), pool)
    _, state = await harness.pick(chat(image("a"), image("c"), request_id="r9"), pool)
    assert state.all_endpoint_data(ENCODER_CACHE_MATCH)[pool[0].name].matched == 1  # "a" was evicted
    harness.set_pool([fresh(endpoint(1))])
    assert producer.debug_state()["endpoints"] == {}


def test_the_scorer_without_media_scores_zero_and_a_scorer_alone_gets_its_producer():
    loaded = DirectorHarness(V1 + "plugins:\n- type: mm-embeddings-cache-scorer\n").loaded
    assert [e.type_name for e in loaded.plugins if e.auto_created] .count("mm-embeddings-cache-producer") == 1
    scorer = make_plugin("mm-embeddings-cache-scorer")
    assert scorer.score(CycleState(), request("hi"), [endpoint(0)]) == {endpoint(0).name: 0.0}


# ---- soft-reflective-ceiling-policy ---------------------------------------------------------------

def test_reflective_ceilings_open_lower_bands_below_their_ceiling_and_alternate_past_it():
    policy = SoftReflectiveCeilingPolicy("p")
    assert policy.ceilings([10], 0.9) == {10: 1.0}  # one band: never gated
    assert policy.ceilings([10, 0, -10], 0.3) == {10: 1.0, 0: 1.0, -10: 1.0}  # below every reflective ceiling
    # saturation 0.5: band 1's ceiling is 0.75 (open); band 2's is 0.5, reached: open one call in round(0.5/0.5)
    assert policy.ceilings([10, 0, -10], 0.5) == {10: 1.0, 0: 1.0, -10: 1.0}
    # saturation 0.8: band 1's ceiling 0.6 and band 2's 0.2 are passed: both open one call in round(0.8/0.2) = 4,
    # on the same calls (one shared tick)
    rounds = [policy.ceilings([10, 0, -10], 0.8) for _ in range(8)]
    assert [r[10] for r in rounds] == [1.0] * 8
    assert [r[0] for r in rounds] == [r[-10] for r in rounds] and sorted(r[0] for r in rounds) == [0.0] * 6 + [1.0] * 2
    assert policy.ceilings([10, 0, -10], 1.0) == {10: 1.0, 0: 0.0, -10: 0.0}  # saturated: only the top band


def test_the_policy_takes_no_parameters_and_serves_flow_control_when_named():
    with pytest.raises(ConfigError, match="unknown parameter"):
        make_plugin("soft-reflective-ceiling-policy", {"minCeiling": 0.2})
    harness = DirectorHarness(V1 + """featureGates: [flowControl]
plugins:
- type: soft-reflective-ceiling-policy
- type: queue-scorer
flowControl: {usageLimitPolicyPluginRef: soft-reflective-ceiling-policy}
""")
    assert isinstance(harness.loaded.flow_controller.config.usage_limit, SoftReflectiveCeilingPolicy)


# ---- topology-extractor / -affinity-filter / -affinity-scorer -------------------------------------

TOPO = V1 + """plugins:
- type: prefill-filter
- type: decode-filter
- type: queue-scorer
- type: max-score-picker
- {type: topology-extractor, parameters: {hostname: host}}
- {type: topology-affinity-filter, parameters: {minAffinity: %s}}
- type: topology-affinity-scorer
- type: always-disagg-pd-decider
- {type: disagg-profile-handler, parameters: {deciders: {prefill: always-disagg-pd-decider}}}
schedulingProfiles:
- name: decode
  plugins: [{pluginRef: decode-filter}, {pluginRef: queue-scorer}, {pluginRef: max-score-picker}]
- name: prefill
  plugins:
  - pluginRef: prefill-filter
  - pluginRef: topology-affinity-filter
  - {pluginRef: queue-scorer, weight: 1}
  - {pluginRef: topology-affinity-scorer, weight: 1}
  - pluginRef: max-score-picker
"""
RACK = "topology.kubernetes.io/rack"


def topo_pool():
    role = "llm-d.ai/role"
    return [fresh(endpoint(0, labels={role: "decode", "host": "h1", RACK: "r1"})),
            fresh(endpoint(1, queue=4, labels={role: "prefill", "host": "h1", RACK: "r1"})),
            fresh(endpoint(2, queue=0, labels={role: "prefill", "host": "h2", RACK: "r1"})),
            fresh(endpoint(3, queue=0, labels={role: "prefill", "host": "h3", RACK: "r2"}))]


async def test_the_prefill_pick_stays_on_the_decode_pick_s_host():
    harness = DirectorHarness(TOPO % "host")
    pool = topo_pool()
    result, state = await harness.pick(request("x" * 200), pool)
    assert result.targets[0].name == pool[0].name
    assert result.profile_results["prefill"].targets[0].name == pool[1].name  # same host despite its queue
    assert state.endpoint_data(TOPOLOGY, pool[3].name) == Topology("h3", "r2")


async def test_with_rack_affinity_the_scorer_grades_host_over_rack_and_the_filter_drops_other_racks():
    harness = DirectorHarness(TOPO % "rack")
    pool = topo_pool()
    _, state = await harness.pick(request("x" * 200), pool)
    state.get(PROFILE_RESULTS_STATE_KEY).pop("prefill")  # as the prefill profile saw it: the decode pick only
    scorer = harness.loaded.plugin("topology-affinity-scorer")
    scores = scorer.score(state, request("x"), pool[1:])
    assert scores == {pool[1].name: 1.0, pool[2].name: 0.2, pool[3].name: 0.0}
    kept = harness.loaded.plugin("topology-affinity-filter").filter(state, request("x"), pool[1:])
    assert [ep.name for ep in kept] == [pool[1].name, pool[2].name]


def test_without_a_peer_topology_the_filter_keeps_all_and_the_scorer_gives_zero():
    flt = make_plugin("topology-affinity-filter")
    scorer = make_plugin("topology-affinity-scorer")
    eps = [endpoint(0), endpoint(1)]
    assert flt.filter(CycleState(), request("x"), eps) == eps
    assert set(scorer.score(CycleState(), request("x"), eps).values()) == {0.0}
    assert Topology().shared_level(Topology()) is None  # empty never matches empty
    with pytest.raises(ConfigError, match="minAffinity"):
        make_plugin("topology-affinity-filter", {"minAffinity": "planet"})


# ---- dcgm-data-source / -extractor, endpoint-attribute-filter / -scorer ---------------------------

DCGM_PAGE = """# HELP DCGM_FI_DEV_GPU_UTIL GPU utilization (in %).
# TYPE DCGM_FI_DEV_GPU_UTIL gauge
DCGM_FI_DEV_GPU_UTIL{gpu="0",UUID="GPU-a"} 35
DCGM_FI_DEV_GPU_UTIL{gpu="1",UUID="GPU-b"} 95
DCGM_FI_DEV_FB_USED{gpu="0"} 1000
"""

GPU = V1 + """plugins:
- {type: dcgm-data-source, name: dcgm-source, parameters: {port: %d, interval: 1s}}
- {type: dcgm-extractor, name: dcgm-extractor}
- type: endpoint-attribute-filter
  name: gpu-filter
  parameters:
    attribute: GPUUtilization
    producer: dcgm-extractor
    onMissing: Pass
    fallbackOnEmpty: true
    algorithm: {type: threshold, threshold: {operator: LessThanOrEqual, value: 0.9}}
- type: endpoint-attribute-scorer
  name: gpu-scorer
  parameters:
    attributeKey: GPUUtilization
    producer: dcgm-extractor
    algorithm: {type: linear_lower_is_better, normalization: {fixedRange: {min: 0.0, max: 1.0}}}
- type: max-score-picker
dataLayer:
  sources:
  - pluginRef: dcgm-source
    extractors: [{pluginRef: dcgm-extractor}]
schedulingProfiles:
- name: default
  plugins: [{pluginRef: gpu-filter}, {pluginRef: gpu-scorer, weight: 2}, {pluginRef: max-score-picker}]
"""


def test_gpu_utilization_is_the_highest_gpu_as_a_fraction():
    assert gpu_utilization(DCGM_PAGE) == pytest.approx(0.95)
    assert gpu_utilization("# nothing\n") is None


async def test_the_dcgm_source_scrapes_each_endpoint_and_the_filter_and_scorer_read_its_attribute():
    pages = {"127.0.0.1": DCGM_PAGE.replace(" 95", " 20"), "127.0.0.2": DCGM_PAGE}  # 35 % and 95 %

    async def handle(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        body = pages[writer.get_extra_info("sockname")[0]].encode()
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()
        writer.close()

    servers = [await asyncio.start_server(handle, host, 0) for host in ("127.0.0.1", "127.0.0.2")]
    port = servers[0].sockets[0].getsockname()[1]
    servers[1].close()
    servers[1] = await asyncio.start_server(handle, "127.0.0.2", port)
    try:
        harness = DirectorHarness(GPU % port)
        pool = [dataclasses.replace(fresh(endpoint(0)), address="127.0.0.1"),
                dataclasses.replace(fresh(endpoint(1)), address="127.0.0.2"),
                dataclasses.replace(fresh(endpoint(2)), address="127.0.0.3")]  # no exporter there
        harness.set_pool(pool)
        source = harness.loaded.plugin("dcgm-source")
        assert isinstance(source, DcgmDataSource) and isinstance(source.extractors[0], DcgmExtractor)
        await source.poll_once()
        result, state = await harness.pick(request("hi"))
        values = {name: attrs["dcgm-extractor/GPUUtilization"]
                  for name, attrs in state.all_endpoint_data(ENDPOINT_ATTRIBUTES).items()}
        assert values == {pool[0].name: pytest.approx(0.35), pool[1].name: pytest.approx(0.95)}
        assert result.targets[0].name in (pool[0].name, pool[2].name)  # 95 % filtered out; .3 missing: Pass
        scores = harness.loaded.plugin("gpu-scorer").score(state, request("hi"), pool)
        assert scores == {pool[0].name: pytest.approx(0.65), pool[1].name: pytest.approx(0.05), pool[2].name: 0.0}
        await source.stop()
    finally:
        for server in servers:
            server.close()


def test_attribute_plugins_refuse_what_they_cannot_read():
    with pytest.raises(ConfigError, match="'producer' is required here"):
        make_plugin("endpoint-attribute-scorer", {"attributeKey": "num_requests_running",
                                                  "algorithm": {"type": "linear_lower_is_better"}})
    with pytest.raises(ConfigError, match="'algorithm' must be"):
        make_plugin("endpoint-attribute-filter", {"attribute": "a", "producer": "p", "algorithm": {"type": "topK"}})
    with pytest.raises(ConfigError, match="useNodeAddress"):
        make_plugin("dcgm-data-source", {"useNodeAddress": True})
    flt = make_plugin("endpoint-attribute-filter", {
        "attribute": "a", "producer": "p", "onMissing": "Fail",
        "algorithm": {"type": "threshold", "threshold": {"operator": "GreaterThan", "value": 1}}})
    state = CycleState()
    state.put_endpoint_data(ENDPOINT_ATTRIBUTES, endpoint(0).name, {"p/a": 2.0})
    assert [ep.name for ep in flt.filter(state, request("x"), [endpoint(0), endpoint(1)])] == [endpoint(0).name]
    adaptive = make_plugin("endpoint-attribute-scorer", {"attributeKey": "a", "producer": "p",
                                                         "algorithm": {"type": "linear_higher_is_better"}})
    state.put_endpoint_data(ENDPOINT_ATTRIBUTES, endpoint(1).name, {"p/a": 4.0})
    assert adaptive.score(state, request("x"), [endpoint(0), endpoint(1), endpoint(2)]) == {
        endpoint(0).name: 0.0, endpoint(1).name: 1.0, endpoint(2).name: 0.0}


def test_a_dcgm_source_outside_the_data_layer_sources_is_refused():
    with pytest.raises(ConfigError, match="dcgm-data-source 'dcgm-data-source' is in no source"):
        DirectorHarness(V1 + "plugins:\n- type: dcgm-data-source\n- type: dcgm-extractor\n")


# ---- disaggregatedset-rollout-screener ------------------------------------------------------------

ROLLOUT = V1 + """plugins:
- type: disaggregatedset-rollout-screener
  parameters:
    scope: {labelSelector: "app=ds"}
    revisionGating: {mode: %s, requireRoles: {values: [prefill, decode]}}
    headerSelectors:
    - {name: rev, headerName: x-revision, labelKey: disaggregatedset.x-k8s.io/revision, mode: strict}
- type: queue-scorer
"""
REV, ROLE = "disaggregatedset.x-k8s.io/revision", "disaggregatedset.x-k8s.io/role"


def ds(idx: int, revision: str, role: str):
    return fresh(endpoint(idx, labels={"app": "ds", REV: revision, ROLE: role}))


async def test_one_covered_revision_serves_each_request_weighted_by_its_dominant_role():
    harness = DirectorHarness(ROLLOUT % "max-role")
    pool = [ds(0, "old", "prefill"), ds(1, "old", "decode"), ds(2, "old", "decode"), ds(3, "old", "decode"),
            ds(4, "new", "prefill"), ds(5, "new", "decode"), ds(6, "new", "prefill")]
    screener = harness.loaded.plugin("disaggregatedset-rollout-screener")
    assert screener.shares(pool) == {"old": 0.75, "new": 0.25}  # decode dominates (4 of 7): 3 to 1
    seen = set()
    for i in range(40):
        result, _ = await harness.cycle(request("x", request_id=f"r{i}"), pool)
        seen.add(result.targets[0].labels[REV])
    assert seen == {"old", "new"}
    result, _ = await harness.pick(request("x", headers={"x-revision": "new"}, request_id="h"), pool)
    assert result.targets[0].labels[REV] == "new"
    assert DirectorHarness(ROLLOUT % "sum").loaded.plugin(
        "disaggregatedset-rollout-screener").shares(pool) == {"old": 4 / 7, "new": 3 / 7}


async def test_no_revision_with_every_role_fails_closed():
    harness = DirectorHarness(ROLLOUT % "max-role")
    with pytest.raises(InferenceError, match="no DisaggregatedSet revision has a Ready endpoint of every role"):
        await harness.pick(request("x"), [ds(0, "old", "decode"), ds(1, "new", "decode")])


# ---- probabilistic-admitter -----------------------------------------------------------------------

async def test_sheddable_requests_are_shed_with_the_saturation_curve_and_others_pass():
    harness = DirectorHarness(V1 + "plugins:\n- type: probabilistic-admitter\n- type: queue-scorer\n")
    admitter = harness.loaded.plugin("probabilistic-admitter")
    assert admitter.probability(0.1) == pytest.approx(0.1 ** 5 * 300) and admitter.probability(0.5) == 1.0
    saturated = [fresh(endpoint(0, queue=10)), fresh(endpoint(1, queue=10))]
    sheddable = dataclasses.replace(request("x"), priority=-1)
    with pytest.raises(InferenceError, match="request shed"):
        await harness.pick(sheddable, saturated)
    result, _ = await harness.pick(request("x", request_id="r2"), saturated)  # priority 0: admitted
    assert result.targets


# ---- token-producer estimate settings -------------------------------------------------------------

def png(width: int, height: int) -> str:
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    chunk = struct.pack(">I", len(ihdr)) + b"IHDR" + ihdr + struct.pack(">I", zlib.crc32(b"IHDR" + ihdr))
    return "data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\n" + chunk).decode()


def test_estimate_counts_images_from_their_size_and_videos_from_frames():
    settings = EstimateSettings.parse("tp", {"image": {"dynamic": {"factor": 784}},
                                              "video": {"frames": {"mode": "sampled", "sampled": {"sampleFPS": 2}},
                                                        "tokensPerFrame": {"mode": "static",
                                                                           "static": {"numTokensPerFrame": 64}}}})
    assert image_size(png(448, 448)) == (448, 448)
    body = {"model": "m", "messages": [{"role": "user", "content": [
        image(png(448, 448)), {"type": "video_url", "video_url": {"url": "v.mp4"}}]}]}
    chat_with_media = request(body=body, model="m", api="chat/completions",
                              headers={"x-llm-d-video-duration-seconds": "3"})
    ids = settings.media_token_ids(chat_with_media)
    assert len(ids) == 448 * 448 // 784 + 3 * 2 * 64
    # The same image in an Anthropic message: sized from its base64 data, the same placeholder count.
    anthropic = request(body={"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": png(448, 448).partition(",")[2]}}]}]}, model="m", api="messages")
    assert len(settings.media_token_ids(anthropic)) == 448 * 448 // 784
    with pytest.raises(ConfigError, match="staticToken"):
        EstimateSettings.parse("tp", {"image": {"mode": "static"}})


# ---- data-parallel ranks on consecutive ports -----------------------------------------------------

def test_each_rank_subscribes_at_its_offset_ports():
    config = SubscriberConfig(events_port=5557, replay_port=5600, rank_port_base=8000, ranks_per_host=8)
    assert [config.rank_offset(dataclasses.replace(endpoint(0), port=p)) for p in (8000, 8003, 8007, 8008, 7999)] \
        == [0, 3, 7, 0, 0]
    assert SubscriberConfig().rank_offset(dataclasses.replace(endpoint(0), port=8003)) == 0
