"""Strict loader of the GIE `EndpointPickerConfig` YAML into the runtime pipeline (`LoadedConfig`).

One module per job: `yaml_reading` (strict YAML, the file named in errors), `schema` (the
document's shape), `defaults` (what GIE fills in), `plugins` (instances through the registry),
`profiles`, `producers` and `ordering` (data producers in dependency order), `saturation`
(detector, shedding admitter, flow controller), `sections` (feature gates, objectives, parser,
data layer), `pipeline` (the result), `describe` (the text of `epp check-config`). This module
assembles them. Every error names the source (file), the field path inside the document and
what is allowed there.
"""

from __future__ import annotations

import os
from typing import Any

from epp.config.compose import DEFAULT_CONFIG_YAML
from epp.config.defaults import DEFAULT_SATURATION_DETECTOR_TYPE
from epp.config.plugins import PluginSet
from epp.config.producers import ProducerWiring
from epp.config.profiles import ProfileBuilder
from epp.config.saturation import add_shedding_admitter, flow_controller, saturation_detector
from epp.config.schema import API_VERSION, KIND, TOP_LEVEL_FIELDS, Document
from epp.config.sections import data_layer, feature_gates, objectives, parser
from epp.config.yaml_reading import read_yaml
from epp.flowcontrol.config import FEATURE_GATE as FLOW_CONTROL_GATE
from epp.flowcontrol.config import parse_flow_control
from epp.framework.errors import ConfigError
from epp.framework.plugin import (
    Admitter,
    CapacityGate,
    PluginContext,
    PreRequestHook,
    ResponseCompleteHook,
    ResponseHeadersHook,
)
from epp.framework.registry import PluginRegistry, default_registry
from epp.framework.scheduler import Scheduler
from epp.requestcontrol.pipeline import LoadedConfig


class _Builder:
    """One load: validates the document and builds the pipeline, failing on the first error."""

    def __init__(self, source: str, registry: PluginRegistry, context: PluginContext) -> None:
        self.doc = Document(source)
        self.plugins = PluginSet(self.doc, registry, context)

    def build(self, doc: Any) -> LoadedConfig:
        """The pipeline of one parsed document (its sections in dependency order)."""
        if doc is None:
            raise self.doc.fail("", f"the document is empty; expected an {KIND}")
        doc = self.doc.mapping(doc, "", TOP_LEVEL_FIELDS, required=("apiVersion", "kind"))
        if doc["apiVersion"] != API_VERSION:
            raise self.doc.fail("apiVersion",
                                f"unsupported apiVersion {doc['apiVersion']!r}; allowed: {API_VERSION}")
        if doc["kind"] != KIND:
            raise self.doc.fail("kind", f"unsupported kind {doc['kind']!r}; allowed: {KIND}")
        gates = feature_gates(self.doc, doc)
        objective_priorities = objectives(self.doc, doc)
        self.plugins.add_configured(doc)
        data_sources = data_layer(self.doc, self.plugins, doc)
        request_parser = parser(self.doc, self.plugins, doc)
        profile_builder = ProfileBuilder(self.doc, self.plugins)
        profiles = profile_builder.build_profiles(doc)
        handler = profile_builder.profile_handler(profiles)
        detector = saturation_detector(self.doc, self.plugins, doc)
        producers = ProducerWiring(self.doc, self.plugins).producers(profiles)
        flow_control = None
        if "flowControl" in doc or FLOW_CONTROL_GATE in gates:
            flow_control = parse_flow_control(doc.get("flowControl"), source=self.doc.source,
                                              plugins={e.name: e.plugin for e in self.plugins.entries})
            if FLOW_CONTROL_GATE in gates and detector is None:
                raise self.doc.fail("saturationDetector", "flow control needs a saturation detector (e.g. "
                                                          f"{DEFAULT_SATURATION_DETECTOR_TYPE}); none is configured")
        elif detector is not None:
            # GIE's default admission; with flow control the controller queues instead of shedding.
            add_shedding_admitter(self.plugins, detector)
        plugins = [e.plugin for e in self.plugins.entries]
        controller = None
        if flow_control is not None and FLOW_CONTROL_GATE in gates and detector is not None \
                and self.plugins.context.endpoints is not None:
            controller = flow_controller(self.plugins, flow_control, detector)
        return LoadedConfig(
            source=self.doc.source,
            scheduler=Scheduler(handler, profiles),
            data_producers=producers,
            admitters=tuple(p for p in plugins if isinstance(p, Admitter)),
            pre_request_hooks=tuple(p for p in plugins if isinstance(p, PreRequestHook)),
            response_headers_hooks=tuple(p for p in plugins if isinstance(p, ResponseHeadersHook)),
            response_complete_hooks=tuple(p for p in plugins if isinstance(p, ResponseCompleteHook)),
            saturation_detector=detector,
            feature_gates=gates,
            objectives=objective_priorities,
            plugins=tuple(self.plugins.entries),
            data_sources=data_sources,
            parser=request_parser,
            flow_control_section=flow_control,
            capacity_gates=tuple(p for p in plugins if isinstance(p, CapacityGate)),
            flow_controller=controller,
        )


def load_config_text(text: str, *, source: str = "<config-text>", registry: PluginRegistry | None = None,
                     context: PluginContext | None = None) -> LoadedConfig:
    """Load an `EndpointPickerConfig` from YAML text; `source` names it in error messages."""
    doc = read_yaml(text, source)
    return _Builder(source, registry or default_registry(), context or PluginContext()).build(doc)


def load_config(path: str | os.PathLike[str], *, registry: PluginRegistry | None = None,
                context: PluginContext | None = None) -> LoadedConfig:
    """Load an `EndpointPickerConfig` YAML file (errors name the file and the field)."""
    source = os.fspath(path)
    try:
        with open(source, encoding="utf-8") as fh:
            text = fh.read()
    except OSError as exc:
        raise ConfigError(f"{source}: cannot read config file: {exc.strerror or exc}") from None
    return load_config_text(text, source=source, registry=registry, context=context)


def load_config_or_default(config_file: str | os.PathLike[str] | None = None, config_text: str | None = None, *,
                           registry: PluginRegistry | None = None,
                           context: PluginContext | None = None) -> LoadedConfig:
    """The pipeline of `config_file`, else of `config_text`, else GIE's system defaults."""
    if config_file:
        return load_config(config_file, registry=registry, context=context)
    if config_text:
        return load_config_text(config_text, source="--config-text", registry=registry, context=context)
    return load_default_config(registry=registry, context=context)


def load_default_config(*, registry: PluginRegistry | None = None,
                        context: PluginContext | None = None) -> LoadedConfig:
    """GIE's system defaults: queue 2, kv-cache-utilization 2, prefix-cache 3, max-score, single profile."""
    return load_config_text(DEFAULT_CONFIG_YAML, source="<default config>", registry=registry, context=context)
