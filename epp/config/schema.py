"""The shape of an `EndpointPickerConfig` document, and the checks that name the failing field.

Every error names the source (file), the field path inside the document
(`schedulingProfiles[0].plugins[1].weight`) and what is allowed there.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from epp.framework.errors import ConfigError
from epp.framework.registry import did_you_mean

log = logging.getLogger("epp.config.loader")

# llm-d 1.0's layout (current). The two v1alpha1 groups still load, converted to it with a deprecation
# warning each, as llm-d does: llm-d's own v1alpha1 and GIE's group from before the move to llm-d.
API_VERSION = "llm-d.ai/v1"
V1ALPHA1_API_VERSION = "llm-d.ai/v1alpha1"
DEPRECATED_API_VERSION = "inference.networking.x-k8s.io/v1alpha1"
API_VERSIONS = (API_VERSION, V1ALPHA1_API_VERSION, DEPRECATED_API_VERSION)
KIND = "EndpointPickerConfig"
# Gates that act: flowControl (the flow controller). The others are accepted because what they
# switch on is always on here; `epp check-config` says so.
KNOWN_FEATURE_GATES = ("flowControl", "haPopulateNonLeaderDatastore", "enableLegacyMetrics", "dataLayer",
                       "prepareDataPlugins")
# `saturationDetector`, `parser` (llm-d v1alpha1) and `data` (GIE v1.3-v1.4) are deprecated forms: they
# load with a warning naming their place in llm-d.ai/v1. `objectives` is ours.
TOP_LEVEL_FIELDS = ("apiVersion", "kind", "plugins", "schedulingProfiles", "featureGates", "dataLayer",
                    "flowControl", "requestHandler", "saturationDetector", "parser", "data", "objectives")
PLUGIN_FIELDS = ("name", "type", "parameters")
PROFILE_FIELDS = ("name", "plugins")
PROFILE_PLUGIN_FIELDS = ("pluginRef", "weight")
OBJECTIVE_FIELDS = ("name", "priority")
METRICS_SOURCE_TYPE = "metrics-data-source"
NOTIFICATION_SOURCE_TYPE = "endpoint-notification-source"
DCGM_SOURCE_TYPE = "dcgm-data-source"
DATA_SOURCE_TYPES = (METRICS_SOURCE_TYPE, NOTIFICATION_SOURCE_TYPE, DCGM_SOURCE_TYPE)
# The extractors each source type takes: the metrics parser, or plugins that follow the pool's endpoints.
EXTRACTOR_TYPES = {
    METRICS_SOURCE_TYPE: ("core-metrics-extractor",),
    NOTIFICATION_SOURCE_TYPE: ("precise-prefix-cache-producer", "inflight-load-producer", "mm-embeddings-cache-producer"),
    DCGM_SOURCE_TYPE: ("dcgm-extractor",),
}


def is_number(value: Any) -> bool:
    """An int or float, not a bool (YAML `true` is no weight)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class Document:
    """Shape checks over one config document; each failure is a `ConfigError` naming source and path."""

    def __init__(self, source: str) -> None:
        self.source = source
        # What `epp check-config` must say beyond the pipeline: deprecations, fields accepted with no
        # effect here (and why), differences from llm-d's meaning.
        self.notes: list[str] = []
        # The notes that say something is served differently from llm-d (a plugin mapped to our nearest
        # equivalent, a field that does not act as there): a config with any "maps with notices".
        self.notices: list[str] = []

    def note(self, path: str, message: str) -> None:
        """Record a note about the field at `path` (printed by `epp check-config`)."""
        self.notes.append(f"{path}: {message}" if path else message)

    def notice(self, path: str, message: str) -> None:
        """Record that the field at `path` is served differently from llm-d (a note, counted as a notice)."""
        self.note(path, message)
        self.notices.append(self.notes[-1])

    def deprecate(self, path: str, message: str) -> None:
        """A deprecated form that still loads: one warning in the log (as llm-d logs it) and a note."""
        line = f"DEPRECATION: {message}"
        log.warning("%s: %s", self.source, f"{path}: {line}" if path else line)
        self.note(path, line)

    def fail(self, path: str, message: str) -> ConfigError:
        """The error for `path` (a field path; empty: the document)."""
        where = f"{self.source}: {path}: " if path else f"{self.source}: "
        return ConfigError(where + message)

    def mapping(self, value: Any, path: str, allowed: Sequence[str], required: Sequence[str] = ()) -> dict:
        """`value` as a mapping with only `allowed` fields and every `required` one."""
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
        """`value` as a list of `what` (absent: empty)."""
        if value is None:
            return []
        if not isinstance(value, list):
            raise self.fail(path, f"must be a list of {what}, got {type(value).__name__}")
        return value

    def boolean(self, value: Any, path: str, default: bool) -> bool:
        """`value` as true/false (absent: `default`)."""
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.fail(path, f"must be true or false, got {value!r}")
        return value

    def string(self, value: Any, path: str) -> str:
        """`value` as a non-empty string."""
        if not isinstance(value, str) or not value:
            raise self.fail(path, f"must be a non-empty string, got {value!r}")
        return value
