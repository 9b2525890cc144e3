"""The EndpointPickerConfig loader: valid documents resolve as GIE does; each invalid one fails clearly."""

import pytest

from epp.config import describe, load_config, load_config_text, load_default_config
from epp.framework import ConfigError, DataProducer, PluginRegistry, Scorer
from epp.framework.datakeys import PREFIX_MATCH_INFO
from epp.scorers import register_builtin_plugins

HEADER = "apiVersion: inference.networking.x-k8s.io/v1alpha1\nkind: EndpointPickerConfig\n"


def registry():
    reg = PluginRegistry()
    register_builtin_plugins(reg)
    return reg


def load(text, reg=None):
    return load_config_text(text, source="epp.yaml", registry=reg or registry())


def entry_types(loaded):
    return [(e.name, e.type_name, e.auto_created is not None) for e in loaded.plugins]


def profile_shape(loaded, name="default"):
    profile = loaded.scheduler.profiles[name]
    return ([f.name for f in profile.filters], [(ws.scorer.name, ws.weight) for ws in profile.scorers],
            profile.picker.name)


def test_system_defaults_match_gie():
    loaded = load_default_config(registry=registry())
    assert profile_shape(loaded) == ([], [("queue-scorer", 2.0), ("kv-cache-utilization-scorer", 2.0),
                                          ("prefix-cache-scorer", 3.0)], "max-score-picker")
    assert loaded.scheduler.handler.type_name == "single-profile-handler"
    assert [p.name for p in loaded.data_producers] == ["approx-prefix-cache-producer"]
    assert [p.name for p in loaded.pre_request_hooks] == ["approx-prefix-cache-producer"]
    assert loaded.plugin("max-score-picker").max_endpoints == 1
    assert [(ds.source.name, [x.name for x in ds.extractors]) for ds in loaded.data_sources] == \
        [("metrics-data-source", ["core-metrics-extractor"])]
    assert loaded.saturation_detector.type_name == "utilization-detector"
    assert loaded.saturation_detector_ref == "utilization-detector"


def test_saturation_detector_by_reference():
    loaded = load(HEADER + """
plugins:
- name: strict-detector
  type: utilization-detector
  parameters: {queueDepthThreshold: 2}
- type: queue-scorer
saturationDetector: {pluginRef: strict-detector}
""")
    assert loaded.saturation_detector is loaded.plugin("strict-detector")
    assert loaded.saturation_detector.queue_depth_threshold == 2
    # With no profiles, the default profile takes every filter: the detector is one (GIE does the same).
    assert profile_shape(loaded) == (["strict-detector"], [("queue-scorer", 1.0)], "max-score-picker")


def test_full_document_resolves():
    loaded = load(HEADER + """
featureGates: [enableLegacyMetrics]
objectives:
- {name: critical, priority: 10}
- {name: batch, priority: -1}
plugins:
- type: decode-filter
- name: q
  type: queue-scorer
- type: prefix-cache-scorer
- type: approx-prefix-cache-producer
  parameters: {blockSizeTokens: 32, autoTune: false}
- type: weighted-random-picker
  parameters: {maxNumOfEndpoints: 2}
- type: active-request-scorer
- type: destination-endpoint-served-verifier
- type: openai-parser
parser: {pluginRef: openai-parser}
schedulingProfiles:
- name: only
  plugins:
  - pluginRef: decode-filter
  - pluginRef: q
    weight: 0.5
  - pluginRef: prefix-cache-scorer
  - pluginRef: active-request-scorer
    weight: 0
  - pluginRef: weighted-random-picker
""")
    assert profile_shape(loaded, "only") == (["decode-filter"], [("q", 0.5), ("prefix-cache-scorer", 1.0),
                                                                 ("active-request-scorer", 0.0)],
                                             "weighted-random-picker")
    assert loaded.feature_gates == {"enableLegacyMetrics"}
    assert loaded.objectives == {"critical": 10, "batch": -1}
    # The configured producer is used (no auto-created one), with its parameters.
    assert [p.name for p in loaded.data_producers] == ["approx-prefix-cache-producer"]
    assert loaded.data_producers[0].block_size_tokens == 32
    assert [p.name for p in loaded.pre_request_hooks] == ["approx-prefix-cache-producer", "active-request-scorer"]
    assert [p.name for p in loaded.response_complete_hooks] == ["active-request-scorer"]
    assert [p.name for p in loaded.response_headers_hooks] == ["destination-endpoint-served-verifier"]
    assert loaded.parser.name == "openai-parser"
    text = describe(loaded)
    assert "profile 'only':" in text and "- q weight 0.5" in text and "batch=-1" in text


def test_no_profiles_puts_every_filter_scorer_and_picker_in_one_default_profile():
    loaded = load(HEADER + """
plugins:
- type: prefill-filter
- type: kv-cache-utilization-scorer
- type: random-picker
""")
    assert profile_shape(loaded) == (["prefill-filter"], [("kv-cache-utilization-scorer", 1.0)], "random-picker")


def test_legacy_prefix_scorer_parameters_go_to_the_auto_created_producer():
    loaded = load(HEADER + """
plugins:
- type: prefix-cache-scorer
  parameters: {hashBlockSize: 64, maxPrefixBlocksToMatch: 100, lruCapacityPerServer: 500}
""")
    producer = loaded.plugin("approx-prefix-cache-producer")
    assert (producer.block_size_tokens, producer.max_prefix_blocks, producer.lru_capacity_per_server) == \
        (16, 100, 500)


def test_pipeline_orders_producers_by_their_data_keys():
    class LateProducer(DataProducer):
        """Consumes prefix info (so it must run after the prefix producer)."""
        type_name = "late-producer"

        def __init__(self, name, params, context):
            super().__init__(name)

        def consumes(self):
            return frozenset({PREFIX_MATCH_INFO})

        def produces(self):
            return frozenset({"late-key"})

    reg = registry()
    reg.register_class(LateProducer)
    loaded = load(HEADER + """
plugins:
- type: late-producer
- type: prefix-cache-scorer
""", reg)
    assert [p.name for p in loaded.data_producers] == ["approx-prefix-cache-producer", "late-producer"]


def scorer_consuming(key):
    class Consumer(Scorer):
        """Consumes a data key nobody produces."""
        type_name = "needs-data"

        def __init__(self, name, params, context):
            super().__init__(name)

        def consumes(self):
            return frozenset({key})

        def score(self, state, request, endpoints):
            return {}

    return Consumer


def cyclic_registry():
    def producer(type_name, consumes, produces):
        class P(DataProducer):
            def __init__(self, name, params, context):
                super().__init__(name)

            def consumes(self):
                return frozenset({consumes})

            def produces(self):
                return frozenset({produces})
        P.type_name = type_name
        P.__doc__ = "test producer"
        return P

    reg = registry()
    reg.register_class(producer("p-a", "key-b", "key-a"))
    reg.register_class(producer("p-b", "key-a", "key-b"))
    return reg


P = "plugins:\n- type: queue-scorer\n"
INVALID = [
    ("", "epp.yaml: the document is empty; expected an EndpointPickerConfig"),
    ("plugins: [\n", "epp.yaml: invalid YAML:"),
    ("- a\n", "epp.yaml: must be a mapping with fields ['apiVersion', 'kind', 'plugins', 'schedulingProfiles', "
              "'featureGates', 'dataLayer', 'flowControl', 'requestHandler', 'saturationDetector', 'parser', "
              "'data', 'objectives'], got list"),
    ("kind: EndpointPickerConfig\n", "epp.yaml: apiVersion: is required"),
    ("apiVersion: v1\nkind: EndpointPickerConfig\n",
     "epp.yaml: apiVersion: unsupported apiVersion 'v1'; allowed: llm-d.ai/v1, llm-d.ai/v1alpha1, "
     "inference.networking.x-k8s.io/v1alpha1"),
    ("apiVersion: inference.networking.x-k8s.io/v1alpha1\nkind: Pod\n",
     "epp.yaml: kind: unsupported kind 'Pod'; allowed: EndpointPickerConfig"),
    (HEADER + "pluginz: []\n",
     "epp.yaml: pluginz: unknown field (did you mean 'plugins'?); allowed fields: apiVersion, kind, plugins, "
     "schedulingProfiles, featureGates, dataLayer, flowControl, requestHandler, saturationDetector, parser, "
     "data, objectives"),
    (HEADER + "plugins:\n- type: queue-scorer\n  weight: 2\n",
     "epp.yaml: plugins[0].weight: unknown field; allowed fields: name, type, parameters"),
    (HEADER + "plugins:\n- name: x\n", "epp.yaml: plugins[0].type: is required"),
    (HEADER + "plugins:\n- type: quue-scorer\n", "epp.yaml: plugins[0].type: unknown plugin type 'quue-scorer' "
                                                "(did you mean 'queue-scorer'?); "
                                                "registered types: active-request-scorer, "),
    (HEADER + "plugins:\n- type: queue-scorer\n- type: queue-scorer\n",
     "epp.yaml: plugins[1].name: duplicate plugin name 'queue-scorer'; plugin names must be unique "
     "(name defaults to type)"),
    (HEADER + "plugins:\n- type: queue-scorer\n  parameters: [1]\n",
     "epp.yaml: plugins[0].parameters: must be a mapping, got list"),
    (HEADER + "plugins:\n- type: max-score-picker\n  parameters: {maxNumOfEndpoint: 2}\n",
     "epp.yaml: plugins[0].parameters: plugin 'max-score-picker': unknown parameter(s) ['maxNumOfEndpoint']; "
     "allowed: ['maxNumOfEndpoints', 'tieBreak']"),
    (HEADER + "plugins:\n- type: approx-prefix-cache-producer\n  parameters: {blockSizeTokens: -4}\n",
     "epp.yaml: plugins[0].parameters: plugin 'approx-prefix-cache-producer': parameter 'blockSizeTokens' "
     "must be >= 1, got -4"),
    (HEADER + P + "schedulingProfiles:\n- name: a\n  plugins:\n  - pluginRef: queue-scorer\n  - pluginRef: kv\n",
     "epp.yaml: schedulingProfiles[0].plugins[1].pluginRef: unknown plugin 'kv'; defined plugins: queue-scorer"),
    (HEADER + P + "schedulingProfiles:\n- name: a\n  plugins:\n  - pluginRef: queue-scorer\n    weight: -1\n",
     "epp.yaml: schedulingProfiles[0].plugins[0].weight: must be a non-negative number, got -1"),
    (HEADER + P + "schedulingProfiles:\n- name: a\n  plugins:\n  - pluginRef: queue-scorer\n    weight: high\n",
     "epp.yaml: schedulingProfiles[0].plugins[0].weight: must be a non-negative number, got 'high'"),
    (HEADER + P + "schedulingProfiles:\n- name: a\n  plugins:\n  - pluginRef: queue-scorer\n    weight: .nan\n",
     "epp.yaml: schedulingProfiles[0].plugins[0].weight: must be a non-negative number, got nan"),
    (HEADER + "plugins:\n- type: random-picker\n- type: max-score-picker\nschedulingProfiles:\n- name: a\n"
              "  plugins:\n  - pluginRef: random-picker\n  - pluginRef: max-score-picker\n",
     "epp.yaml: schedulingProfiles[0].plugins[1].pluginRef: profile 'a' has several pickers (random-picker, "
     "max-score-picker); allowed: exactly one picker per profile"),
    (HEADER + P + "schedulingProfiles:\n- name: a\n  plugins:\n  - pluginRef: queue-scorer\n"
                  "  - pluginRef: queue-scorer\n",
     "epp.yaml: schedulingProfiles[0].plugins[1].pluginRef: plugin 'queue-scorer' is listed twice in this profile"),
    (HEADER + P + "schedulingProfiles:\n- name: a\n- name: a\n",
     "epp.yaml: schedulingProfiles[1].name: duplicate profile name 'a'; profile names must be unique"),
    (HEADER + P + "schedulingProfiles:\n- plugins: []\n", "epp.yaml: schedulingProfiles[0].name: is required"),
    (HEADER + P + "schedulingProfiles:\n- name: a\n  plugins:\n  - pluginRef: queue-scorer\n    wieght: 2\n",
     "epp.yaml: schedulingProfiles[0].plugins[0].wieght: unknown field (did you mean 'weight'?); "
     "allowed fields: pluginRef, weight"),
    (HEADER + P + "schedulingProfiles:\n- name: a\n- name: b\n",
     "epp.yaml: plugins: 2 scheduling profiles need a profile handler plugin; registered types: "),
    (HEADER + "plugins:\n- type: single-profile-handler\nschedulingProfiles:\n- name: a\n- name: b\n",
     "epp.yaml: schedulingProfiles: profile handler 'single-profile-handler': single-profile-handler requires "
     "exactly one scheduling profile, got 2: ['a', 'b']"),
    (HEADER + "featureGates: [flowcontrol]\n",
     "epp.yaml: featureGates[0]: unknown feature gate 'flowcontrol'; allowed: flowControl, "
     "haPopulateNonLeaderDatastore, enableLegacyMetrics, dataLayer, prepareDataPlugins"),
    (HEADER + "objectives:\n- {name: a, priority: high}\n",
     "epp.yaml: objectives[0].priority: must be an integer (negative = sheddable), got 'high'"),
    (HEADER + "objectives:\n- {name: a}\n- {name: a}\n",
     "epp.yaml: objectives[1].name: duplicate objective 'a'; objective names must be unique"),
    (HEADER + "objectives:\n- {name: a, prio: 1}\n",
     "epp.yaml: objectives[0].prio: unknown field; allowed fields: name, priority"),
    (HEADER + P + "saturationDetector: {pluginRef: detector}\n",
     "epp.yaml: saturationDetector.pluginRef: unknown plugin 'detector'; defined plugins: queue-scorer"),
    (HEADER + P + "parser: {pluginRef: queue-scorer}\n",
     "epp.yaml: parser.pluginRef: plugin 'queue-scorer' has type queue-scorer, which is not a request parser; "
     "parser types: anthropic-parser, openai-parser, passthrough-parser, sglanghttp-parser, vllmhttp-parser"),
    (HEADER + P + "dataLayer:\n  sources:\n  - pluginRef: queue-scorer\n",
     "epp.yaml: dataLayer.sources[0].pluginRef: plugin 'queue-scorer' has type queue-scorer; allowed types: "
     "metrics-data-source"),
    (HEADER + "plugins:\n- type: metrics-data-source\ndataLayer:\n  sources:\n  - pluginRef: metrics-data-source\n"
              "    extractors: [{pluginRef: metrics-data-source}]\n",
     "epp.yaml: dataLayer.sources[0].extractors[0].pluginRef: plugin 'metrics-data-source' has type "
     "metrics-data-source; allowed types: core-metrics-extractor"),
    (HEADER + "plugins:\n- type: metrics-data-source\n  parameters: {scheme: ftp}\n",
     "epp.yaml: plugins[0].parameters: plugin 'metrics-data-source': parameter 'scheme' must be one of "
     "['http', 'https'], got 'ftp'"),
    (HEADER + "plugins:\n- type: queue-scorer\n- type: queue-scorer\n  name: queue-scorer\n",
     "epp.yaml: plugins[1].name: duplicate plugin name"),
    (HEADER + "plugins:\n- {type: queue-scorer}\nplugins: []\n", "epp.yaml: invalid YAML:"),
    (HEADER + "plugins:\n- type: approx-prefix-cache-producer\n- type: prefix-cache-scorer\n"
              "  parameters: {maxPrefixBlocksToMatch: 10}\n",
     "epp.yaml: plugins[1].parameters: parameters ['maxPrefixBlocksToMatch'] of 'prefix-cache-scorer' belong to "
     "the producer; set them on plugin 'approx-prefix-cache-producer' instead"),
]


@pytest.mark.parametrize("text, message", INVALID)
def test_invalid_documents_fail_with_the_field_and_the_allowed_values(text, message):
    with pytest.raises(ConfigError) as err:
        load(text)
    assert str(err.value).startswith(message), str(err.value)


def test_consumed_key_without_any_producer_fails():
    reg = registry()
    reg.register_class(scorer_consuming("custom-key"))
    with pytest.raises(ConfigError) as err:
        load(HEADER + "plugins:\n- type: needs-data\n", reg)
    assert str(err.value) == ("epp.yaml: plugins: plugin 'needs-data' consumes data key 'custom-key' but no plugin "
                              "produces it and no default producer is registered; add a plugin that produces it")


def test_producer_cycle_fails():
    with pytest.raises(ConfigError) as err:
        load(HEADER + "plugins:\n- type: p-a\n- type: p-b\n", cyclic_registry())
    assert str(err.value) == "epp.yaml: plugins: data producers depend on each other in a cycle: p-a, p-b"


def test_errors_name_the_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(HEADER + P + "schedulingProfiles:\n- name: a\n  plugins:\n  - pluginRef: queue-scorer\n"
                                 "    weight: -2\n")
    with pytest.raises(ConfigError) as err:
        load_config(path, registry=registry())
    assert str(err.value) == f"{path}: schedulingProfiles[0].plugins[0].weight: must be a non-negative number, got -2"
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "missing.yaml", registry=registry())


async def test_start_and_stop_reach_every_plugin():
    calls = []

    class Tracking(Scorer):
        """Records start and stop."""
        type_name = "tracking-scorer"

        def __init__(self, name, params, context):
            super().__init__(name)

        async def start(self):
            calls.append(("start", self.name))

        async def stop(self):
            calls.append(("stop", self.name))

    reg = registry()
    reg.register_class(Tracking)
    loaded = load(HEADER + "plugins:\n- type: tracking-scorer\n- {type: tracking-scorer, name: two}\n", reg)
    await loaded.start()
    await loaded.stop()
    assert calls == [("start", "tracking-scorer"), ("start", "two"), ("stop", "two"), ("stop", "tracking-scorer")]
