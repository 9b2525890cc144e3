"""llm-d router configs load as they are: both apiVersions, llm-d's plugin types and parameters mapped with
their meaning, deprecated names and sections as llm-d reads them, and refusals that name the field."""

from __future__ import annotations

import logging

import pytest

from epp.config import describe, load_config_text
from epp.config.check import check_config_main
from epp.framework import ConfigError
from epp.framework.registry import default_registry
from epp.kvevents.producer import PrecisePrefixCacheProducer
from epp.scorers.prefix import PrefixCacheScorer
from epp.tokenization.producer import TokenProducer

LLMD = "apiVersion: llm-d.ai/v1\nkind: EndpointPickerConfig\n"
V1ALPHA1 = "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\n"
GIE = "apiVersion: inference.networking.x-k8s.io/v1alpha1\nkind: EndpointPickerConfig\n"
DEPRECATION = ("DEPRECATION: apiVersion inference.networking.x-k8s.io/v1alpha1/EndpointPickerConfig is deprecated; "
               "use llm-d.ai/v1")

# The shape of llm-d's precise-prefix-cache-routing guide (rewritten here): a vLLM token-producer, the
# producer with nested kv-cache settings, the generic prefix scorer naming it, endpoint notifications.
PRECISE = LLMD + """
plugins:
- type: token-producer
  parameters:
    modelName: qwen25-7b-instruct
    vllm: {url: "http://render:8000"}
- type: endpoint-notification-source
- type: precise-prefix-cache-producer
  parameters:
    tokenProcessorConfig: {blockSize: 64}
    speculativeIndexing: true
    indexerConfig:
      kvBlockIndexConfig: {enableMetrics: true}
      kvCacheBackendConfigs: [{name: gpu, weight: 1.0}, {name: cpu, weight: 0.6}]
    kvEventsConfig:
      topicFilter: "kv@"
      engineType: vllm
      concurrency: 8
      discoverPods: true
      podDiscoveryConfig: {socketPort: 5556, replaySocketPort: 5559}
- type: prefix-cache-scorer
  parameters: {prefixMatchInfoProducerName: precise-prefix-cache-producer}
- type: kv-cache-utilization-scorer
- type: queue-scorer
- type: no-hit-lru-scorer
  parameters: {prefixMatchInfoProducerName: precise-prefix-cache-producer}
dataLayer:
  sources:
  - pluginRef: endpoint-notification-source
    extractors: [{pluginRef: precise-prefix-cache-producer}]
schedulingProfiles:
- name: default
  plugins:
  - {pluginRef: kv-cache-utilization-scorer, weight: 2.0}
  - {pluginRef: queue-scorer, weight: 2.0}
  - {pluginRef: prefix-cache-scorer, weight: 3.0}
  - {pluginRef: no-hit-lru-scorer, weight: 2.0}
"""


def load(text: str):
    return load_config_text(text, source="epp.yaml", registry=default_registry())


def test_llm_d_api_version_loads_without_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="epp.config"):
        loaded = load(LLMD + "plugins:\n- type: queue-scorer\n")
    assert not [r for r in caplog.records if "DEPRECATION" in r.getMessage()]
    assert loaded.notes == ()


@pytest.mark.parametrize("header, version", [(GIE, "inference.networking.x-k8s.io/v1alpha1"),
                                             (V1ALPHA1, "llm-d.ai/v1alpha1")])
def test_old_api_versions_load_with_one_deprecation_line(caplog, header, version):
    with caplog.at_level(logging.WARNING, logger="epp.config"):
        loaded = load(header + "plugins:\n- type: queue-scorer\n- type: prefix-cache-scorer\n")
    line = f"DEPRECATION: apiVersion {version}/EndpointPickerConfig is deprecated; use llm-d.ai/v1"
    lines = [r.getMessage() for r in caplog.records if "DEPRECATION" in r.getMessage()]
    assert lines == [f"epp.yaml: {line}"]
    assert loaded.notes == (f"apiVersion: {line}",) and loaded.notices == ()
    assert [ws.scorer.name for ws in loaded.scheduler.profiles["default"].scorers] == \
        ["queue-scorer", "prefix-cache-scorer"]


def test_llm_d_precise_guide_config_maps_onto_the_precise_producer():
    loaded = load(PRECISE)
    producer = loaded.plugin("precise-prefix-cache-producer")
    assert isinstance(producer, PrecisePrefixCacheProducer)
    config = producer.subscriber.config
    assert (producer.block_size, config.mode, config.events_port, config.replay_port, config.topic_filter) == \
        (64, "per-endpoint", 5556, 5559, "kv@")
    assert producer.tier_weights == (1.0, 0.6, 0.5)
    assert producer.use_token_producer and producer.consumes() == {"prompt-tokens"}
    assert producer.index.speculative_ttl_s == 2.0  # speculativeIndexing: true, llm-d's speculativeTTL
    # The token-producer runs first: the producer consumes what it produces.
    assert [p.name for p in loaded.data_producers] == ["token-producer", "precise-prefix-cache-producer"]
    assert isinstance(loaded.plugin("token-producer"), TokenProducer)
    scorer = loaded.plugin("prefix-cache-scorer")
    assert isinstance(scorer, PrefixCacheScorer) and scorer.plugin_refs() == \
        {"prefixMatchInfoProducerName": "precise-prefix-cache-producer"}
    assert [(s.source.name, [x.name for x in s.extractors]) for s in loaded.data_sources] == \
        [("endpoint-notification-source", ["precise-prefix-cache-producer"])]
    assert loaded.scrape is not None and loaded.scrape.scheme == "http"  # the default metrics source, injected


def test_kv_events_on_a_topic_naming_no_model_are_the_token_producers_model():
    # vLLM publishes on topic "" unless told otherwise; an llm-d config names its model once, in the
    # token-producer, and those events must not all be dropped for naming none.
    producer = load(PRECISE).plugin("precise-prefix-cache-producer")
    assert producer.subscriber.config.default_model == "qwen25-7b-instruct"


def test_llm_d_defaults_apply_to_a_precise_producer_in_llm_d_shape():
    loaded = load(LLMD + "plugins:\n- type: precise-prefix-cache-producer\n"
                         "  parameters: {kvEventsConfig: {}, tokenizers: {tiny: /nonexistent}}\n")
    producer = loaded.plugin("precise-prefix-cache-producer")
    assert producer.subscriber.config.topic_filter == "kv@"
    assert producer.index.speculative_ttl_s == 0  # speculativeIndexing defaults to false in llm-d
    assert not producer.use_token_producer  # our own tokenizer files give the tokens


def test_zmq_endpoint_is_the_centralized_subscriber_and_redis_the_shared_index():
    loaded = load(LLMD + """plugins:
- type: precise-prefix-cache-producer
  parameters:
    kvEventsConfig: {zmqEndpoint: "tcp://*:5557"}
    indexerConfig: {kvBlockIndexConfig: {redisConfig: {address: "127.0.0.1:6390"}, inMemoryConfig: {size: 10}}}
""")
    entry = next(e for e in loaded.plugins if e.name == "precise-prefix-cache-producer")
    assert entry.parameters["mode"] == "centralized" and entry.parameters["zmqEndpoint"] == "tcp://*:5557"
    assert entry.parameters["indexBackend"] == "redis" and entry.parameters["redisUrl"] == "redis://127.0.0.1:6390"
    assert "indexerConfig.kvBlockIndexConfig.inMemoryConfig: no effect, redisConfig wins (as in llm-d)" in entry.mapping


def test_deprecated_precise_scorer_is_a_producer_and_a_scorer_reading_it():
    loaded = load(LLMD + """plugins:
- type: precise-prefix-cache-scorer
  name: precise
  parameters: {tokenProcessorConfig: {blockSizeTokens: 32}, kvEventsConfig: {discoverPods: false}}
schedulingProfiles:
- name: default
  plugins: [{pluginRef: precise, weight: 5}]
""")
    producer = loaded.plugin("precise-producer")
    assert isinstance(producer, PrecisePrefixCacheProducer) and producer.block_size == 32
    assert not producer.subscribe
    scorer = loaded.plugin("precise")
    assert isinstance(scorer, PrefixCacheScorer)
    assert [(ws.scorer.name, ws.weight) for ws in loaded.scheduler.profiles["default"].scorers] == [("precise", 5.0)]
    assert [p.name for p in loaded.data_producers] == ["precise-producer"]  # no approximate producer beside it
    assert any("precise-prefix-cache-scorer is deprecated in llm-d" in note for note in loaded.notes)


def test_deprecated_names_and_sections_load_as_llm_d_reads_them():
    loaded = load(LLMD + """plugins:
- type: by-label-selector
  parameters: {matchLabels: {tier: gold}}
- type: queue-scorer
- type: openai-parser
- type: utilization-detector
  name: strict
  parameters: {queueDepthThreshold: 2}
parser: {pluginRef: openai-parser}
saturationDetector: {pluginRef: strict}
""")
    assert loaded.plugins[0].type_name == "label-selector-filter"
    assert [p.name for p in loaded.parsers] == ["openai-parser", "passthrough-parser"]
    assert loaded.saturation_detector is loaded.plugin("strict")
    assert loaded.notes == (
        "plugins[0].type: by-label-selector is deprecated in llm-d; loaded as label-selector-filter",
        "parser: deprecated; copied into requestHandler.parsers (as in llm-d)",
        "requestHandler.parsers: no fallback parser listed; passthrough-parser added last, so requests on paths no "
        "listed parser claims are routed by load with their body unread",
        "saturationDetector: deprecated; copied into flowControl.saturationDetector (as in llm-d)",
    )


def test_flow_control_names_its_saturation_detector():
    loaded = load(LLMD + """featureGates: [flowControl]
plugins:
- {type: utilization-detector, name: detector, parameters: {kvCacheUtilThreshold: 0.5}}
- type: queue-scorer
schedulingProfiles:
- name: default
  plugins: [{pluginRef: queue-scorer}]
flowControl:
  maxRequests: 10
  saturationDetector: {pluginRef: detector}
""")
    assert loaded.saturation_detector is loaded.plugin("detector")
    assert loaded.flow_control is not None and loaded.flow_control.max_requests == 10


def test_feature_gates_take_llm_d_syntax():
    loaded = load(LLMD + "featureGates: [flowControl=true, haPopulateNonLeaderDatastore]\n")
    assert loaded.feature_gates == {"flowControl", "haPopulateNonLeaderDatastore"}
    assert load(LLMD + "featureGates: [flowControl=false]\n").feature_gates == frozenset()


P = "plugins:\n- type: precise-prefix-cache-producer\n  parameters:\n"
REFUSED = [
    (LLMD + P + "    kvEventsConfig: {zmqEndpont: 'tcp://*:5557'}\n",
     "epp.yaml: plugins[0].parameters: plugin 'precise-prefix-cache-producer': parameter 'kvEventsConfig.zmqEndpont': "
     "unknown field; allowed: zmqEndpoint, topicFilter, concurrency, engineType, discoverPods, podDiscoveryConfig, "
     "tracing, dataParallelSizeLocal, servingPortBase"),
    (LLMD + P + "    kvEventsConfig: {engineType: trtllm}\n",
     "epp.yaml: plugins[0].parameters: plugin 'precise-prefix-cache-producer': parameter 'kvEventsConfig.engineType': "
     "'trtllm' is not supported; allowed: vllm, sglang"),
    (LLMD + P + "    indexerConfig: {kvBlockIndexConfig: {costAwareMemoryConfig: {size: 2GiB}}}\n",
     "epp.yaml: plugins[0].parameters: plugin 'precise-prefix-cache-producer': parameter "
     "'indexerConfig.kvBlockIndexConfig.costAwareMemoryConfig': not supported"),
    (LLMD + P + "    indexerConfig: {tokenizersPoolConfig: {modelName: m, local: {dir: /t}}}\n",
     "epp.yaml: plugins[0].parameters: plugin 'precise-prefix-cache-producer': parameter "
     "'indexerConfig.tokenizersPoolConfig.local': not supported: give the tokenizer directories"),
    (LLMD + P + "    kvEventsConfig: {discoverPods: true, dataParallelSizeLocal: 8}\n",
     "epp.yaml: plugins[0].parameters: plugin 'precise-prefix-cache-producer': parameter "
     "'kvEventsConfig.dataParallelSizeLocal': goes with servingPortBase"),
    (LLMD + P + "    kvEventsConfig: {discoverPods: true, podDiscoveryConfig: {dataParallelSize: 8}}\n",
     "epp.yaml: plugins[0].parameters: plugin 'precise-prefix-cache-producer': parameter "
     "'kvEventsConfig.podDiscoveryConfig.dataParallelSize': not supported: ranks sharing one serving port"),
    (LLMD + P + "    tokenProcessorConfig: {blockSize: 16, blockSizeTokens: 16}\n",
     "epp.yaml: plugins[0].parameters: plugin 'precise-prefix-cache-producer': parameter "
     "'tokenProcessorConfig.blockSize': is the deprecated name of blockSizeTokens; set one of them"),
    (LLMD + P + "    tokenProcessorConfig: {blockSizeTokens: 16}\n    blockSizeTokens: 32\n",
     "epp.yaml: plugins[0].parameters: plugin 'precise-prefix-cache-producer': parameter "
     "'tokenProcessorConfig.blockSizeTokens': sets 'blockSizeTokens', which the parameters also give directly"),
    (LLMD + "plugins:\n- type: header-label-affinity-scorer\n",
     "epp.yaml: plugins[0].type: llm-d plugin type 'header-label-affinity-scorer' is not supported here: alpha in "
     "llm-d, not implemented"),
    (LLMD + "plugins:\n- type: load-aware-scorer\n  parameters: {treshold: 5}\n",
     "epp.yaml: plugins[0].parameters: plugin 'load-aware-scorer': unknown parameter(s) ['treshold']; allowed: "
     "['threshold', 'useInflight']"),
    (LLMD + "plugins:\n- type: queue-scorer\ndataLayer: {discovery: {endpoints: {pluginRef: queue-scorer}}}\n",
     "epp.yaml: dataLayer.discovery.endpoints.pluginRef: plugin 'queue-scorer' (type queue-scorer) is no endpoint "
     "discovery plugin; discovery types: endpoint-selector-discovery, file-discovery, inference-pool-discovery, "
     "static-discovery"),
    (LLMD + "dataLayer: {discovery: {peers: {pluginRef: x}}}\n",
     "epp.yaml: dataLayer.discovery.peers: not supported: the other pickers of a pool are given with --peers"),
    (LLMD + "dataLayer: {crossReplica: {syncInterval: 5s}}\n",
     "epp.yaml: dataLayer.crossReplica: not supported: pickers of one pool share"),
    (V1ALPHA1 + "dataLayer: {crossReplicaSyncInterval: 5s}\n",
     "epp.yaml: dataLayer.crossReplica: not supported: pickers of one pool share"),
    (LLMD + "dataLayer: {crossReplicaSyncInterval: 5s}\n",
     "epp.yaml: dataLayer.crossReplicaSyncInterval: is llm-d.ai/v1alpha1's field; in llm-d.ai/v1 it is "
     "dataLayer.crossReplica.syncInterval"),
    (LLMD + "plugins:\n- type: redis-state-store\n",
     "epp.yaml: plugins[0].type: llm-d plugin type 'redis-state-store' is not supported here: cross-replica syncers "
     "are not supported"),
    (LLMD + "flowControl: {enableEviction: sometimes}\n",
     "epp.yaml: flowControl.enableEviction: must be true or false, got 'sometimes'"),
    (LLMD + "featureGates: [haPopulateNonLeaderDatastore=false]\n",
     "epp.yaml: featureGates[0]: haPopulateNonLeaderDatastore=false is not supported"),
    (LLMD + "featureGates: [flowControl=yes]\n",
     "epp.yaml: featureGates[0]: gate value must be true or false, got 'flowControl=yes'"),
    (LLMD + "plugins:\n- type: prefix-cache-scorer\n  parameters: {prefixMatchInfoProducerName: precise}\n",
     "epp.yaml: plugins[0].parameters.prefixMatchInfoProducerName: names plugin 'precise', which is not in the "
     "config"),
    (LLMD + "plugins:\n- type: queue-scorer\n- type: prefix-cache-scorer\n"
            "  parameters: {prefixMatchInfoProducerName: queue-scorer}\n",
     "epp.yaml: plugins[1].parameters: plugin 'prefix-cache-scorer': parameter 'prefixMatchInfoProducerName' names "
     "'queue-scorer' (type queue-scorer), which does not produce the prefix match info"),
    (LLMD + "plugins:\n- type: prefix-cache-scorer\n  parameters: {matchLengthWeight: 1.5}\n",
     "epp.yaml: plugins[0].parameters: plugin 'prefix-cache-scorer': parameter 'matchLengthWeight' must be <= 1.0"),
    (LLMD + "plugins:\n- type: queue-scorer\n- type: disagg-profile-handler\n"
            "  parameters: {deciders: {prefill: queue-scorer}}\nschedulingProfiles:\n- name: decode\n- name: prefill\n",
     "epp.yaml: plugins[1].parameters: plugin 'disagg-profile-handler': parameter 'deciders.prefill' names "
     "'queue-scorer' (type queue-scorer), which is no P/D decider"),
    (LLMD + "plugins:\n- type: disagg-profile-handler\n  parameters: {stageOrder: prefill-first}\n",
     "epp.yaml: plugins[0].parameters: plugin 'disagg-profile-handler': parameter 'stageOrder' 'prefill-first' is "
     "not supported"),
    (LLMD + "plugins:\n- type: metrics-data-source\n  parameters: {families: [vllm:num_requests_waiting]}\n",
     "epp.yaml: plugins[0].parameters: plugin 'metrics-data-source': parameter 'families' must keep every family "
     "core-metrics-extractor reads; missing: vllm:num_requests_running"),
    (LLMD + "plugins:\n- type: metrics-data-source\n  parameters: {scheme: https, caCertPath: /nonexistent.pem}\n",
     "epp.yaml: plugins[0].parameters: plugin 'metrics-data-source': parameter 'caCertPath': cannot load "
     "'/nonexistent.pem'"),
    (LLMD + "plugins:\n- type: core-metrics-extractor\n  parameters: {engineLabelKey: engine}\n",
     "epp.yaml: plugins[0].parameters: plugin 'core-metrics-extractor': parameter 'engineLabelKey' is not supported"),
    (LLMD + "plugins:\n- type: metrics-data-source\n- {type: metrics-data-source, name: b}\n- type: "
            "core-metrics-extractor\ndataLayer:\n  sources:\n  - {pluginRef: metrics-data-source, extractors: "
            "[{pluginRef: core-metrics-extractor}]}\n  - {pluginRef: b, extractors: [{pluginRef: "
            "core-metrics-extractor}]}\n",
     "epp.yaml: dataLayer.sources[1]: only one metrics-data-source is supported"),
    (LLMD + "plugins:\n- type: passthrough-parser\nrequestHandler: {parsers: [{pluginRef: passthrough-parser}, "
            "{pluginRef: passthrough-parser}]}\n",
     "epp.yaml: requestHandler.parsers[1].pluginRef: parser 'passthrough-parser' is listed twice"),
    (LLMD + "plugins:\n- type: vllmgrpc-parser\n",
     "epp.yaml: plugins[0].type: llm-d plugin type 'vllmgrpc-parser' is not supported here: gRPC request bodies are "
     "not read (HTTP/JSON APIs only); use vllmhttp-parser"),
    (LLMD + "plugins:\n- type: token-producer\n  parameters: {vllm: {url: 'http://r:8000'}}\n",
     "epp.yaml: plugins[0].parameters: plugin 'token-producer': parameter 'modelName' is required with the vllm "
     "backend"),
    (LLMD + "plugins:\n- type: token-producer\n  parameters: {modelName: m, vllm: {endpointDiscovery: {}}}\n",
     "epp.yaml: plugins[0].parameters: plugin 'token-producer': parameter 'vllm.endpointDiscovery' is not supported"),
    (LLMD + "plugins:\n- type: context-length-aware\n  parameters: {reusableTokensProducerName: p2p}\n",
     "epp.yaml: plugins[0].parameters: plugin 'context-length-aware': parameter 'reusableTokensProducerName' is not "
     "supported"),
    (LLMD + "plugins:\n- type: session-affinity-scorer\n  parameters: {strategy: session_id, sessionIdConfig: "
            "{sources: [{attribute: tenant}]}}\n",
     "epp.yaml: plugins[0].parameters: plugin 'session-affinity-scorer': parameter "
     "'sessionIdConfig.sources[0].attribute' 'tenant' is not published here; allowed: agent-identity"),
    (LLMD + "plugins:\n- type: active-request-scorer\n  parameters: {inFlightLoadProducerName: queue-scorer}\n"
            "- type: queue-scorer\n",
     "epp.yaml: plugins[0].parameters: plugin 'active-request-scorer': parameter 'inFlightLoadProducerName' names "
     "'queue-scorer' (type queue-scorer), which does not produce in-flight load"),
]


@pytest.mark.parametrize("text, message", REFUSED)
def test_what_cannot_be_honoured_is_refused_naming_the_field(text, message):
    with pytest.raises(ConfigError) as err:
        load(text)
    assert str(err.value).startswith(message), str(err.value)


def test_check_config_prints_how_each_llm_d_plugin_was_mapped(tmp_path, capsys):
    path = tmp_path / "precise.yaml"
    path.write_text(PRECISE)
    assert check_config_main(str(path)) == 0
    out = capsys.readouterr().out
    mapped = out[out.index("llm-d plugin types (how each was mapped):"):out.index("Request pipeline:")]
    assert ("  - precise-prefix-cache-producer: llm-d precise-prefix-cache-producer -> precise-prefix-cache-producer: "
            "prefix match per endpoint from the replicas' vLLM KV events") in mapped
    assert ("parameters taken: tokenProcessorConfig.blockSize, indexerConfig.kvBlockIndexConfig.enableMetrics, "
            "indexerConfig.kvCacheBackendConfigs, kvEventsConfig.engineType, kvEventsConfig.topicFilter, "
            "kvEventsConfig.concurrency, kvEventsConfig.discoverPods, kvEventsConfig.podDiscoveryConfig.socketPort, "
            "kvEventsConfig.podDiscoveryConfig.replaySocketPort, speculativeIndexing") in mapped
    assert "kvEventsConfig.concurrency: no effect: each endpoint's events are applied in order" in mapped
    assert "  - token-producer: llm-d token-producer -> token-producer:" in mapped
    assert "parameters taken: prefixMatchInfoProducerName" in mapped
    # What the nested parameters became, on the plugin's own line.
    assert "[blockSizeTokens=64, tierWeights={cpu: 0.6, gpu: 1.0}, topicFilter=kv@, mode=per-endpoint, " \
           "eventsPort=5556, replayPort=5559, useTokenProducer=true, defaultModel=qwen25-7b-instruct]" in out
    assert "  metrics scrape: http://<endpoint>/metrics" in out


def test_every_registered_llm_d_type_has_a_mapping_and_no_refused_type_is_registered():
    from epp.config.llmd import LLMD_TYPES, REFUSED_TYPES

    registered = set(default_registry().types())
    assert not set(REFUSED_TYPES) & registered
    unmapped = {"precise-prefix-cache-scorer", "by-label-selector"}  # expanded or renamed by the loader
    assert set(LLMD_TYPES) - unmapped <= registered


def test_describe_lists_notes_last():
    text = describe(load(GIE + "featureGates: [enableLegacyMetrics]\n"))
    notes = text[text.index("Notes:"):]
    assert f"apiVersion: {DEPRECATION}" in notes
    assert "featureGates[0]: enableLegacyMetrics: no effect" in notes


def test_the_compatibility_page_lists_every_mapped_and_refused_type():
    from pathlib import Path

    from epp.config.llmd import ALIASES, LLMD_TYPES, REFUSED_OTHER_TYPES, REFUSED_TYPES
    from epp.config.llmd_mapped import MAPPED_TYPES

    page = (Path(__file__).parents[2] / "docs" / "llm-d-compatibility.md").read_text()
    names = (*LLMD_TYPES, *REFUSED_TYPES, *ALIASES, *REFUSED_OTHER_TYPES, *MAPPED_TYPES)
    missing = [t for t in names if f"`{t}`" not in page]
    assert not missing, f"add these llm-d types to docs/llm-d-compatibility.md: {missing}"
