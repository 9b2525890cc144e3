"""Configs of our own, written from the llm-d guides' facts (which plugin types, parameters and values
each guide and sample uses), every one loaded and serving a request through the real director.

Together they use every plugin type and parameter the collected guide corpus uses (the corpus itself,
third-party text, stays outside the project: `tests/support/llmd_corpus.py` checks it). Types another
module of this project implements are marked (`needs`): a build without them fails, naming them.
"""

from __future__ import annotations

import dataclasses
import time

import pytest

from epp.config import load_config_text
from epp.framework import ConfigError, InferenceError
from epp.framework.registry import default_registry
from tests.support.scheduling import DirectorHarness, endpoint, request

V1 = "apiVersion: llm-d.ai/v1\nkind: EndpointPickerConfig\n"
V1ALPHA1 = "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\n"
GIE = "apiVersion: inference.networking.x-k8s.io/v1alpha1\nkind: EndpointPickerConfig\n"
ROLE = "llm-d.ai/role"


def pool(*labels: dict[str, str]):
    """Endpoints with these labels, metrics scraped just now, queues 0, 1, 2..."""
    return [dataclasses.replace(ep, metrics=dataclasses.replace(ep.metrics, update_time=time.monotonic()))
            for ep in (endpoint(i, queue=i, labels=lab) for i, lab in enumerate(labels))]


PLAIN = ({}, {}, {})
PD = ({ROLE: "decode"}, {ROLE: "prefill"}, {ROLE: "decode"}, {ROLE: "prefill"})
WIDE_EP = tuple({"disaggregatedset.x-k8s.io/name": "wide-ep", "disaggregatedset.x-k8s.io/revision": "r1",
                 "disaggregatedset.x-k8s.io/role": role, ROLE: role} for role in ("decode", "prefill", "decode"))
TOPOLOGY = tuple({ROLE: role, "kubernetes.io/hostname": host} for role, host in
                 (("decode", "n1"), ("prefill", "n1"), ("prefill", "n2")))

# (guide fact, config, pool, the types or capabilities another module adds)
GUIDES = [
    ("inference-scheduling: approximate prefix, queue and KV scorers, metrics source", V1 + """featureGates:
- prepareDataPlugins
plugins:
- {type: approx-prefix-cache-producer, parameters: {maxPrefixTokensToMatch: 131072}}
- type: prefix-cache-scorer
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: max-score-picker
- {type: metrics-data-source, parameters: {scheme: http, path: /metrics, insecureSkipVerify: true}}
- type: core-metrics-extractor
dataLayer:
  sources:
  - pluginRef: metrics-data-source
    extractors: [{pluginRef: core-metrics-extractor}]
schedulingProfiles:
- name: default
  plugins:
  - {pluginRef: prefix-cache-scorer, weight: 3}
  - {pluginRef: queue-scorer, weight: 2}
  - {pluginRef: kv-cache-utilization-scorer, weight: 2}
  - pluginRef: max-score-picker
""", PLAIN, ()),
    ("approximate producer without auto-tuning, LRU sized by hand", V1ALPHA1 + """plugins:
- {type: approx-prefix-cache-producer, parameters: {autoTune: false, lruCapacityPerServer: 200000,
   blockSizeTokens: 64, maxPrefixBlocksToMatch: 256}}
- type: prefix-cache-scorer
- {type: random-picker, parameters: {maxNumOfEndpoints: 1}}
- type: single-profile-handler
schedulingProfiles:
- name: default
  plugins: [{pluginRef: prefix-cache-scorer}, {pluginRef: random-picker}]
""", PLAIN, ()),
    ("precise prefix routing in llm-d's nested shape, tokens from vLLM's renderer", V1 + """plugins:
- {type: token-producer, parameters: {modelName: Qwen/Qwen3-32B, vllm: {url: "http://127.0.0.1:9"}}}
- type: precise-prefix-cache-producer
  parameters:
    tokenProcessorConfig: {blockSizeTokens: 64, hashAlgorithm: xxh64}
    indexerConfig:
      kvBlockIndexConfig: {enableMetrics: true, metricsLoggingInterval: 60s, inMemoryConfig: {podCacheSize: 128}}
      kvCacheBackendConfigs: [{name: gpu, weight: 1.0}, {name: cpu, weight: 0.4}]
    kvEventsConfig:
      topicFilter: "kv@"
      concurrency: 4
      engineType: vllm
      discoverPods: true
      podDiscoveryConfig: {socketPort: 5557, replaySocketPort: 5558}
    speculativeIndexing: true
- {type: prefix-cache-scorer, parameters: {prefixMatchInfoProducerName: precise-prefix-cache-producer}}
- {type: no-hit-lru-scorer, parameters: {lruSize: 2048, prefixMatchInfoProducerName: precise-prefix-cache-producer}}
- type: kv-cache-utilization-scorer
- type: queue-scorer
- type: endpoint-notification-source
dataLayer:
  sources:
  - pluginRef: endpoint-notification-source
    extractors: [{pluginRef: precise-prefix-cache-producer}]
schedulingProfiles:
- name: default
  plugins:
  - {pluginRef: prefix-cache-scorer, weight: 3}
  - {pluginRef: no-hit-lru-scorer, weight: 1}
  - {pluginRef: kv-cache-utilization-scorer, weight: 2}
  - {pluginRef: queue-scorer, weight: 2}
""", PLAIN, ()),
    ("precise scorer of llm-d v0.3 (GIE group): kv-cache-manager placements, tokenizer pool, central socket",
     GIE + """plugins:
- type: precise-prefix-cache-scorer
  parameters:
    indexerConfig:
      tokenProcessorConfig: {blockSize: 16, hashSeed: "42"}
      tokenizersPoolConfig: {modelName: Qwen/Qwen2.5-1.5B-Instruct, hf: {tokenizersCacheDir: /cache}}
      kvBlockIndexConfig: {enableMetrics: false}
      speculativeIndexing: false
    kvEventsConfig: {zmqEndpoint: "tcp://*:5557", topicFilter: "kv@", concurrency: 8}
- type: decode-filter
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - {pluginRef: decode-filter}
  - {pluginRef: precise-prefix-cache-scorer, weight: 10}
  - {pluginRef: max-score-picker}
""", PLAIN, ()),
    ("the UDS tokenizer sidecar of llm-d v0.8 (the `tokenizer` type and tokenizersPoolConfig.uds)", V1ALPHA1 + """plugins:
- {type: tokenizer, parameters: {modelName: Qwen/Qwen3-32B, udsTokenizerConfig: {socketFile: /tmp/t.socket}}}
- type: precise-prefix-cache-producer
  parameters:
    tokenProcessorConfig: {blockSize: 64}
    indexerConfig:
      tokenizersPoolConfig: {modelName: Qwen/Qwen3-32B, uds: {socketFile: /tmp/t.socket}}
    kvEventsConfig: {discoverPods: true, podDiscoveryConfig: {socketPort: 5557}}
- {type: prefix-cache-scorer, parameters: {prefixMatchInfoProducerName: precise-prefix-cache-producer}}
schedulingProfiles:
- name: default
  plugins: [{pluginRef: prefix-cache-scorer}]
""", PLAIN, ()),
    ("SGLang KV events; data-parallel ranks on consecutive ports", V1 + """plugins:
- type: precise-prefix-cache-producer
  parameters:
    tokenProcessorConfig: {blockSizeTokens: 16}
    indexerConfig: {tokenizersPoolConfig: {modelName: m}}
    kvEventsConfig:
      engineType: sglang
      discoverPods: true
      dataParallelSizeLocal: 8
      servingPortBase: 8000
      podDiscoveryConfig: {socketPort: 5557, dataParallelSizeTotal: 16}
- {type: prefix-cache-scorer, parameters: {prefixMatchInfoProducerName: precise-prefix-cache-producer}}
""", PLAIN, ()),
    ("data-parallel KV cache sample: both event sockets, the rank header handler", GIE + """plugins:
- type: precise-prefix-cache-scorer
  parameters:
    kvEventsConfig: {zmqEndpoint: "tcp://0.0.0.0:5557", discoverPods: true, podDiscoveryConfig: {socketPort: 5557}}
    indexerConfig: {tokenProcessorConfig: {blockSize: 16}, tokenizersPoolConfig: {modelName: m}}
- type: max-score-picker
- type: dp-rank-header-handler
schedulingProfiles:
- name: default
  plugins: [{pluginRef: precise-prefix-cache-scorer, weight: 10}, {pluginRef: max-score-picker}]
""", PLAIN, ()),
    ("P/D: disagg-profile-handler with the prefix-based decider", V1 + """plugins:
- type: prefill-filter
- type: decode-filter
- type: prefix-cache-scorer
- type: queue-scorer
- type: max-score-picker
- {type: prefix-based-pd-decider, parameters: {nonCachedTokens: 16}}
- {type: disagg-profile-handler, parameters: {deciders: {prefill: prefix-based-pd-decider}}}
schedulingProfiles:
- name: prefill
  plugins: [{pluginRef: prefill-filter}, {pluginRef: queue-scorer}, {pluginRef: max-score-picker}]
- name: decode
  plugins: [{pluginRef: decode-filter}, {pluginRef: prefix-cache-scorer, weight: 2}, {pluginRef: queue-scorer},
            {pluginRef: max-score-picker}]
""", PD, ()),
    ("P/D of llm-d v0.5: the flat decider name, always disaggregate", V1ALPHA1 + """plugins:
- type: prefill-filter
- type: decode-filter
- type: max-score-picker
- type: always-disagg-pd-decider
- {type: disagg-profile-handler, parameters: {deciderPluginName: always-disagg-pd-decider}}
schedulingProfiles:
- name: prefill
  plugins: [{pluginRef: prefill-filter}, {pluginRef: max-score-picker}]
- name: decode
  plugins: [{pluginRef: decode-filter}, {pluginRef: max-score-picker}]
""", PD, ()),
    ("P/D of llm-d v0.3 (GIE group): pd-profile-handler with hashBlockSize, prefill header handler", GIE + """plugins:
- type: prefill-header-handler
- type: prefill-filter
- type: decode-filter
- type: load-aware-scorer
- type: active-request-scorer
- type: max-score-picker
- {type: pd-profile-handler, parameters: {threshold: 0, hashBlockSize: 5}}
schedulingProfiles:
- name: prefill
  plugins: [{pluginRef: prefill-filter}, {pluginRef: load-aware-scorer}, {pluginRef: max-score-picker}]
- name: decode
  plugins: [{pluginRef: decode-filter}, {pluginRef: active-request-scorer}, {pluginRef: max-score-picker}]
""", PD, ()),
    ("data-parallel profile handler (one pod, ranks on target ports)", V1ALPHA1 + """plugins:
- {type: data-parallel-profile-handler, parameters: {primaryPort: 8000}}
- type: queue-scorer
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins: [{pluginRef: queue-scorer}, {pluginRef: max-score-picker}]
""", PLAIN, ()),
    ("wide-EP rollout: one DisaggregatedSet revision per request", V1 + """plugins:
- type: disaggregatedset-rollout-screener
  parameters:
    scope: {labelSelector: "disaggregatedset.x-k8s.io/name=wide-ep"}
    revisionGating: {mode: max-role, requiredRoles: [prefill, decode]}
- type: prefill-filter
- type: decode-filter
- type: random-picker
- type: always-disagg-pd-decider
- {type: disagg-profile-handler, parameters: {deciders: {prefill: always-disagg-pd-decider}}}
schedulingProfiles:
- name: prefill
  plugins: [{pluginRef: prefill-filter}, {pluginRef: random-picker}]
- name: decode
  plugins: [{pluginRef: decode-filter}, {pluginRef: random-picker}]
""", WIDE_EP, ()),
    ("flow control: bands, quantities, eviction, a holdback policy, the utilization detector", V1 + """featureGates:
- flowControl
plugins:
- {type: utilization-detector, parameters: {queueDepthThreshold: 5, kvCacheUtilThreshold: 0.8, headroom: 0.1}}
- {type: priority-holdback-policy, parameters: {shape: linear, domain: rank, minCeiling: 0.5, maxCeiling: 1.0}}
- type: round-robin-fairness-policy
- type: fcfs-ordering-policy
- type: queue-scorer
flowControl:
  maxBytes: 10Gi
  maxRequests: 1k
  defaultRequestTTL: 300s
  enableEviction: true
  usageLimitPolicyPluginRef: priority-holdback-policy
  saturationDetector: {pluginRef: utilization-detector}
  priorityBands:
  - {priority: 100, maxRequests: "500", fairnessPolicyRef: round-robin-fairness-policy,
     orderingPolicyRef: fcfs-ordering-policy}
  - {priority: 60, maxRequests: "500", fairnessPolicyRef: round-robin-fairness-policy,
     orderingPolicyRef: fcfs-ordering-policy}
""", PLAIN, ()),
    ("soft reflective ceiling", V1ALPHA1 + """featureGates: [flowControl]
plugins:
- type: soft-reflective-ceiling-policy
- type: queue-scorer
- type: kv-cache-utilization-scorer
flowControl: {usageLimitPolicyPluginRef: soft-reflective-ceiling-policy}
""", PLAIN, ()),
    ("agentic serving: agent identity, program-aware fairness (older decay form), concurrency detector",
     GIE + """featureGates: [flowControl]
plugins:
- {type: agent-identity, parameters: {additionalSessionHeaders: [x-session-id]}}
- type: program-aware-fairness
  parameters: {strategy: las, lasWeightService: 0.8, lasWeightHeadWait: 0.2, lasDecayFactor: 0.99997}
- {type: concurrency-detector, parameters: {concurrencyMode: requests, headroom: 0.0, maxConcurrency: 10}}
- type: queue-scorer
- type: max-score-picker
flowControl:
  defaultPriorityBand: {fairnessPolicyRef: program-aware-fairness}
  saturationDetector: {pluginRef: concurrency-detector}
schedulingProfiles:
- name: default
  plugins: [{pluginRef: queue-scorer}, {pluginRef: max-score-picker}]
""", PLAIN, ()),
    ("multimodal: embeddings cache affinity, the estimate backend's image and video settings", V1 + """plugins:
- type: token-producer
  parameters:
    estimate:
      image:
        mode: dynamic
        defaultResolution: {width: 1024, height: 1024}
        dynamic: {factor: 784}
      video:
        defaultDuration: 10
        defaultResolution: {width: 640, height: 360}
        maxVideoTokens: 16384
        frames: {mode: sampled, minFrames: 4, maxFrames: 64, sampled: {sampleFPS: 2, temporalPatchSize: 2}}
        tokensPerFrame: {mode: dynamic, dynamic: {factor: 784}}
- {type: mm-embeddings-cache-producer, parameters: {cacheSizeInMBPerServer: 2048}}
- type: mm-embeddings-cache-scorer
- type: endpoint-notification-source
dataLayer:
  sources:
  - pluginRef: endpoint-notification-source
    extractors: [{pluginRef: mm-embeddings-cache-producer}]
schedulingProfiles:
- name: default
  plugins: [{pluginRef: mm-embeddings-cache-scorer, weight: 4}]
""", PLAIN, ()),
    ("GPU utilization from DCGM, the endpoint attribute filter and scorer", V1ALPHA1 + """plugins:
- {type: dcgm-data-source, name: dcgm-source, parameters: {port: 9400, interval: 1s}}
- {type: dcgm-extractor, name: dcgm-extractor}
- type: endpoint-attribute-filter
  parameters:
    attribute: GPUUtilization
    producer: dcgm-extractor
    onMissing: Pass
    fallbackOnEmpty: true
    algorithm: {type: threshold, threshold: {operator: LessThanOrEqual, value: 0.9}}
- type: endpoint-attribute-scorer
  parameters:
    attributeKey: GPUUtilization
    producer: dcgm-extractor
    algorithm: {type: linear_lower_is_better, normalization: {fixedRange: {min: 0.0, max: 1.0}}}
- type: decode-filter
dataLayer:
  sources:
  - pluginRef: dcgm-source
    extractors: [{pluginRef: dcgm-extractor}]
schedulingProfiles:
- name: default
  plugins: [{pluginRef: decode-filter}, {pluginRef: endpoint-attribute-filter},
            {pluginRef: endpoint-attribute-scorer, weight: 2}]
""", PLAIN, ()),
    ("topology-aware P/D", V1ALPHA1 + """plugins:
- {type: approx-prefix-cache-producer, parameters: {maxPrefixTokensToMatch: 16384, lruCapacityPerServer: 31250}}
- type: prefix-cache-scorer
- type: prefill-filter
- type: decode-filter
- type: topology-extractor
- type: topology-affinity-filter
- type: topology-affinity-scorer
- type: always-disagg-pd-decider
- {type: disagg-profile-handler, parameters: {deciders: {prefill: always-disagg-pd-decider}}}
schedulingProfiles:
- name: prefill
  plugins: [{pluginRef: prefill-filter}, {pluginRef: topology-affinity-filter}, {pluginRef: prefix-cache-scorer},
            {pluginRef: topology-affinity-scorer}]
- name: decode
  plugins: [{pluginRef: decode-filter}, {pluginRef: prefix-cache-scorer}]
""", TOPOLOGY, ()),
    ("context-length aware routing", V1 + """plugins:
- {type: context-length-aware, parameters: {label: llm-d.ai/context-length-range, enableFiltering: false}}
- type: queue-scorer
""", PLAIN, ()),
    ("latency predictor plugins, mapped to online predictions", V1 + """plugins:
- {type: predicted-latency-producer, parameters: {streamingMode: true}}
- {type: latency-scorer, name: ttft, parameters: {ttftWeight: 1, tpotWeight: 0}}
- {type: latency-scorer, name: tpot, parameters: {ttftWeight: 0, tpotWeight: 1}}
- type: slo-headroom-tier-filter
- type: latency-slo-admitter
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins: [{pluginRef: slo-headroom-tier-filter}, {pluginRef: ttft}, {pluginRef: tpot}, {pluginRef: max-score-picker}]
""", PLAIN, ()),
    ("burst producer, mapped to the approximate producer", V1 + """plugins:
- {type: burst-prefix-cache-producer, parameters: {maxPerReplica: -1, minColocateBlocks: 0, windowDurationMs: 100}}
- type: prefix-cache-scorer
""", PLAIN, ()),
    ("GIE v1.0 forms: producer parameters on the scorer, parameters on types that read none", GIE + """plugins:
- {type: prefix-cache-scorer, parameters: {lruCapacityPerServer: 31250, maxPrefixBlocksToMatch: 256}}
- {type: queue-scorer, parameters: {hashBlockSize: 5, lruCapacityPerServer: 31250, maxPrefixBlocksToMatch: 256}}
- type: session-affinity-scorer
- type: max-score-picker
data: {injectDefaults: true}
schedulingProfiles:
- name: default
  plugins: [{pluginRef: prefix-cache-scorer}, {pluginRef: queue-scorer}, {pluginRef: session-affinity-scorer},
            {pluginRef: max-score-picker}]
""", PLAIN, ()),
    ("endpoints from a file: llm-d.ai/v1's discovery, and the bare v1alpha1 form", V1 + """plugins:
- {type: file-discovery, name: discovery, parameters: {path: /etc/epp/endpoints.yaml, watchFile: true}}
- type: queue-scorer
dataLayer:
  discovery:
    endpoints: {pluginRef: discovery}
""", PLAIN, ()),
    ("bare discovery pluginRef, injectDefaults off", V1ALPHA1 + """plugins:
- {type: file-discovery, parameters: {path: /etc/epp/endpoints.yaml}}
- type: queue-scorer
dataLayer:
  injectDefaults: false
  discovery: {pluginRef: file-discovery}
""", PLAIN, ()),
    ("prefix hashes from request metadata (mapped: hashed here)", V1ALPHA1 + """plugins:
- {type: approx-prefix-cache-producer, parameters: {prefixHashSource: metadata, maxPrefixBlocksToMatch: 256,
   lruCapacityPerServer: 31250}}
- type: prefix-cache-scorer
- type: decode-filter
""", PLAIN, ()),
    ("the multimodal sample's cacheSizeInMB (llm-d ignores it too)", V1ALPHA1 + """plugins:
- {type: mm-embeddings-cache-producer, parameters: {cacheSizeInMB: 2048}}
- type: mm-embeddings-cache-scorer
""", PLAIN, ()),
    ("probabilistic admission", V1 + """plugins:
- type: probabilistic-admitter
- type: queue-scorer
""", PLAIN, ()),
    # ---- types other modules implement: run once those are registered ----
    ("optimized baseline: prefix-cache affinity gate, in-flight load from the prefix producer, token load",
     V1 + """plugins:
- {type: approx-prefix-cache-producer, parameters: {maxPrefixTokensToMatch: 131072}}
- {type: inflight-load-producer, parameters: {prefixMatchInfoProducerName: approx-prefix-cache-producer}}
- type: prefix-cache-affinity-filter
  parameters:
    affinityThreshold: 0.6
    maxTTFTPenaltyMs: 36000
    peakPrefillThroughput: 15751
    maxTokensInFlightPenalty: 8192
    inFlightLoadProducerName: inflight-load-producer
    prefixMatchInfoProducerName: approx-prefix-cache-producer
- {type: prefix-cache-scorer, parameters: {prefixMatchInfoProducerName: approx-prefix-cache-producer}}
- type: token-load-scorer
- type: weighted-random-picker
schedulingProfiles:
- name: default
  plugins: [{pluginRef: prefix-cache-affinity-filter}, {pluginRef: prefix-cache-scorer, weight: 2},
            {pluginRef: token-load-scorer}, {pluginRef: weighted-random-picker}]
""", PLAIN, ("prefix-cache-affinity-filter", "weighted-random-picker")),
    ("tiered prefix cache: GPU and CPU approximate producers, one scorer each", V1 + """plugins:
- {type: approx-prefix-cache-producer, name: gpu-prefix-cache-producer, parameters: {autoTune: false,
   lruCapacityPerServer: 200000}}
- {type: approx-prefix-cache-producer, name: cpu-prefix-cache-producer, parameters: {autoTune: false,
   lruCapacityPerServer: 4000000}}
- {type: prefix-cache-scorer, name: gpu-scorer, parameters: {prefixMatchInfoProducerName: gpu-prefix-cache-producer}}
- {type: prefix-cache-scorer, name: cpu-scorer, parameters: {prefixMatchInfoProducerName: cpu-prefix-cache-producer}}
- {type: inflight-load-producer, parameters: {prefixMatchInfoProducerName: gpu-prefix-cache-producer}}
- type: no-hit-lru-scorer
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins: [{pluginRef: gpu-scorer, weight: 2}, {pluginRef: cpu-scorer, weight: 1}, {pluginRef: no-hit-lru-scorer},
            {pluginRef: max-score-picker}]
""", PLAIN, ("two approximate producers",)),
    ("E/PD: the encode stage, its decider and filter, the deprecated headers handler", V1 + """plugins:
- type: disagg-headers-handler
- type: encode-filter
- type: prefill-filter
- type: decode-filter
- type: max-score-picker
- type: always-disagg-multimodal-decider
- {type: disagg-profile-handler, parameters: {deciders: {encode: always-disagg-multimodal-decider}}}
schedulingProfiles:
- name: encode
  plugins: [{pluginRef: encode-filter}, {pluginRef: max-score-picker}]
- name: decode
  plugins: [{pluginRef: decode-filter}, {pluginRef: max-score-picker}]
""", PD + ({ROLE: "encode"},), ("encode-filter", "always-disagg-multimodal-decider", "disagg-headers-handler")),
    ("P2P KV transfer source", V1 + """plugins:
- {type: approx-prefix-cache-producer, name: gpu-prefix-cache-producer}
- type: p2p-source-producer
  parameters: {minCachedTokenDelta: 2048, prefillProfileName: prefill, p2pPortBase: 7777,
               prefixMatchInfoProducerName: gpu-prefix-cache-producer}
- type: prefill-filter
- type: decode-filter
- type: max-score-picker
- type: always-disagg-pd-decider
- {type: disagg-profile-handler, parameters: {deciders: {prefill: always-disagg-pd-decider}}}
schedulingProfiles:
- name: prefill
  plugins: [{pluginRef: prefill-filter}, {pluginRef: max-score-picker}]
- name: decode
  plugins: [{pluginRef: decode-filter}, {pluginRef: max-score-picker}]
""", PD, ("p2p-source-producer",)),
    ("the phase header's profile handler (header-profile-handler's older name)", V1 + """plugins:
- type: header-phase-profile-handler
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins: [{pluginRef: max-score-picker}]
""", PLAIN, ("header-profile-handler",)),
    ("vLLM's HTTP parser (the deprecated `parser` key)", V1ALPHA1 + """plugins:
- type: vllmhttp-parser
- type: decode-filter
requestHandler:
  parser: {pluginRef: vllmhttp-parser}
""", PLAIN, ("vllmhttp-parser",)),
    ("payload-agnostic: the passthrough parser alone", V1 + """plugins:
- type: passthrough-parser
- type: queue-scorer
requestHandler:
  parsers: [{pluginRef: passthrough-parser}]
""", PLAIN, ("a passthrough-only parser chain",)),
    ("turn-priority fairness", V1 + """featureGates: [flowControl]
plugins:
- {type: program-aware-fairness, parameters: {strategy: turn-priority}}
- type: queue-scorer
flowControl:
  enableEviction: true
  priorityBands:
  - {priority: -1, defaultRequestTTL: 9000s, fairnessPolicyRef: program-aware-fairness}
  - {priority: 0}
""", PLAIN, ("program-aware-fairness strategy turn-priority",)),
]

# Capabilities that are not a plugin type: a probe config that loads once the module adding them is in.
PROBES = {
    "two approximate producers": V1 + """plugins:
- {type: approx-prefix-cache-producer, name: a}
- {type: approx-prefix-cache-producer, name: b}
""",
    "a passthrough-only parser chain": V1 + "requestHandler:\n  parsers: [{pluginRef: passthrough-parser}]\n"
                                          "plugins:\n- type: passthrough-parser\n",
    "program-aware-fairness strategy turn-priority": V1 + """plugins:
- {type: program-aware-fairness, parameters: {strategy: turn-priority}}
""",
}


def missing(needs: tuple[str, ...]) -> list[str]:
    types = set(default_registry().types())
    lacking = []
    for need in needs:
        if need in PROBES:
            try:
                load_config_text(PROBES[need])
            except ConfigError:
                lacking.append(need)
        elif need not in types:
            lacking.append(need)
    return lacking


@pytest.mark.parametrize("fact, text, labels, needs", GUIDES, ids=[g[0].split(":")[0] for g in GUIDES])
async def test_a_config_written_from_the_guide_loads_and_serves(fact, text, labels, needs):
    lacking = missing(needs)
    assert not lacking, f"the guide needs {', '.join(lacking)}, not registered in this build"
    harness = DirectorHarness(text, source="guide.yaml")
    try:
        result, _ = await harness.pick(request("Summarise the llm-d router. " * 20), pool(*labels))
    except InferenceError as exc:  # answered by the picker itself: it must be a deliberate refusal
        pytest.fail(f"{fact}: the request was refused: {exc.body}")
    assert result.targets, fact


def test_the_guide_configs_cover_every_type_the_corpus_uses():
    """The plugin types of the collected corpus (tests/support/llmd_corpus.py's inventory), less those refused."""
    used = set()
    for _, text, _, _ in GUIDES:
        used |= {line.split("type:")[1].split(",")[0].split("}")[0].strip()
                 for line in text.splitlines() if "type:" in line and "type: threshold" not in line
                 and "type: linear" not in line and "type: base64" not in line}
    corpus_types = {
        "active-request-scorer", "agent-identity", "always-disagg-multimodal-decider", "always-disagg-pd-decider",
        "approx-prefix-cache-producer", "burst-prefix-cache-producer", "concurrency-detector", "context-length-aware",
        "core-metrics-extractor", "data-parallel-profile-handler", "dcgm-data-source", "dcgm-extractor",
        "decode-filter", "disagg-headers-handler", "disagg-profile-handler", "disaggregatedset-rollout-screener",
        "dp-rank-header-handler", "encode-filter", "endpoint-attribute-filter", "endpoint-attribute-scorer",
        "endpoint-notification-source", "fcfs-ordering-policy", "file-discovery", "header-phase-profile-handler",
        "inflight-load-producer", "kv-cache-utilization-scorer", "latency-scorer", "latency-slo-admitter",
        "load-aware-scorer", "max-score-picker", "metrics-data-source", "mm-embeddings-cache-producer",
        "mm-embeddings-cache-scorer", "no-hit-lru-scorer", "p2p-source-producer", "passthrough-parser",
        "pd-profile-handler", "precise-prefix-cache-producer", "precise-prefix-cache-scorer",
        "predicted-latency-producer", "prefill-filter", "prefill-header-handler", "prefix-based-pd-decider",
        "prefix-cache-affinity-filter", "prefix-cache-scorer", "priority-holdback-policy", "probabilistic-admitter",
        "program-aware-fairness", "queue-scorer", "random-picker", "round-robin-fairness-policy",
        "session-affinity-scorer", "single-profile-handler", "slo-headroom-tier-filter", "soft-reflective-ceiling-policy",
        "token-load-scorer", "token-producer", "tokenizer", "topology-affinity-filter", "topology-affinity-scorer",
        "topology-extractor", "utilization-detector", "vllmhttp-parser", "weighted-random-picker",
        "header-profile-handler",
    }
    # header-profile-handler appears through header-phase-profile-handler's mapping; single-profile-handler is
    # what one profile gets by default.
    assert corpus_types - used - {"header-profile-handler", "single-profile-handler"} == set()
