"""The smaller top-level sections: feature gates, objectives, request handler (parsers) and data layer.

Each field either acts or is refused with the reason; a field accepted only because what it
asks for is always the case here gets a note that `epp check-config` prints.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from epp.config.plugins import PluginSet
from epp.config.schema import (
    DATA_SOURCE_TYPES,
    DCGM_SOURCE_TYPE,
    EXTRACTOR_TYPES,
    KNOWN_FEATURE_GATES,
    METRICS_SOURCE_TYPE,
    OBJECTIVE_FIELDS,
    Document,
)
from epp.framework.parsing import DEFAULT_PARSER_TYPES, Parser
from epp.framework.plugin import Plugin
from epp.requestcontrol.pipeline import DataSourceConfig, PluginEntry, ScrapeSettings

# Gates whose feature is always on here: accepted, with a note.
ALWAYS_ON_GATES = {
    "haPopulateNonLeaderDatastore": "every picker replica keeps its endpoints and their metrics, leader or not",
    "enableLegacyMetrics": "GIE's legacy metrics path reads the same vLLM series this scraper reads",
    "dataLayer": "GIE's deprecated gate; the data layer is always on",
    "prepareDataPlugins": "data producers always run before scheduling here",
}
DATA_LAYER_FIELDS = ("injectDefaults", "sources", "discovery", "crossReplica")
DISCOVERY_FIELDS = ("endpoints", "peers")
CROSS_REPLICA_FIELDS = ("syncerPluginRef", "syncInterval", "publishTimeout")
# llm-d data-layer fields this picker cannot act on, and what to use instead.
REFUSED_DATA_LAYER_FIELDS = {
    "discovery.peers": "the other pickers of a pool are given with --peers (or --workers); peer discovery plugins "
                       "are not supported",
    "crossReplica": "pickers of one pool share prefix routes, KV claims, in-flight load and scrapes over the peer "
                    "link (--peers or --workers); cross-replica syncer plugins are not supported",
}
PASSTHROUGH_PARSER = "passthrough-parser"


def feature_gates(document: Document, doc: Mapping[str, Any]) -> frozenset[str]:
    """The `featureGates` that are on: `name`, `name=true` or `name=false`, known gates only."""
    gates = []
    for i, raw in enumerate(document.sequence(doc.get("featureGates"), "featureGates", "feature gate names")):
        path = f"featureGates[{i}]"
        if not isinstance(raw, str):
            raise document.fail(path, f"must be a gate name, name=true or name=false, got {raw!r}")
        gate, sep, value = raw.partition("=")
        if gate not in KNOWN_FEATURE_GATES:
            raise document.fail(path, f"unknown feature gate {gate!r}; allowed: {', '.join(KNOWN_FEATURE_GATES)}")
        if sep and value not in ("true", "false"):
            raise document.fail(path, f"gate value must be true or false, got {raw!r}")
        enabled = value != "false"
        if gate in ALWAYS_ON_GATES:
            if not enabled:
                raise document.fail(path, f"{gate}=false is not supported: {ALWAYS_ON_GATES[gate]}")
            document.note(path, f"{gate}: no effect ({ALWAYS_ON_GATES[gate]})")
        if enabled:
            gates.append(gate)
    return frozenset(gates)


def objectives(document: Document, doc: Mapping[str, Any]) -> dict[str, int]:
    """The `objectives`: name -> priority (negative: sheddable)."""
    out: dict[str, int] = {}
    for i, raw in enumerate(document.sequence(doc.get("objectives"), "objectives", "{name, priority} entries")):
        path = f"objectives[{i}]"
        item = document.mapping(raw, path, OBJECTIVE_FIELDS, required=("name",))
        name = document.string(item["name"], f"{path}.name")
        if name in out:
            raise document.fail(f"{path}.name", f"duplicate objective {name!r}; objective names must be unique")
        priority = item.get("priority", 0)
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise document.fail(f"{path}.priority", f"must be an integer (negative = sheddable), got {priority!r}")
        out[name] = priority
    return out


def parsers(document: Document, plugins: PluginSet, doc: Mapping[str, Any]) -> tuple[Parser, ...]:
    """`requestHandler.parsers` (or the deprecated `parser`, copied as llm-d does), in the order they are asked.

    None listed: llm-d's default chain (`DEFAULT_PARSER_TYPES`), each the configured plugin of
    that type when `plugins` defines exactly one, else auto-created. A chain without a fallback
    (a parser that claims no path) gets `passthrough-parser` last, so requests on other paths
    are still routed, by load, as they always were here.
    """
    refs: list[tuple[Any, str]] = []
    raw = doc.get("requestHandler")
    if raw is not None:
        item = document.mapping(raw, "requestHandler", ("parsers", "parser"))
        for i, entry in enumerate(document.sequence(item.get("parsers"), "requestHandler.parsers", "parsers")):
            path = f"requestHandler.parsers[{i}]"
            refs.append((document.mapping(entry, path, ("pluginRef",), required=("pluginRef",))["pluginRef"],
                         f"{path}.pluginRef"))
        if item.get("parser") is not None:
            # llm-d's API reference (and its deprecation comment) show `requestHandler.parser`; its decoder
            # has only `parsers`. Configs written from those docs are read as a chain of that one parser.
            single = document.mapping(item["parser"], "requestHandler.parser", ("pluginRef",), required=("pluginRef",))
            if refs:
                raise document.fail("requestHandler.parser", "set either requestHandler.parsers or the single "
                                    "requestHandler.parser, not both")
            document.note("requestHandler.parser", "read as requestHandler.parsers: [it] (llm-d's decoder knows "
                          "only parsers)")
            refs.append((single["pluginRef"], "requestHandler.parser.pluginRef"))
    legacy = doc.get("parser")
    if legacy is not None:
        item = document.mapping(legacy, "parser", ("pluginRef",), required=("pluginRef",))
        if refs:
            document.note("parser", "deprecated; ignored because requestHandler.parsers is set (as in llm-d)")
        else:
            document.note("parser", "deprecated; copied into requestHandler.parsers (as in llm-d)")
            refs.append((item["pluginRef"], "parser.pluginRef"))
    chain: list[Parser] = []
    for ref, path in refs:
        entry = plugins.ref(ref, path)
        if not isinstance(entry.plugin, Parser):
            raise document.fail(path, f"plugin {entry.name!r} has type {entry.type_name}, which is not a request "
                                f"parser; parser types: {', '.join(plugins.types_of(Parser))}")
        if entry.plugin in chain:
            raise document.fail(path, f"parser {entry.name!r} is listed twice")
        chain.append(entry.plugin)
    if not chain:
        if not all(t in plugins.registry.types() for t in DEFAULT_PARSER_TYPES):
            return ()  # a registry without the parsers (a test's): requests are read by the installed defaults
        for type_name in DEFAULT_PARSER_TYPES:
            chain.append(_default_parser(plugins, type_name))
    if not any(p.fallback for p in chain):
        document.note("requestHandler.parsers", f"no fallback parser listed; {PASSTHROUGH_PARSER} added last, so "
                      "requests on paths no listed parser claims are routed by load with their body unread")
        chain.append(_default_parser(plugins, PASSTHROUGH_PARSER))
    return tuple(chain)


def _default_parser(plugins: PluginSet, type_name: str) -> Parser:
    """The configured plugin of `type_name` when there is exactly one, else one auto-created with defaults."""
    configured = [e for e in plugins.entries if e.type_name == type_name and not e.auto_created]
    if len(configured) == 1 and isinstance(configured[0].plugin, Parser):
        return configured[0].plugin
    entry = plugins.add(type_name, plugins.free_name(type_name), None, "requestHandler.parsers",
                        auto_created="llm-d's default parser chain (requestHandler.parsers)")
    assert isinstance(entry.plugin, Parser)
    return entry.plugin


def _scrape_settings(entry: PluginEntry) -> ScrapeSettings:
    """The scrape settings a `metrics-data-source` plugin holds."""
    source: Any = entry.plugin
    return ScrapeSettings(scheme=source.scheme, path=source.path, insecure_skip_verify=source.insecure_skip_verify,
                          ca_cert_path=source.ca_cert_path, client_cert_path=source.client_cert_path,
                          client_key_path=source.client_key_path, interval_s=source.interval_s,
                          families=source.families)


def discovery_plugin(document: Document, plugins: PluginSet, item: Mapping[str, Any]) -> Plugin | None:
    """The endpoint discovery plugin `dataLayer.discovery.endpoints.pluginRef` names (None: the command line's)."""
    from epp.datalayer.discovery_plugins import EndpointDiscoveryPlugin

    raw = item.get("discovery")
    if raw is None:
        return None
    discovery = document.mapping(raw, "dataLayer.discovery", DISCOVERY_FIELDS)
    if discovery.get("peers") is not None:
        raise document.fail("dataLayer.discovery.peers", f"not supported: {REFUSED_DATA_LAYER_FIELDS['discovery.peers']}")
    if discovery.get("endpoints") is None:
        return None
    path = "dataLayer.discovery.endpoints"
    ref = document.mapping(discovery["endpoints"], path, ("pluginRef",), required=("pluginRef",))["pluginRef"]
    entry = plugins.ref(ref, f"{path}.pluginRef")
    if not isinstance(entry.plugin, EndpointDiscoveryPlugin):
        types = ", ".join(plugins.types_of(EndpointDiscoveryPlugin)) or "none"
        raise document.fail(f"{path}.pluginRef", f"plugin {entry.name!r} (type {entry.type_name}) is no endpoint "
                            f"discovery plugin; discovery types: {types}")
    return entry.plugin


def data_layer(document: Document, plugins: PluginSet, doc: Mapping[str, Any]
               ) -> tuple[tuple[DataSourceConfig, ...], ScrapeSettings | None, Plugin | None]:
    """The `dataLayer.sources` with their extractors, the scrape settings they make (None: no scraping) and
    the endpoint discovery plugin (None: the command line's)."""
    raw = doc.get("dataLayer")
    item = document.mapping(raw if raw is not None else {}, "dataLayer", DATA_LAYER_FIELDS)
    if item.get("crossReplica") is not None:
        document.mapping(item["crossReplica"], "dataLayer.crossReplica", CROSS_REPLICA_FIELDS)
        raise document.fail("dataLayer.crossReplica", f"not supported: {REFUSED_DATA_LAYER_FIELDS['crossReplica']}")
    discovery = discovery_plugin(document, plugins, item)
    inject_defaults = document.boolean(item.get("injectDefaults"), "dataLayer.injectDefaults", True)
    sources: list[DataSourceConfig] = []
    metrics_sources: list[PluginEntry] = []
    for i, raw_source in enumerate(document.sequence(item.get("sources"), "dataLayer.sources", "data sources")):
        path = f"dataLayer.sources[{i}]"
        source_item = document.mapping(raw_source, path, ("pluginRef", "extractors"), required=("pluginRef",))
        plugins.typed_ref(source_item["pluginRef"], f"{path}.pluginRef", DATA_SOURCE_TYPES)
        entry = plugins.ref(source_item["pluginRef"], f"{path}.pluginRef")
        if entry.type_name == METRICS_SOURCE_TYPE and metrics_sources:
            raise document.fail(path, "only one metrics-data-source is supported: the scraper reads one metrics "
                                "URL per endpoint")
        extractors = []
        for j, raw_ex in enumerate(document.sequence(source_item.get("extractors"), f"{path}.extractors",
                                                     "extractors")):
            ex_path = f"{path}.extractors[{j}]"
            ex_item = document.mapping(raw_ex, ex_path, ("pluginRef",), required=("pluginRef",))
            extractors.append(plugins.extractor_ref(ex_item["pluginRef"], f"{ex_path}.pluginRef",
                                                    EXTRACTOR_TYPES[entry.type_name]))
        if entry.type_name == METRICS_SOURCE_TYPE:
            if not extractors:
                raise document.fail(f"{path}.extractors", "a metrics source needs core-metrics-extractor: without "
                                    "an extractor nothing it scrapes is read")
            metrics_sources.append(entry)
        attach = getattr(entry.plugin, "attach", None)  # a source that feeds its extractors itself (DCGM)
        if attach is not None:
            attach(extractors)
        sources.append(DataSourceConfig(entry.plugin, tuple(extractors)))
    listed = {id(s.source) for s in sources}
    for unpaired in (e for e in plugins.entries if e.type_name == DCGM_SOURCE_TYPE and id(e.plugin) not in listed):
        raise document.fail("dataLayer.sources", f"{unpaired.type_name} {unpaired.name!r} is in no source: list it "
                            "with its dcgm-extractor (llm-d reads its pages through dataLayer.sources only)")
    if not metrics_sources:
        # A metrics-data-source in `plugins` but in no `dataLayer.sources` is the source (llm-d
        # injects one of each default type that is missing).
        configured = [e for e in plugins.entries if e.type_name == METRICS_SOURCE_TYPE]
        if len(configured) > 1:
            raise document.fail("plugins", "several metrics-data-source plugins and no dataLayer.sources naming "
                                "one; only one metrics source is supported")
        metrics_sources = configured
    if metrics_sources:
        return tuple(sources), _scrape_settings(metrics_sources[0]), discovery
    if not inject_defaults:
        document.note("dataLayer.injectDefaults", "false and no metrics source: endpoints' /metrics are not "
                      "scraped (scorers see no queue or KV-cache figures)")
        return tuple(sources), None, discovery
    return tuple(sources), ScrapeSettings(), discovery
