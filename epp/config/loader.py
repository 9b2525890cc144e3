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

import logging
import os
from typing import Any

from epp.config.compose import DEFAULT_CONFIG_YAML
from epp.config.defaults import DEFAULT_SATURATION_DETECTOR_TYPE
from epp.config.plugins import PluginSet
from epp.config.producers import ProducerWiring
from epp.config.profiles import ProfileBuilder
from epp.config.refs import bind_references
from epp.config.saturation import add_shedding_admitter, flow_controller, saturation_detector
from epp.config.schema import KIND, TOP_LEVEL_FIELDS, Document
from epp.config.sections import data_layer, feature_gates, objectives, parsers
from epp.config.versions import check_version, to_v1
from epp.config.yaml_reading import read_yaml
from epp.flowcontrol.config import FEATURE_GATE as FLOW_CONTROL_GATE
from epp.flowcontrol.config import FLOW_CONTROL_FIELDS, parse_flow_control
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

log = logging.getLogger(__name__)

# llm-d's flowControl fields this picker cannot act on (the flow controller's own fields are
# FLOW_CONTROL_FIELDS; `saturationDetector` is the loader's).
REFUSED_FLOW_CONTROL_FIELDS = {
    "noEndpointRequestTTL": "a request with no endpoint is answered at once (503), not queued",
    "defaultNegativePriorityBand": "negative priorities use defaultPriorityBand",
    "bandSelectionPolicyPluginRef": "bands are offered dispatch from the highest priority down (llm-d's default "
                                    "order); band selection policies are not implemented",
}


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
        doc = to_v1(self.doc, doc, check_version(self.doc, doc))
        gates = feature_gates(self.doc, doc)
        objective_priorities = objectives(self.doc, doc)
        self.plugins.add_configured(doc)
        data_sources, scrape, discovery = data_layer(self.doc, self.plugins, doc)
        request_parsers = parsers(self.doc, self.plugins, self._request_handler(doc))
        profile_builder = ProfileBuilder(self.doc, self.plugins)
        profiles = profile_builder.build_profiles(doc)
        handler = profile_builder.profile_handler(profiles)
        flow_section = self._flow_control_section(doc)
        detector = saturation_detector(self.doc, self.plugins, *self._detector_ref(doc))
        producers = ProducerWiring(self.doc, self.plugins).producers(profiles)
        bind_references(self.doc, self.plugins)
        flow_control = None
        if flow_section is not None or FLOW_CONTROL_GATE in gates:
            flow_control = parse_flow_control(flow_section, source=self.doc.source,
                                              plugins={e.name: e.plugin for e in self.plugins.entries})
            if FLOW_CONTROL_GATE in gates and detector is None:
                raise self.doc.fail("flowControl.saturationDetector", "flow control needs a saturation detector "
                                    f"(e.g. {DEFAULT_SATURATION_DETECTOR_TYPE}); none is configured")
        if flow_control is None or FLOW_CONTROL_GATE not in gates:
            if detector is not None:
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
            scrape=scrape,
            parsers=request_parsers,
            flow_control_section=flow_control,
            capacity_gates=tuple(p for p in plugins if isinstance(p, CapacityGate)),
            flow_controller=controller,
            notes=tuple(self.doc.notes),
            notices=tuple(self.doc.notices),
            discovery=discovery,
        )

    def _request_handler(self, doc: dict) -> dict:
        """The document with `requestHandler.propagatePriority` (llm-d.ai/v1) taken out: `true` is refused."""
        handler = doc.get("requestHandler")
        if not isinstance(handler, dict) or "propagatePriority" not in handler:
            return doc
        value = self.doc.boolean(handler["propagatePriority"], "requestHandler.propagatePriority", False)
        if value:
            raise self.doc.fail("requestHandler.propagatePriority", "not supported: the request body is forwarded "
                                "unchanged (the resolved priority is not written into its `priority` field); "
                                "give the priority to the model server in the request itself")
        self.doc.note("requestHandler.propagatePriority", "false: the body is forwarded unchanged, as here")
        return {**doc, "requestHandler": {k: v for k, v in handler.items() if k != "propagatePriority"}}

    def _flow_control_section(self, doc: dict) -> dict | None:
        """The `flowControl` section for the flow controller: llm-d's fields it cannot act on refused."""
        raw = doc.get("flowControl")
        if raw is None or not isinstance(raw, dict):
            return raw
        for key, reason in REFUSED_FLOW_CONTROL_FIELDS.items():
            if key in raw and key not in FLOW_CONTROL_FIELDS:
                raise self.doc.fail(f"flowControl.{key}", f"not supported: {reason}")
        return {k: v for k, v in raw.items() if k != "saturationDetector"}

    def _detector_ref(self, doc: dict) -> tuple[Any, str]:
        """`flowControl.saturationDetector`, or the deprecated top-level one (copied as llm-d does)."""
        nested = doc["flowControl"].get("saturationDetector") if isinstance(doc.get("flowControl"), dict) else None
        legacy = doc.get("saturationDetector")
        if legacy is not None:
            if nested is not None:
                self.doc.note("saturationDetector", "deprecated; ignored because flowControl.saturationDetector "
                              "is set (as in llm-d)")
                return nested, "flowControl.saturationDetector"
            self.doc.note("saturationDetector", "deprecated; copied into flowControl.saturationDetector (as in "
                          "llm-d)")
            return legacy, "saturationDetector"
        return nested, "flowControl.saturationDetector"


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
