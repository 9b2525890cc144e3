"""Strict loader of the GIE `EndpointPickerConfig` YAML into a scheduler, producers and hooks.

Every error names the source (file), the field path inside the document
(`schedulingProfiles[0].plugins[1].weight`) and what is allowed there.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import yaml

from epp.flowcontrol.config import FEATURE_GATE as FLOW_CONTROL_GATE
from epp.flowcontrol.config import FlowControlConfig, parse_flow_control
from epp.framework.errors import ConfigError
from epp.framework.plugin import (
    Admitter,
    CapacityGate,
    DataProducer,
    Filter,
    Picker,
    Plugin,
    PluginContext,
    PreRequestHook,
    ProfileHandler,
    ResponseCompleteHook,
    ResponseHeadersHook,
    Scorer,
)
from epp.framework.registry import PluginRegistry, default_registry, did_you_mean
from epp.framework.scheduler import Scheduler, SchedulerProfile, WeightedScorer

API_VERSION = "inference.networking.x-k8s.io/v1alpha1"
KIND = "EndpointPickerConfig"
KNOWN_FEATURE_GATES = ("flowControl", "enableLegacyMetrics", "dataLayer")
TOP_LEVEL_FIELDS = ("apiVersion", "kind", "plugins", "schedulingProfiles", "saturationDetector", "featureGates",
                    "dataLayer", "parser", "objectives", "flowControl")
PLUGIN_FIELDS = ("name", "type", "parameters")
PROFILE_FIELDS = ("name", "plugins")
PROFILE_PLUGIN_FIELDS = ("pluginRef", "weight")
OBJECTIVE_FIELDS = ("name", "priority")
DEFAULT_SCORER_WEIGHT = 1.0
DEFAULT_PROFILE_NAME = "default"
DEFAULT_PICKER_TYPE = "max-score-picker"
DEFAULT_PROFILE_HANDLER_TYPE = "single-profile-handler"
DEFAULT_SATURATION_DETECTOR_TYPE = "utilization-detector"
DEFAULT_PARSER_TYPE = "openai-parser"
DATA_SOURCE_TYPES = ("metrics-data-source",)
EXTRACTOR_TYPES = ("core-metrics-extractor",)
PARSER_TYPES = ("openai-parser",)


@dataclass(frozen=True)
class PluginEntry:
    """One plugin instance of the pipeline and where it came from."""

    name: str
    type_name: str
    plugin: Plugin
    parameters: Mapping[str, Any]
    auto_created: str | None = None  # why the loader added it, or None when configured


@dataclass(frozen=True)
class DataSourceConfig:
    """A `dataLayer.sources[]` entry: a source plugin and its extractor plugins."""

    source: Plugin
    extractors: tuple[Plugin, ...]


@dataclass(frozen=True)
class LoadedConfig:
    """The resolved pipeline: scheduler, producers in dependency order, hooks, and every plugin instance."""

    source: str
    scheduler: Scheduler
    data_producers: tuple[DataProducer, ...]
    admitters: tuple[Admitter, ...]
    pre_request_hooks: tuple[PreRequestHook, ...]
    response_headers_hooks: tuple[ResponseHeadersHook, ...]
    response_complete_hooks: tuple[ResponseCompleteHook, ...]
    saturation_detector: Plugin | None
    feature_gates: frozenset[str]
    objectives: Mapping[str, int]
    plugins: tuple[PluginEntry, ...]
    data_sources: tuple[DataSourceConfig, ...] = ()
    parser: Plugin | None = None
    # The `flowControl` section, validated even when the feature gate is off; used only with the gate.
    flow_control_section: FlowControlConfig | None = None

    @property
    def flow_control(self) -> FlowControlConfig | None:
        """The flow-control config when the `flowControl` feature gate is on (GIE: off by default)."""
        if FLOW_CONTROL_GATE not in self.feature_gates:
            return None
        return self.flow_control_section or FlowControlConfig()

    @property
    def saturation_detector_ref(self) -> str | None:
        """Name of the saturation detector plugin, if any."""
        return self.saturation_detector.name if self.saturation_detector is not None else None

    @property
    def plugin_instances(self) -> tuple[Plugin, ...]:
        return tuple(entry.plugin for entry in self.plugins)

    def plugin(self, name: str) -> Plugin:
        """The plugin instance named `name`."""
        for entry in self.plugins:
            if entry.name == name:
                return entry.plugin
        raise KeyError(name)

    async def start(self) -> None:
        """Start every plugin's background work, in pipeline order."""
        for entry in self.plugins:
            await entry.plugin.start()

    async def stop(self) -> None:
        """Stop every plugin, in reverse order."""
        for entry in reversed(self.plugins):
            await entry.plugin.stop()


class _StrictYamlLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate mapping keys (strict decoding, as GIE does)."""


def _construct_mapping(loader: _StrictYamlLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    loader.flatten_mapping(node)
    mapping: dict[Any, Any] = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in mapping:
            raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
        mapping[key] = loader.construct_object(value_node, deep=deep)
    return mapping


_StrictYamlLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _kinds(plugin: Plugin) -> list[str]:
    kinds = [("filter", Filter), ("scorer", Scorer), ("picker", Picker), ("profile-handler", ProfileHandler),
             ("data-producer", DataProducer), ("admitter", Admitter), ("pre-request", PreRequestHook),
             ("response-headers", ResponseHeadersHook), ("response-complete", ResponseCompleteHook),
             ("capacity-gate", CapacityGate)]
    return [label for label, cls in kinds if isinstance(plugin, cls)]


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class _Builder:
    """One load: validates the document and builds the pipeline, failing on the first error."""

    def __init__(self, source: str, registry: PluginRegistry, context: PluginContext) -> None:
        self.source = source
        self.registry = registry
        self.context = context
        self.entries: list[PluginEntry] = []
        self.by_name: dict[str, PluginEntry] = {}

    def fail(self, path: str, message: str) -> ConfigError:
        where = f"{self.source}: {path}: " if path else f"{self.source}: "
        return ConfigError(where + message)

    # -- shape checks ---------------------------------------------------------------------------

    def mapping(self, value: Any, path: str, allowed: Sequence[str], required: Sequence[str] = ()) -> dict:
        if not isinstance(value, dict):
            raise self.fail(path, f"must be a mapping with fields {list(allowed)}, got {type(value).__name__}")
        for key in value:
            if key not in allowed:
                hint = did_you_mean(str(key), allowed)
                raise self.fail(f"{path}.{key}" if path else str(key),
                                f"unknown field{hint}; allowed fields: {', '.join(allowed)}")
        for key in required:
            if value.get(key) in (None, ""):
                raise self.fail(f"{path}.{key}" if path else key, "is required")
        return value

    def sequence(self, value: Any, path: str, what: str) -> list:
        if value is None:
            return []
        if not isinstance(value, list):
            raise self.fail(path, f"must be a list of {what}, got {type(value).__name__}")
        return value

    def string(self, value: Any, path: str) -> str:
        if not isinstance(value, str) or not value:
            raise self.fail(path, f"must be a non-empty string, got {value!r}")
        return value

    def ref(self, value: Any, path: str) -> PluginEntry:
        name = self.string(value, path)
        entry = self.by_name.get(name)
        if entry is None:
            raise self.fail(path, f"unknown plugin {name!r}{did_you_mean(name, self.by_name)}; "
                                  f"defined plugins: {', '.join(self.by_name) or 'none'}")
        return entry

    # -- plugins --------------------------------------------------------------------------------

    def add_plugin(self, type_name: str, name: str, parameters: Mapping[str, Any] | None, path: str,
                   auto_created: str | None = None) -> PluginEntry:
        try:
            self.registry.get(type_name)
        except ConfigError as exc:
            raise self.fail(f"{path}.type" if not auto_created else path, str(exc)) from None
        try:
            plugin = self.registry.build(type_name, name, parameters, self.context)
        except ConfigError as exc:
            raise self.fail(f"{path}.parameters" if not auto_created else path, str(exc)) from None
        entry = PluginEntry(name, type_name, plugin, dict(parameters or {}), auto_created)
        self.entries.append(entry)
        self.by_name[name] = entry
        return entry

    def free_name(self, base: str) -> str:
        name, n = base, 1
        while name in self.by_name:
            n += 1
            name = f"{base}-{n}"
        return name

    def build_plugins(self, doc: Mapping[str, Any]) -> None:
        for i, raw in enumerate(self.sequence(doc.get("plugins"), "plugins", "plugin definitions")):
            path = f"plugins[{i}]"
            item = self.mapping(raw, path, PLUGIN_FIELDS, required=("type",))
            type_name = self.string(item["type"], f"{path}.type")
            name = self.string(item["name"], f"{path}.name") if item.get("name") is not None else type_name
            if name in self.by_name:
                raise self.fail(f"{path}.name", f"duplicate plugin name {name!r}; plugin names must be unique "
                                                "(name defaults to type)")
            params = item.get("parameters")
            if params is not None and not isinstance(params, dict):
                raise self.fail(f"{path}.parameters", f"must be a mapping, got {type(params).__name__}")
            self.add_plugin(type_name, name, params, path)

    # -- profiles -------------------------------------------------------------------------------

    def default_picker(self) -> Picker:
        for entry in self.entries:
            if entry.auto_created and entry.type_name == DEFAULT_PICKER_TYPE and isinstance(entry.plugin, Picker):
                return entry.plugin
        entry = self.add_plugin(DEFAULT_PICKER_TYPE, self.free_name(DEFAULT_PICKER_TYPE), None,
                                "schedulingProfiles", auto_created="profile without a picker")
        if not isinstance(entry.plugin, Picker):
            raise self.fail("schedulingProfiles", f"the default picker type {DEFAULT_PICKER_TYPE} is no picker")
        return entry.plugin

    def build_profile(self, name: str, refs: list[tuple[PluginEntry, Any, str]], path: str) -> SchedulerProfile:
        filters: list[Filter] = []
        scorers: list[WeightedScorer] = []
        pickers: list[tuple[Picker, str]] = []
        seen: set[str] = set()
        for entry, weight, ref_path in refs:
            plugin = entry.plugin
            if entry.name in seen:
                raise self.fail(f"{ref_path}.pluginRef", f"plugin {entry.name!r} is listed twice in this profile")
            seen.add(entry.name)
            if not isinstance(plugin, (Filter, Scorer, Picker)):
                raise self.fail(f"{ref_path}.pluginRef",
                                f"plugin {entry.name!r} (type {entry.type_name}, kinds: {', '.join(_kinds(plugin))})"
                                " cannot be used in a profile; allowed: a filter, a scorer or a picker")
            if weight is not None and not isinstance(plugin, Scorer):
                raise self.fail(f"{ref_path}.weight",
                                f"only scorers take a weight; {entry.name!r} (type {entry.type_name}) is a "
                                f"{'/'.join(_kinds(plugin))}")
            if weight is not None and (not _is_number(weight) or not math.isfinite(weight) or weight < 0):
                raise self.fail(f"{ref_path}.weight", f"must be a non-negative number, got {weight!r}")
            if isinstance(plugin, Filter):
                filters.append(plugin)
            if isinstance(plugin, Scorer):
                scorers.append(WeightedScorer(plugin, float(weight) if weight is not None else DEFAULT_SCORER_WEIGHT))
            if isinstance(plugin, Picker):
                pickers.append((plugin, ref_path))
        if len(pickers) > 1:
            raise self.fail(f"{pickers[1][1]}.pluginRef",
                            f"profile {name!r} has several pickers ({', '.join(p.name for p, _ in pickers)}); "
                            "allowed: exactly one picker per profile")
        picker = pickers[0][0] if pickers else self.default_picker()
        return SchedulerProfile(name, tuple(filters), tuple(scorers), picker)

    def build_profiles(self, doc: Mapping[str, Any]) -> dict[str, SchedulerProfile]:
        raw_profiles = self.sequence(doc.get("schedulingProfiles"), "schedulingProfiles", "profiles")
        profiles: dict[str, SchedulerProfile] = {}
        if not raw_profiles:
            # GIE default: one profile with every configured filter, scorer and picker.
            refs = [(e, None, f"plugins[{i}]") for i, e in enumerate(self.entries)
                    if isinstance(e.plugin, (Filter, Scorer, Picker))]
            profiles[DEFAULT_PROFILE_NAME] = self.build_profile(DEFAULT_PROFILE_NAME, refs, "schedulingProfiles")
            return profiles
        for i, raw in enumerate(raw_profiles):
            path = f"schedulingProfiles[{i}]"
            item = self.mapping(raw, path, PROFILE_FIELDS, required=("name",))
            name = self.string(item["name"], f"{path}.name")
            if name in profiles:
                raise self.fail(f"{path}.name", f"duplicate profile name {name!r}; profile names must be unique")
            refs = []
            for j, raw_ref in enumerate(self.sequence(item.get("plugins"), f"{path}.plugins", "plugin references")):
                ref_path = f"{path}.plugins[{j}]"
                ref_item = self.mapping(raw_ref, ref_path, PROFILE_PLUGIN_FIELDS, required=("pluginRef",))
                if "weight" in ref_item and ref_item["weight"] is None:
                    raise self.fail(f"{ref_path}.weight", f"is empty; give a non-negative number, or leave the "
                                                          f"field out for the default {DEFAULT_SCORER_WEIGHT:g}")
                refs.append((self.ref(ref_item["pluginRef"], f"{ref_path}.pluginRef"), ref_item.get("weight"),
                             ref_path))
            profiles[name] = self.build_profile(name, refs, path)
        return profiles

    def profile_handler(self, profiles: Mapping[str, SchedulerProfile]) -> ProfileHandler:
        handlers = [e for e in self.entries if isinstance(e.plugin, ProfileHandler)]
        if len(handlers) > 1:
            raise self.fail("plugins", f"several profile handlers ({', '.join(e.name for e in handlers)}); "
                                       "allowed: at most one")
        if handlers:
            entry = handlers[0]
        elif len(profiles) == 1:
            entry = self.add_plugin(DEFAULT_PROFILE_HANDLER_TYPE, self.free_name(DEFAULT_PROFILE_HANDLER_TYPE), None,
                                    "plugins", auto_created="one profile and no profile handler")
        else:
            raise self.fail("plugins", f"{len(profiles)} scheduling profiles need a profile handler plugin; "
                                       f"registered types: {', '.join(self.registry.types())}")
        check = getattr(entry.plugin, "check_profiles", None)
        if check is not None:
            try:
                check(list(profiles))
            except ConfigError as exc:
                raise self.fail("schedulingProfiles", f"profile handler {entry.name!r}: {exc}") from None
        if not isinstance(entry.plugin, ProfileHandler):
            raise self.fail("plugins", f"the default profile handler type {entry.type_name} is no profile handler")
        return entry.plugin

    # -- data producers -------------------------------------------------------------------------

    def consumers(self, profiles: Mapping[str, SchedulerProfile]) -> list[Plugin]:
        used: dict[int, Plugin] = {}
        for profile in profiles.values():
            for plugin in (*profile.filters, *(ws.scorer for ws in profile.scorers), profile.picker):
                used[id(plugin)] = plugin
        for entry in self.entries:
            if not isinstance(entry.plugin, (Filter, Scorer, Picker)):
                used[id(entry.plugin)] = entry.plugin
        return list(used.values())

    def producers(self, profiles: Mapping[str, SchedulerProfile]) -> tuple[DataProducer, ...]:
        producer_of: dict[str, PluginEntry] = {}

        def index(entry: PluginEntry) -> None:
            if not isinstance(entry.plugin, DataProducer):
                return
            for key in sorted(entry.plugin.produces()):
                if key in producer_of:
                    raise self.fail("plugins", f"data key {key!r} is produced by both {producer_of[key].name!r} "
                                               f"and {entry.name!r}; allowed: one producer per key")
                producer_of[key] = entry

        for entry in list(self.entries):
            index(entry)
        pending = self.consumers(profiles)
        done: set[int] = set()
        while pending:
            consumer = pending.pop(0)
            if id(consumer) in done:
                continue
            done.add(id(consumer))
            consumes = getattr(consumer, "consumes", None)
            for key in sorted(consumes() if consumes else ()):
                legacy = dict(getattr(consumer, "default_producer_parameters", None) or {})
                if key in producer_of:
                    if legacy and producer_of[key].auto_created is None:
                        raise self.fail(f"plugins[{self.position(consumer)}].parameters",
                                        f"parameters {sorted(legacy)} of {consumer.name!r} belong to the producer; "
                                        f"set them on plugin {producer_of[key].name!r} instead")
                    continue
                spec = self.registry.default_producer(key)
                if spec is None:
                    raise self.fail("plugins", f"plugin {consumer.name!r} consumes data key {key!r} but no plugin "
                                               "produces it and no default producer is registered; add a plugin "
                                               "that produces it")
                entry = self.add_plugin(spec.type_name, self.free_name(spec.type_name), legacy,
                                        f"plugins[{self.position(consumer)}]",
                                        auto_created=f"default producer of {key!r} for {consumer.name!r}")
                index(entry)
                pending.append(entry.plugin)
        return self.topological([e for e in self.entries if isinstance(e.plugin, DataProducer)], producer_of)

    def position(self, plugin: Plugin) -> int:
        for i, entry in enumerate(self.entries):
            if entry.plugin is plugin:
                return i
        return -1

    def topological(self, producers: list[PluginEntry],
                    producer_of: Mapping[str, PluginEntry]) -> tuple[DataProducer, ...]:
        """Producers ordered so each runs after the producers of what it consumes (config order otherwise)."""
        deps = {e.name: {producer_of[k].name for k in e.plugin.consumes() if k in producer_of} - {e.name}
                for e in producers}
        ordered: list[DataProducer] = []
        placed: set[str] = set()
        remaining = list(producers)
        while remaining:
            ready = [e for e in remaining if deps[e.name] <= placed]
            if not ready:
                raise self.fail("plugins", "data producers depend on each other in a cycle: "
                                           + ", ".join(e.name for e in remaining))
            for entry in ready:
                if isinstance(entry.plugin, DataProducer):
                    ordered.append(entry.plugin)
                placed.add(entry.name)
            remaining = [e for e in remaining if e.name not in placed]
        return tuple(ordered)

    # -- the rest -------------------------------------------------------------------------------

    def feature_gates(self, doc: Mapping[str, Any]) -> frozenset[str]:
        gates = []
        for i, gate in enumerate(self.sequence(doc.get("featureGates"), "featureGates", "feature gate names")):
            if gate not in KNOWN_FEATURE_GATES:
                raise self.fail(f"featureGates[{i}]", f"unknown feature gate {gate!r}; allowed: "
                                                      f"{', '.join(KNOWN_FEATURE_GATES)}")
            gates.append(gate)
        return frozenset(gates)

    def objectives(self, doc: Mapping[str, Any]) -> dict[str, int]:
        out: dict[str, int] = {}
        for i, raw in enumerate(self.sequence(doc.get("objectives"), "objectives", "{name, priority} entries")):
            path = f"objectives[{i}]"
            item = self.mapping(raw, path, OBJECTIVE_FIELDS, required=("name",))
            name = self.string(item["name"], f"{path}.name")
            if name in out:
                raise self.fail(f"{path}.name", f"duplicate objective {name!r}; objective names must be unique")
            priority = item.get("priority", 0)
            if not isinstance(priority, int) or isinstance(priority, bool):
                raise self.fail(f"{path}.priority", f"must be an integer (negative = sheddable), got {priority!r}")
            out[name] = priority
        return out

    def typed_ref(self, raw: Any, path: str, allowed_types: Sequence[str]) -> Plugin:
        entry = self.ref(raw, path)
        if entry.type_name not in allowed_types:
            raise self.fail(path, f"plugin {entry.name!r} has type {entry.type_name}; allowed types: "
                                  f"{', '.join(allowed_types)}")
        return entry.plugin

    def saturation_detector(self, doc: Mapping[str, Any]) -> Plugin | None:
        raw = doc.get("saturationDetector")
        if raw is not None:
            item = self.mapping(raw, "saturationDetector", ("pluginRef",), required=("pluginRef",))
            return self.ref(item["pluginRef"], "saturationDetector.pluginRef").plugin
        for entry in self.entries:
            if entry.type_name == DEFAULT_SATURATION_DETECTOR_TYPE:
                return entry.plugin
        try:
            self.registry.get(DEFAULT_SATURATION_DETECTOR_TYPE)
        except ConfigError:
            return None
        return self.add_plugin(DEFAULT_SATURATION_DETECTOR_TYPE, self.free_name(DEFAULT_SATURATION_DETECTOR_TYPE),
                               None, "saturationDetector", auto_created="default saturation detector").plugin

    def parser(self, doc: Mapping[str, Any]) -> Plugin | None:
        raw = doc.get("parser")
        if raw is None:
            return None
        item = self.mapping(raw, "parser", ("pluginRef",), required=("pluginRef",))
        return self.typed_ref(item["pluginRef"], "parser.pluginRef", PARSER_TYPES)

    def data_layer(self, doc: Mapping[str, Any]) -> tuple[DataSourceConfig, ...]:
        raw = doc.get("dataLayer")
        if raw is None:
            return ()
        item = self.mapping(raw, "dataLayer", ("sources",))
        sources = []
        for i, raw_source in enumerate(self.sequence(item.get("sources"), "dataLayer.sources", "data sources")):
            path = f"dataLayer.sources[{i}]"
            source_item = self.mapping(raw_source, path, ("pluginRef", "extractors"), required=("pluginRef",))
            source = self.typed_ref(source_item["pluginRef"], f"{path}.pluginRef", DATA_SOURCE_TYPES)
            extractors = []
            for j, raw_ex in enumerate(self.sequence(source_item.get("extractors"), f"{path}.extractors",
                                                     "extractors")):
                ex_path = f"{path}.extractors[{j}]"
                ex_item = self.mapping(raw_ex, ex_path, ("pluginRef",), required=("pluginRef",))
                extractors.append(self.typed_ref(ex_item["pluginRef"], f"{ex_path}.pluginRef", EXTRACTOR_TYPES))
            sources.append(DataSourceConfig(source, tuple(extractors)))
        return tuple(sources)

    def build(self, doc: Any) -> LoadedConfig:
        if doc is None:
            raise self.fail("", f"the document is empty; expected an {KIND}")
        doc = self.mapping(doc, "", TOP_LEVEL_FIELDS, required=("apiVersion", "kind"))
        if doc["apiVersion"] != API_VERSION:
            raise self.fail("apiVersion", f"unsupported apiVersion {doc['apiVersion']!r}; allowed: {API_VERSION}")
        if doc["kind"] != KIND:
            raise self.fail("kind", f"unsupported kind {doc['kind']!r}; allowed: {KIND}")
        gates = self.feature_gates(doc)
        objectives = self.objectives(doc)
        self.build_plugins(doc)
        data_sources = self.data_layer(doc)
        parser = self.parser(doc)
        profiles = self.build_profiles(doc)
        handler = self.profile_handler(profiles)
        detector = self.saturation_detector(doc)
        producers = self.producers(profiles)
        flow_control = None
        if "flowControl" in doc or FLOW_CONTROL_GATE in gates:
            flow_control = parse_flow_control(doc.get("flowControl"), source=self.source,
                                              plugins={e.name: e.plugin for e in self.entries})
            if FLOW_CONTROL_GATE in gates and not callable(getattr(detector, "saturation", None)):
                raise self.fail("saturationDetector", "flow control needs a saturation detector (a plugin with "
                                                      f"a saturation rating, e.g. {DEFAULT_SATURATION_DETECTOR_TYPE})"
                                                      f"; got {detector!r}")
        plugins = [e.plugin for e in self.entries]
        return LoadedConfig(
            source=self.source,
            scheduler=Scheduler(handler, profiles),
            data_producers=producers,
            admitters=tuple(p for p in plugins if isinstance(p, Admitter)),
            pre_request_hooks=tuple(p for p in plugins if isinstance(p, PreRequestHook)),
            response_headers_hooks=tuple(p for p in plugins if isinstance(p, ResponseHeadersHook)),
            response_complete_hooks=tuple(p for p in plugins if isinstance(p, ResponseCompleteHook)),
            saturation_detector=detector,
            feature_gates=gates,
            objectives=objectives,
            plugins=tuple(self.entries),
            data_sources=data_sources,
            parser=parser,
            flow_control_section=flow_control,
        )


def load_config_text(text: str, *, source: str = "<config-text>", registry: PluginRegistry | None = None,
                     context: PluginContext | None = None) -> LoadedConfig:
    """Load an `EndpointPickerConfig` from YAML text; `source` names it in error messages."""
    loader = _StrictYamlLoader(text)
    loader.name = source  # YAML errors name the file, not "<unicode string>"
    try:
        doc = loader.get_single_data()
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: invalid YAML: {_yaml_error(exc)}") from None
    finally:
        loader.dispose()
    builder = _Builder(source, registry or default_registry(), context or PluginContext())
    return builder.build(doc)


def _yaml_error(exc: yaml.YAMLError) -> str:
    """A YAML error on one line: where (line, column), what, and the construct it was inside."""
    if not isinstance(exc, yaml.MarkedYAMLError) or exc.problem_mark is None:
        return " ".join(str(exc).split())
    mark = exc.problem_mark
    text = f"line {mark.line + 1}, column {mark.column + 1}: {exc.problem}"
    if exc.context:
        inside = exc.context
        if exc.context_mark is not None:
            inside += f" at line {exc.context_mark.line + 1}, column {exc.context_mark.column + 1}"
        text += f" ({inside})"
    return text


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


def load_default_config(*, registry: PluginRegistry | None = None,
                        context: PluginContext | None = None) -> LoadedConfig:
    """GIE's system defaults: queue 2, kv-cache-utilization 2, prefix-cache 3, max-score, single profile."""
    from epp.config.compose import DEFAULT_CONFIG_YAML  # compose writes documents with this module's names

    return load_config_text(DEFAULT_CONFIG_YAML, source="<default config>", registry=registry, context=context)


def _yaml_value(value: Any) -> str:
    """A parameter value as it would be written in the YAML file (`true`, not Python's `True`)."""
    dumped = yaml.safe_dump(value, default_flow_style=True, width=math.inf, allow_unicode=True).strip()
    return dumped.removesuffix("\n...").strip()


def _plugin_line(entry: PluginEntry) -> str:
    details = getattr(entry.plugin, "describe", None)
    text = details() if callable(details) else ""
    if not text and entry.parameters:
        text = ", ".join(f"{k}={_yaml_value(v)}" for k, v in entry.parameters.items())
    line = f"{entry.name} (type {entry.type_name}; {', '.join(_kinds(entry.plugin)) or 'config'})"
    if text:
        line += f" [{text}]"
    if entry.auto_created:
        line += f" -- auto-created: {entry.auto_created}"
    return line


def _names(plugins: Iterable[Plugin]) -> str:
    return ", ".join(p.name for p in plugins) or "none"


def describe(loaded: LoadedConfig) -> str:
    """The resolved pipeline as readable text (what `epp check-config` prints)."""
    entries = {id(e.plugin): e for e in loaded.plugins}
    lines = [f"EndpointPickerConfig {loaded.source}: OK", "", "Plugins:"]
    lines += [f"  - {_plugin_line(e)}" for e in loaded.plugins]
    lines += ["", "Request pipeline:"]
    lines.append(f"  saturation detector: {loaded.saturation_detector_ref or 'none'}")
    lines.append(f"  admitters: {_names(loaded.admitters)}")
    producers = []
    for p in loaded.data_producers:
        produced = ", ".join(sorted(p.produces())) or "-"
        producers.append(f"{p.name} -> {produced}")
    lines.append(f"  data producers (in order): {'; '.join(producers) or 'none'}")
    handler = loaded.scheduler.handler
    lines.append(f"  profile handler: {handler.name} (type {entries[id(handler)].type_name})")
    for name, profile in loaded.scheduler.profiles.items():
        lines.append(f"  profile {name!r}:")
        lines.append(f"    filters: {_names(profile.filters) if profile.filters else 'none'}")
        if profile.scorers:
            lines.append("    scorers (total = sum of weight x score):")
            for ws in profile.scorers:
                lines.append(f"      - {ws.scorer.name} weight {ws.weight:g}")
        else:
            lines.append("    scorers: none")
        lines.append(f"    picker: {profile.picker.name}")
    lines.append(f"  pre-request hooks: {_names(loaded.pre_request_hooks)}")
    lines.append(f"  response-headers hooks: {_names(loaded.response_headers_hooks)}")
    lines.append(f"  response-complete hooks: {_names(loaded.response_complete_hooks)}")
    lines.append(f"  parser: {loaded.parser.name if loaded.parser else DEFAULT_PARSER_TYPE + ' (default)'}")
    for ds in loaded.data_sources:
        lines.append(f"  data source: {ds.source.name} (extractors: {_names(ds.extractors)})")
    lines.append(f"  feature gates: {', '.join(sorted(loaded.feature_gates)) or 'none'}")
    if loaded.flow_control is not None:
        lines.append("  flow control: on (requests queue in the picker while the pool is saturated)")
        lines += [f"    {line}" for line in loaded.flow_control.describe()]
    elif loaded.flow_control_section is not None:
        lines.append(f"  flow control: off (the flowControl section is valid but feature gate "
                     f"{FLOW_CONTROL_GATE!r} is not set)")
    else:
        lines.append("  flow control: off")
    objectives = ", ".join(f"{k}={v}" for k, v in loaded.objectives.items())
    lines.append(f"  objectives (x-gateway-inference-objective -> priority): {objectives or 'none'}")
    return "\n".join(lines) + "\n"
