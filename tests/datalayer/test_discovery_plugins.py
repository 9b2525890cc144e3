"""Discovery as plugins: the config names one (`dataLayer.discovery.endpoints.pluginRef`), else the command
line's flags make the default one; llm-d's file-discovery and its file format; an outside discovery type."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry

from epp.config import load_config_text
from epp.datalayer.discovery import Discovery, StaticDiscovery
from epp.datalayer.discovery_plugins import (
    DiscoveryEnvironment,
    EndpointDiscoveryPlugin,
    EndpointSelectorDiscoveryPlugin,
    FileDiscoveryPlugin,
    InferencePoolDiscoveryPlugin,
    StaticDiscoveryPlugin,
    default_discovery,
)
from epp.datalayer.registry import EndpointRegistry, EndpointSpec
from epp.framework import ConfigError
from epp.framework.registry import PluginRegistry, default_registry
from epp.metrics import EppMetrics
from epp.server.datalayer_startup import start_data_layer

V1 = "apiVersion: llm-d.ai/v1\nkind: EndpointPickerConfig\n"


def options(**given):
    """`epp serve`'s options as start_data_layer reads them (no flag given unless named)."""
    fields = dict(pool_name=None, pool_namespace="default", pool_group="inference.networking.k8s.io",
                  endpoint_selector=None, endpoint_target_ports=(), kubeconfig=None, endpoints=[],
                  endpoints_file=None, scrape_metrics=False, refresh_metrics_interval_s=0.05)
    fields.update(given)
    return SimpleNamespace(**fields)


async def started(opts, discovery=None) -> tuple[EndpointRegistry, list]:
    registry = EndpointRegistry()
    running = await start_data_layer(opts, registry, EppMetrics(CollectorRegistry()), discovery_plugin=discovery)
    return registry, running


async def stop(running) -> None:
    for item in running:
        await item.stop()


def endpoints_file(tmp_path, text: str) -> str:
    path = tmp_path / "endpoints.yaml"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("given, expected_type", [
    ({}, StaticDiscoveryPlugin),
    ({"endpoints": [EndpointSpec("10.0.0.1", 8000)]}, StaticDiscoveryPlugin),
    ({"endpoints_file": "/tmp/e.yaml"}, FileDiscoveryPlugin),
    ({"pool_name": "pool"}, InferencePoolDiscoveryPlugin),
    ({"endpoint_selector": {"app": "vllm"}, "endpoint_target_ports": (8000,)}, EndpointSelectorDiscoveryPlugin),
])
def test_the_command_line_flags_make_the_default_discovery_plugin(given, expected_type):
    plugin = default_discovery(options(**given))
    assert type(plugin) is expected_type


async def test_endpoints_flag_still_serves_its_list():
    registry, running = await started(options(endpoints=[EndpointSpec("10.0.0.1", 8000, {"role": "decode"})]))
    assert [(ep.name, dict(ep.labels)) for ep in registry.snapshot()] == [("10.0.0.1:8000", {"role": "decode"})]
    await stop(running)


async def test_endpoints_file_flag_follows_the_file(tmp_path):
    path = endpoints_file(tmp_path, "endpoints: [10.0.0.1:8000]\n")
    registry, running = await started(options(endpoints_file=path))
    assert [ep.name for ep in registry.snapshot()] == ["10.0.0.1:8000"]
    discovery = running[0]
    (tmp_path / "endpoints.yaml").write_text("endpoints: [10.0.0.2:8000, 10.0.0.3:8000]\n")
    assert await discovery.poll_once()
    assert sorted(ep.name for ep in registry.snapshot()) == ["10.0.0.2:8000", "10.0.0.3:8000"]
    await stop(running)


def load(text: str):
    return load_config_text(V1 + text, source="epp.yaml")


async def test_a_config_names_llm_d_file_discovery_with_llm_d_file_format(tmp_path):
    # llm-d's file: name (unique), namespace, address, port as a string, labels.
    path = endpoints_file(tmp_path, """endpoints:
- {name: vllm-0, address: 10.0.0.1, port: "8000", labels: {model: qwen}}
- {name: vllm-1, namespace: serving, address: 10.0.0.2, port: "8001"}
""")
    loaded = load(f"""plugins:
- {{type: file-discovery, name: disc, parameters: {{path: {path}, watchFile: true}}}}
- type: queue-scorer
dataLayer:
  discovery: {{endpoints: {{pluginRef: disc}}}}
""")
    assert isinstance(loaded.discovery, FileDiscoveryPlugin) and loaded.discovery.watch
    registry, running = await started(options(), loaded.discovery)
    assert sorted((ep.name, dict(ep.labels)) for ep in registry.snapshot()) == \
        [("10.0.0.1:8000", {"model": "qwen"}), ("10.0.0.2:8001", {})]
    await stop(running)


async def test_file_discovery_without_watch_reads_the_file_once(tmp_path):
    path = endpoints_file(tmp_path, "endpoints: [{name: a, address: 10.0.0.1, port: '8000'}]\n")
    plugin = load(f"plugins:\n- {{type: file-discovery, parameters: {{path: {path}, pollInterval: 0.05}}}}\n"
                  "dataLayer: {discovery: {endpoints: {pluginRef: file-discovery}}}\n").discovery
    assert isinstance(plugin, FileDiscoveryPlugin) and not plugin.watch
    registry, running = await started(options(), plugin)
    (tmp_path / "endpoints.yaml").write_text("endpoints: [{name: b, address: 10.0.0.9, port: '8000'}]\n")
    discovery = running[0]
    await discovery._task  # a one-time read ends after its first good view
    assert [ep.name for ep in registry.snapshot()] == ["10.0.0.1:8000"]
    await stop(running)


async def test_v1alpha1_bare_discovery_plugin_ref_loads_with_llm_ds_deprecation(caplog):
    with caplog.at_level(logging.WARNING, logger="epp.config"):
        loaded = load_config_text("apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nplugins:\n"
                                  "- {type: static-discovery, parameters: {endpoints: ['10.0.0.1:8000']}}\n"
                                  "dataLayer: {discovery: {pluginRef: static-discovery}}\n", source="epp.yaml")
    assert isinstance(loaded.discovery, StaticDiscoveryPlugin)
    deprecations = [r.getMessage() for r in caplog.records if "discovery.pluginRef" in r.getMessage()]
    assert deprecations == ["epp.yaml: dataLayer.discovery.pluginRef: DEPRECATION: dataLayer.discovery.pluginRef is "
                            "deprecated, use dataLayer.discovery.endpoints.pluginRef instead. If both are set, the new "
                            "field is used."]


async def test_the_configs_discovery_wins_over_the_flags_with_a_warning(caplog):
    plugin = load("plugins:\n- {type: static-discovery, parameters: {endpoints: ['10.0.0.7:8000']}}\n"
                  "dataLayer: {discovery: {endpoints: {pluginRef: static-discovery}}}\n").discovery
    with caplog.at_level(logging.WARNING):
        registry, running = await started(options(endpoints=[EndpointSpec("10.0.0.1", 8000)]), plugin)
    assert [ep.name for ep in registry.snapshot()] == ["10.0.0.7:8000"]
    assert any("--endpoints is not used for discovery" in r.getMessage() for r in caplog.records)
    await stop(running)


@pytest.mark.parametrize("params, message", [
    ({}, "parameter 'endpoints' is required"),
    ({"endpoints": ["10.0.0.1"]}, "expected ip:port"),
])
def test_static_discovery_parameters_are_checked(params, message):
    with pytest.raises(ConfigError, match=message):
        default_registry().build("static-discovery", "s", params, None)


@pytest.mark.parametrize("type_name, params, message", [
    ("file-discovery", {}, "parameter 'path' is required"),
    ("inference-pool-discovery", {}, "parameter 'poolName' is required"),
    ("inference-pool-discovery", {"poolName": "p", "poolGroup": "x"}, "must be one of"),
    ("endpoint-selector-discovery", {"matchLabels": {"app": "v"}}, "'targetPorts' is required"),
    ("endpoint-selector-discovery", {"matchLabels": {"app": "v"}, "targetPorts": [0]}, "targetPorts: '0' is not a port"),
])
def test_discovery_plugin_parameters_are_checked(type_name, params, message):
    with pytest.raises(ConfigError, match=message):
        default_registry().build(type_name, type_name, params, None)


class ListDiscovery(EndpointDiscoveryPlugin):
    """An outside package's discovery type: endpoints from its own parameter (here: a fixed list)."""

    type_name = "inventory-discovery"

    def __init__(self, name, params, context=None):
        super().__init__(name)
        self.hosts = params.list("hosts", None) or []

    def discovery(self, endpoints: EndpointRegistry, env: DiscoveryEnvironment) -> Discovery:
        return StaticDiscovery(endpoints, [EndpointSpec(h, 9000, {"from": "inventory"}) for h in self.hosts])

    def source(self) -> str:
        return f"{len(self.hosts)} hosts from the inventory"


async def test_an_outside_discovery_type_is_named_by_the_config_like_a_built_in_one():
    registry = PluginRegistry()
    registry.register_class(ListDiscovery)
    for spec_type in default_registry().types():
        registry.register(default_registry().get(spec_type))
    loaded = load_config_text(V1 + "plugins:\n- {type: inventory-discovery, parameters: {hosts: [10.9.0.1]}}\n"
                              "dataLayer: {discovery: {endpoints: {pluginRef: inventory-discovery}}}\n",
                              source="epp.yaml", registry=registry)
    pool, running = await started(options(), loaded.discovery)
    assert [(ep.name, ep.labels["from"]) for ep in pool.snapshot()] == [("10.9.0.1:9000", "inventory")]
    await stop(running)


async def test_inference_pool_discovery_plugin_watches_the_pool(api, kubeconfig):
    from bench.support.k8s_apiserver import inference_pool, pod

    api.apply(inference_pool("pool", {"app": "vllm"}, [8000]))
    api.apply(pod("a", "10.1.0.1"))
    plugin = load(f"plugins:\n- {{type: inference-pool-discovery, parameters: {{poolName: pool, namespace: default, "
                  f"kubeconfig: {kubeconfig}}}}}\n"
                  "dataLayer: {discovery: {endpoints: {pluginRef: inference-pool-discovery}}}\n").discovery
    assert plugin.source() == "InferencePool default/pool (inference.networking.k8s.io): its Ready pods"
    registry, running = await started(options(), plugin)
    assert [ep.name for ep in registry.snapshot()] == ["10.1.0.1:8000"]
    await stop(running)


async def test_endpoint_selector_discovery_plugin_selects_pods(api, kubeconfig):
    from bench.support.k8s_apiserver import pod

    api.apply(pod("a", "10.1.0.1", labels={"app": "vllm"}))
    api.apply(pod("b", "10.1.0.2", labels={"app": "other"}))
    plugin = load(f"plugins:\n- {{type: endpoint-selector-discovery, parameters: {{matchLabels: {{app: vllm}}, "
                  f"targetPorts: [8000, 8001], kubeconfig: {kubeconfig}}}}}\n"
                  "dataLayer: {discovery: {endpoints: {pluginRef: endpoint-selector-discovery}}}\n").discovery
    registry, running = await started(options(), plugin)
    assert sorted(ep.name for ep in registry.snapshot()) == ["10.1.0.1:8000", "10.1.0.1:8001"]
    await stop(running)
