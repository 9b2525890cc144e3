"""llm-d's document level: llm-d.ai/v1's layout and the conversion of the v1alpha1 forms to it, deprecated
forms with their one-line warning, what llm-d passes over (producers in profiles, weights on non-scorers,
parameters of types that read none), mapped types with their notices, and `epp check-config` over
folders and Helm values files."""

from __future__ import annotations

import logging
import re

import pytest

from epp.config import describe, load_config_text
from epp.config.check import LOADS, MAPS, REFUSED, TEMPLATE, check_config_main, check_paths
from epp.framework import ConfigError
from epp.tokenization.hub import hub_source

V1 = "apiVersion: llm-d.ai/v1\nkind: EndpointPickerConfig\n"
V1ALPHA1 = "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\n"
GIE = "apiVersion: inference.networking.x-k8s.io/v1alpha1\nkind: EndpointPickerConfig\n"


def load(text: str):
    return load_config_text(text, source="epp.yaml")


def shape(loaded) -> dict:
    """What a pipeline is made of, to compare two loads."""
    return {
        "plugins": [(e.name, e.type_name) for e in loaded.plugins],
        "profiles": {name: ([f.name for f in p.filters], [(w.scorer.name, w.weight) for w in p.scorers],
                            p.picker.name) for name, p in loaded.scheduler.profiles.items()},
        "discovery": loaded.discovery.name if loaded.discovery else None,
        "gates": sorted(loaded.feature_gates),
        "scrape": loaded.scrape,
    }


BODY = """featureGates: [flowControl]
plugins:
- {type: max-score-picker, name: maxScore}
- {type: static-discovery, name: my-disc, parameters: {endpoints: ['10.0.0.1:8000']}}
- type: queue-scorer
schedulingProfiles:
- name: default
  plugins: [{pluginRef: queue-scorer, weight: 2}, {pluginRef: maxScore}]
flowControl:
  maxRequests: "1k"
  defaultRequestTTL: 30s
"""


def test_v1alpha1_loads_as_its_v1_equivalent_with_one_deprecation():
    old = load(V1ALPHA1 + BODY + "dataLayer:\n  injectDefaults: false\n  discovery: {pluginRef: my-disc}\n")
    new = load(V1 + BODY + "dataLayer:\n  injectDefaults: false\n  discovery: {endpoints: {pluginRef: my-disc}}\n")
    assert shape(old) == shape(new)
    assert new.notices == () and not any("DEPRECATION" in n for n in new.notes)
    deprecations = [n.split(": DEPRECATION")[0] for n in old.notes if "DEPRECATION" in n]
    assert deprecations == ["apiVersion", "dataLayer.discovery.pluginRef"]
    assert old.flow_control is not None and old.flow_control.max_requests == 1000  # a quantity


def test_gie_data_section_is_the_data_layer_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="epp.config"):
        loaded = load(GIE + "plugins:\n- type: queue-scorer\ndata: {injectDefaults: false}\n")
    assert loaded.scrape is None  # injectDefaults: false took effect
    assert "data: DEPRECATION: `data` is deprecated (GIE v1.3-v1.4); use `dataLayer`" in loaded.notes
    assert any("use `dataLayer`" in r.getMessage() for r in caplog.records)
    with pytest.raises(ConfigError, match="both `data` and `dataLayer` are set"):
        load(GIE + "data: {}\ndataLayer: {}\n")


def test_peer_discovery_moves_to_discovery_peers_and_is_refused_with_what_to_use():
    with pytest.raises(ConfigError, match=r"dataLayer.discovery.peers: not supported: .* --peers"):
        load(V1ALPHA1 + "dataLayer: {peerDiscovery: {pluginRef: x}}\n")


def test_prepare_data_plugins_gate_is_accepted_as_always_on():
    loaded = load(GIE + "featureGates: [prepareDataPlugins]\nplugins:\n- type: queue-scorer\n")
    assert "featureGates[0]: prepareDataPlugins: no effect" in "\n".join(loaded.notes)


def test_a_producer_listed_in_a_profile_is_passed_over_as_llm_d_does():
    loaded = load(V1 + """plugins:
- type: approx-prefix-cache-producer
- type: prefix-cache-scorer
- type: random-picker
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: approx-prefix-cache-producer
  - pluginRef: prefix-cache-scorer
  - {pluginRef: random-picker, weight: 3}
""")
    profile = loaded.scheduler.profiles["default"]
    assert [w.scorer.name for w in profile.scorers] == ["prefix-cache-scorer"] and profile.picker.name == "random-picker"
    notes = "\n".join(loaded.notes)
    assert "schedulingProfiles[0].plugins[0].pluginRef: 'approx-prefix-cache-producer' (type " in notes
    assert "schedulingProfiles[0].plugins[2].weight: no effect: only scorers take a weight" in notes


def test_parameters_of_llm_d_types_that_read_none_are_ignored_with_a_note():
    loaded = load(GIE + "plugins:\n- type: queue-scorer\n  parameters: {hashBlockSize: 5, useInflight: false}\n")
    scorer = loaded.plugin("queue-scorer")
    assert scorer.loads.ledger is None  # ours still read
    assert loaded.notes[-1] == ("plugins[0].parameters: hashBlockSize: no effect (llm-d's queue-scorer reads no "
                                "parameters and ignores them too)")
    with pytest.raises(ConfigError, match="unknown parameter"):  # not for types that read parameters
        load(V1 + "plugins:\n- type: load-aware-scorer\n  parameters: {hashBlockSize: 5}\n")


def test_pd_profile_handler_hash_block_size_of_llm_d_0_3_is_a_notice():
    loaded = load(GIE + """plugins:
- type: prefill-filter
- type: decode-filter
- {type: pd-profile-handler, parameters: {threshold: 0, hashBlockSize: 5}}
schedulingProfiles:
- {name: prefill, plugins: [{pluginRef: prefill-filter}]}
- {name: decode, plugins: [{pluginRef: decode-filter}]}
""")
    assert loaded.notices == ("plugins[2].parameters.hashBlockSize: no effect (llm-d v0.3-v0.5's prefix block size): "
                              "uncached tokens are counted with the prefix producer's own blocks",)


LATENCY = V1 + """plugins:
- type: predicted-latency-producer
  parameters: {streamingMode: true}
- {type: latency-scorer, name: ttft-scorer, parameters: {ttftWeight: 1, tpotWeight: 0}}
- {type: slo-headroom-tier-filter}
- {type: latency-slo-admitter}
- {type: weighted-random-picker}
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: predicted-latency-producer
  - pluginRef: slo-headroom-tier-filter
  - pluginRef: ttft-scorer
  - pluginRef: weighted-random-picker
"""


def test_latency_predictor_plugins_map_to_our_online_predictions():
    loaded = load(LATENCY)
    types = {e.name: e.type_name for e in loaded.plugins}
    assert types["ttft-scorer"] == "predicted-ttft-scorer"
    assert types["slo-headroom-tier-filter"] == "tpot-slo-filter"
    assert types["predicted-latency-producer"] == "predicted-latency-producer"  # served by no plugin
    # The scorer reads the match in tokens by tier: an approximate producer publishing it was added.
    producer = loaded.plugin("approx-prefix-cache-producer")
    assert producer.publish_tier_match
    profile = loaded.scheduler.profiles["default"]
    assert [f.name for f in profile.filters] == ["slo-headroom-tier-filter"]
    assert [w.scorer.name for w in profile.scorers] == ["ttft-scorer"]
    notices = "\n".join(loaded.notices)
    assert "plugins[0].type: llm-d predicted-latency-producer -> no plugin: no latency-predictor sidecar" in notices
    assert "plugins[1].parameters.ttftWeight: ttftWeight 0" not in notices
    assert "plugins[3].type: llm-d latency-slo-admitter -> no plugin: the saturation admitter" in notices
    assert "llm-d latency-scorer -> predicted-ttft-scorer" in describe(loaded)


def test_latency_scorer_with_only_a_tpot_weight_says_it_ranks_by_ttft_here():
    loaded = load(V1 + "plugins:\n- {type: latency-scorer, parameters: {ttftWeight: 0, tpotWeight: 1}}\n"
                       "- type: approx-prefix-cache-producer\n")
    assert any("ttftWeight 0: this scorer ranks by predicted TPOT in llm-d; here it ranks by predicted TTFT" in n
               for n in loaded.notices)
    assert loaded.plugin("approx-prefix-cache-producer").publish_tier_match  # the configured one, switched on


@pytest.mark.parametrize("text, message", [
    (V1 + "plugins:\n- {type: latency-scorer, parameters: {ttftWeight: 0, tpotWeight: 0}}\n",
     "ttftWeight and tpotWeight are both 0"),
    (V1 + "plugins:\n- {type: latency-scorer, parameters: {headroomSelection: most}}\n",
     "unknown parameter(s) ['headroomSelection'] for llm-d's latency-scorer"),
    (V1 + "plugins:\n- {type: predicted-latency-producer, parameters: {contextTTL: soon}}\n", "contextTTL"),
    (V1 + "plugins:\n- {type: slo-headroom-tier-filter, parameters: {epsilonExploreNeg: 2}}\n",
     "must be a probability in [0, 1]"),
])
def test_mapped_types_check_llm_ds_parameters(text, message):
    with pytest.raises(ConfigError) as err:
        load(text)
    assert message in str(err.value)


def test_burst_producer_is_the_approximate_producer_with_its_window_noted():
    loaded = load(V1 + "plugins:\n- type: burst-prefix-cache-producer\n  parameters: {maxPerReplica: -1, "
                       "windowDurationMs: 50, maxPrefixTokensToMatch: 1024}\n- type: prefix-cache-scorer\n")
    entry = next(e for e in loaded.plugins if e.name == "burst-prefix-cache-producer")
    assert entry.type_name == "approx-prefix-cache-producer" and entry.parameters == {"maxPrefixTokensToMatch": 1024}
    assert [n.split(":")[0] for n in loaded.notices] == [
        "plugins[0].type", "plugins[0].parameters.maxPerReplica", "plugins[0].parameters.windowDurationMs"]


def test_the_uds_tokenizer_sidecar_becomes_the_models_tokenizer_from_the_hub():
    loaded = load(GIE + "plugins:\n- type: tokenizer\n  parameters: {modelName: Qwen/Qwen3-32B, udsTokenizerConfig: "
                        "{socketFile: /tmp/tokenizer/tokenizer-uds.socket}}\n")
    producer = loaded.plugin("tokenizer")
    assert producer.backend == "local"
    assert producer._pool.model_dirs == {"Qwen/Qwen3-32B": hub_source("Qwen/Qwen3-32B")}
    assert any("udsTokenizerConfig: llm-d's tokenizer sidecar is not used" in n for n in loaded.notices)


def test_the_precise_scorers_tokenizer_pool_and_older_placements_map_onto_the_producer():
    loaded = load(GIE + """plugins:
- type: precise-prefix-cache-scorer
  parameters:
    indexerConfig:
      tokenProcessorConfig: {blockSize: 16, hashSeed: "42"}
      speculativeIndexing: true
      tokenizersPoolConfig:
        modelName: Qwen/Qwen2.5-1.5B-Instruct
        hf: {tokenizersCacheDir: /cache/tokenizers}
        uds: null
    kvEventsConfig: {zmqEndpoint: "tcp://*:5557", discoverPods: false}
""")
    producer = loaded.plugin("precise-prefix-cache-scorer-producer")
    assert producer.block_size == 16 and producer.index.speculative_ttl_s == 2.0
    assert producer.tokenizers.model_dirs == {"Qwen/Qwen2.5-1.5B-Instruct": hub_source("Qwen/Qwen2.5-1.5B-Instruct")}
    mapping = next(e.mapping for e in loaded.plugins if e.name == "precise-prefix-cache-scorer-producer")
    assert "indexerConfig.tokenProcessorConfig: DEPRECATION: its older place" in mapping
    assert "indexerConfig.tokenizersPoolConfig.hf.tokenizersCacheDir: no effect" in mapping


def test_a_precise_wrapper_named_as_an_extractor_means_its_producer():
    loaded = load(GIE + """plugins:
- type: endpoint-notification-source
- type: precise-prefix-cache-scorer
  parameters: {kvEventsConfig: {discoverPods: true}, tokenizers: {m: /nonexistent}}
dataLayer:
  sources:
  - pluginRef: endpoint-notification-source
    extractors: [{pluginRef: precise-prefix-cache-scorer}]
""")
    assert [x.name for x in loaded.data_sources[0].extractors] == ["precise-prefix-cache-scorer-producer"]


@pytest.mark.parametrize("type_name, reason", [
    ("lmetric-scorer", "not an llm-d router plugin"),
    ("thunder-agent", "ThunderAgent is not implemented"),
    ("pd-slo-optimizer", "an experimental build's plugin"),
    ("multicluster-file-discovery", "multi-cluster routing (a hub picker"),
])
def test_types_that_cannot_be_served_are_refused_naming_what_to_use(type_name, reason):
    with pytest.raises(ConfigError) as err:
        load(V1 + f"plugins:\n- type: {type_name}\n")
    assert f"plugins[0].type: llm-d plugin type {type_name!r} is not supported here: {reason}" in str(err.value)


# ---- epp check-config over files, folders and values files ----------------------------------------

VALUES = """router:
  epp:
    pluginsConfigFile: a.yaml
    pluginsCustomConfig:
      a.yaml: |
        apiVersion: llm-d.ai/v1
        kind: EndpointPickerConfig
        plugins:
        - type: queue-scorer
      b.yaml: |
        apiVersion: llm-d.ai/v1
        kind: EndpointPickerConfig
        plugins:
        - type: no-such-scorer
  modelServers:
    matchLabels: {app: vllm}
"""


def test_a_values_file_is_checked_config_by_config(tmp_path, capsys):
    path = tmp_path / "guide.values.yaml"
    path.write_text(VALUES)
    assert check_config_main(str(path)) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"{path} (router.epp.pluginsCustomConfig.a.yaml): loads"
    assert lines[1].startswith(f"{path} (router.epp.pluginsCustomConfig.b.yaml): refused: plugins[0].type: unknown "
                               "plugin type 'no-such-scorer'")
    assert lines[2] == "2 config(s): 1 load, 0 map with notices, 1 refused"


def test_a_folder_is_walked_and_every_outcome_counted(tmp_path, capsys):
    (tmp_path / "good.yaml").write_text(V1 + "plugins:\n- type: queue-scorer\n")
    (tmp_path / "mapped.yaml").write_text(LATENCY)
    sub = tmp_path / "guides"
    sub.mkdir()
    (sub / "values.yaml").write_text(VALUES)
    (sub / "template.yaml").write_text(V1 + "plugins:\n- type: token-producer\n  parameters: {modelName: "
                                            "\"${MODEL_NAME}\"}\n")
    (sub / "endpoints.yaml").write_text("endpoints: [10.0.0.1:8000]\n")
    outcomes, without = check_paths([str(tmp_path)])
    assert [(o.config.label.removeprefix(f"{tmp_path}/"), o.status) for o in outcomes] == [
        ("good.yaml", LOADS),
        ("mapped.yaml", MAPS),
        ("guides/template.yaml", TEMPLATE),
        ("guides/values.yaml (router.epp.pluginsCustomConfig.a.yaml)", LOADS),
        ("guides/values.yaml (router.epp.pluginsCustomConfig.b.yaml)", REFUSED),
    ]
    assert without == [str(sub / "endpoints.yaml")]
    assert check_config_main([str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert out.splitlines()[-1] == "5 config(s): 2 load, 1 map with notices, 1 refused, 1 template(s) set aside"
    assert f"{sub / 'template.yaml'}: template: holds '${{MODEL_NAME}}': render the template" in out
    assert f"{tmp_path / 'mapped.yaml'}: maps with notices: plugins[0].type: llm-d predicted-latency-producer" in out


def test_several_files_list_one_line_each_and_details_print_pipelines(tmp_path, capsys):
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text(V1 + "plugins:\n- type: queue-scorer\n")
    b.write_text(V1 + "plugins:\n- type: kv-cache-utilization-scorer\n")
    assert check_config_main([str(a), str(b)], details=True) == 0
    out = capsys.readouterr().out
    assert f"{a}: loads\n    EndpointPickerConfig {a}: OK\n" in out
    assert out.endswith("2 config(s): 2 load, 0 map with notices, 0 refused\n")


def test_one_plain_config_still_prints_its_pipeline_unless_asked_for_a_line(tmp_path, capsys):
    path = tmp_path / "epp.yaml"
    path.write_text(V1 + "plugins:\n- type: queue-scorer\n")
    assert check_config_main(str(path)) == 0
    assert capsys.readouterr().out.startswith(f"EndpointPickerConfig {path}: OK")
    assert check_config_main(str(path), listing=True) == 0
    assert capsys.readouterr().out == f"{path}: loads\n1 config(s): 1 load, 0 map with notices, 0 refused\n"


@pytest.mark.parametrize("extra, message", [
    ("requestHandler: {propagatePriority: true}\n",
     "requestHandler.propagatePriority: not supported: the request body is forwarded unchanged"),
    ("featureGates: [flowControl]\nflowControl: {bandSelectionPolicyPluginRef: by-weight}\n",
     "flowControl.bandSelectionPolicyPluginRef: not supported: bands are offered dispatch from the highest priority"),
])
def test_v1_fields_this_picker_cannot_act_on_are_refused_with_the_reason(extra, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load(V1 + "plugins:\n- type: queue-scorer\n" + extra)


def test_propagate_priority_false_is_the_behaviour_here():
    loaded = load(V1 + "plugins:\n- type: queue-scorer\nrequestHandler: {propagatePriority: false}\n")
    assert "requestHandler.propagatePriority: false: the body is forwarded unchanged, as here" in loaded.notes
