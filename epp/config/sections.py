"""The smaller top-level sections: feature gates, objectives, parser and data layer."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from epp.config.plugins import PluginSet
from epp.config.schema import (
                               DATA_SOURCE_TYPES,
                               EXTRACTOR_TYPES,
                               KNOWN_FEATURE_GATES,
                               OBJECTIVE_FIELDS,
                               PARSER_TYPES,
                               Document,
)
from epp.framework.plugin import Plugin
from epp.requestcontrol.pipeline import DataSourceConfig


def feature_gates(document: Document, doc: Mapping[str, Any]) -> frozenset[str]:
    """The `featureGates` (only known ones)."""
    gates = []
    for i, gate in enumerate(document.sequence(doc.get("featureGates"), "featureGates", "feature gate names")):
        if gate not in KNOWN_FEATURE_GATES:
            raise document.fail(f"featureGates[{i}]", f"unknown feature gate {gate!r}; allowed: "
                                f"{', '.join(KNOWN_FEATURE_GATES)}")
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


def parser(document: Document, plugins: PluginSet, doc: Mapping[str, Any]) -> Plugin | None:
    """The plugin `parser.pluginRef` names, if any."""
    raw = doc.get("parser")
    if raw is None:
        return None
    item = document.mapping(raw, "parser", ("pluginRef",), required=("pluginRef",))
    return plugins.typed_ref(item["pluginRef"], "parser.pluginRef", PARSER_TYPES)


def data_layer(document: Document, plugins: PluginSet, doc: Mapping[str, Any]) -> tuple[DataSourceConfig, ...]:
    """The `dataLayer.sources`, each with its extractors."""
    raw = doc.get("dataLayer")
    if raw is None:
        return ()
    item = document.mapping(raw, "dataLayer", ("sources",))
    sources = []
    for i, raw_source in enumerate(document.sequence(item.get("sources"), "dataLayer.sources", "data sources")):
        path = f"dataLayer.sources[{i}]"
        source_item = document.mapping(raw_source, path, ("pluginRef", "extractors"), required=("pluginRef",))
        source = plugins.typed_ref(source_item["pluginRef"], f"{path}.pluginRef", DATA_SOURCE_TYPES)
        extractors = []
        for j, raw_ex in enumerate(document.sequence(source_item.get("extractors"), f"{path}.extractors",
                                                     "extractors")):
            ex_path = f"{path}.extractors[{j}]"
            ex_item = document.mapping(raw_ex, ex_path, ("pluginRef",), required=("pluginRef",))
            extractors.append(plugins.typed_ref(ex_item["pluginRef"], f"{ex_path}.pluginRef", EXTRACTOR_TYPES))
        sources.append(DataSourceConfig(source, tuple(extractors)))
    return tuple(sources)
