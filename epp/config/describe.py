"""`describe()`: the resolved pipeline as readable text (what `epp check-config` prints)."""

from __future__ import annotations

from collections.abc import Iterable

from epp.config.yaml_reading import yaml_value
from epp.flowcontrol.config import FEATURE_GATE as FLOW_CONTROL_GATE
from epp.framework.plugin import FirstTokenHook, Plugin
from epp.requestcontrol.pipeline import LoadedConfig, PluginEntry, plugin_kinds


def _plugin_line(entry: PluginEntry) -> str:
    text = entry.plugin.describe()
    if not text and entry.parameters:
        text = ", ".join(f"{k}={yaml_value(v)}" for k, v in entry.parameters.items())
    line = f"{entry.name} (type {entry.type_name}; {', '.join(plugin_kinds(entry.plugin)) or 'config'})"
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
    mapped = [e for e in loaded.plugins if e.mapping]
    if mapped:
        lines += ["", "llm-d plugin types (how each was mapped):"]
        lines += [f"  - {e.name}: {e.mapping}" for e in mapped]
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
    lines.append(f"  first-token hooks: {_names(loaded.plugins_of(FirstTokenHook))}")
    lines.append(f"  response-headers hooks: {_names(loaded.response_headers_hooks)}")
    lines.append(f"  response-complete hooks: {_names(loaded.response_complete_hooks)}")
    lines.append(f"  parsers (asked in order; a path goes to the first that claims it): {_names(loaded.parsers)}")
    for ds in loaded.data_sources:
        lines.append(f"  data source: {ds.source.name} (extractors: {_names(ds.extractors)})")
    lines.append(f"  metrics scrape: {loaded.scrape.describe() if loaded.scrape else 'off'}")
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
    lines.append(f"  objectives (x-llm-d-inference-objective -> priority): {objectives or 'none'}")
    if loaded.notes:
        lines += ["", "Notes:"]
        lines += [f"  - {note}" for note in loaded.notes]
    return "\n".join(lines) + "\n"
