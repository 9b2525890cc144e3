"""EndpointPickerConfig documents written from Python values, so code and tests do not spell out the YAML."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import yaml

from epp.config.defaults import DEFAULT_PROFILE_NAME
from epp.config.schema import API_VERSION, KIND

PluginDef = str | Mapping[str, Any]
ProfileRefs = Sequence[str] | Mapping[str, float | None]

# The scorers and weights of GIE's built-in default profile (`loadDefaultConfig`).
DEFAULT_SCORER_WEIGHTS: Mapping[str, float] = {"queue-scorer": 2, "kv-cache-utilization-scorer": 2,
                                               "prefix-cache-scorer": 3}


def plugin(type_name: str, name: str | None = None, **parameters: Any) -> dict[str, Any]:
    """One `plugins[]` entry: a type, an optional name (default: the type) and its parameters."""
    entry: dict[str, Any] = {"type": type_name}
    if name is not None:
        entry["name"] = name
    if parameters:
        entry["parameters"] = parameters
    return entry


def endpoint_picker_config(plugins: Sequence[PluginDef], profile: ProfileRefs | None = None,
                           **sections: Any) -> str:
    """EndpointPickerConfig YAML text.

    `plugins`: type names, or entries from `plugin(...)`. `profile`: the plugin names the one
    `default` scheduling profile references, in order; a mapping gives each scorer its weight
    (None: no weight, the loader's default). No profile: the loader's default profile, with every
    filter, scorer and picker. `sections`: further top-level fields (`objectives`,
    `saturationDetector`, `featureGates`, `dataLayer`, ...) as they appear in the document.
    """
    document: dict[str, Any] = {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "plugins": [{"type": p} if isinstance(p, str) else dict(p) for p in plugins],
    }
    if profile is not None:
        weights: Mapping[str, float | None] = (profile if isinstance(profile, Mapping)
                                               else dict.fromkeys(profile))
        refs = [{"pluginRef": ref} if weight is None else {"pluginRef": ref, "weight": weight}
                for ref, weight in weights.items()]
        document["schedulingProfiles"] = [{"name": DEFAULT_PROFILE_NAME, "plugins": refs}]
    document.update(sections)
    return yaml.safe_dump(document, sort_keys=False, default_flow_style=False, width=120)


# GIE's built-in default (`loadDefaultConfig`): used when no config is given.
DEFAULT_CONFIG_YAML = endpoint_picker_config(
    [*DEFAULT_SCORER_WEIGHTS, "metrics-data-source", "core-metrics-extractor"], DEFAULT_SCORER_WEIGHTS,
    dataLayer={"sources": [{"pluginRef": "metrics-data-source", "extractors": [{"pluginRef": "core-metrics-extractor"}]}]})

__all__ = ["DEFAULT_CONFIG_YAML", "DEFAULT_SCORER_WEIGHTS", "endpoint_picker_config", "plugin"]
