"""Filters on endpoint labels: by-label, by-label-selector, and the llm-d P/D role filters."""

from __future__ import annotations

from collections.abc import Sequence

from epp.framework import ConfigError, CycleState, Endpoint, Filter, InferenceRequest, PluginContext, PluginParams

ROLE_LABEL = "llm-d.ai/role"


class LabelValueFilter(Filter):
    """Keeps endpoints whose label has one of the allowed values (or no such label, if allowed)."""

    def __init__(self, name: str, label: str, valid_values: Sequence[str], allows_no_label: bool) -> None:
        super().__init__(name)
        self.label = label
        self.valid_values = frozenset(valid_values)
        self.allows_no_label = allows_no_label

    def describe(self) -> str:
        return (f"label={self.label} validValues={sorted(self.valid_values)} "
                f"allowsNoLabel={str(self.allows_no_label).lower()}")

    def filter(self, state: CycleState, request: InferenceRequest,
               endpoints: Sequence[Endpoint]) -> list[Endpoint]:
        keep = []
        for ep in endpoints:
            value = ep.labels.get(self.label)
            if value is None:
                if self.allows_no_label:
                    keep.append(ep)
            elif value in self.valid_values:
                keep.append(ep)
        return keep


def _string_list(params: PluginParams, plugin: str, key: str) -> list[str]:
    values = params.list(key, []) or []
    if not all(isinstance(v, str) for v in values):
        raise ConfigError(f"plugin {plugin!r}: parameter {key!r} must be a list of strings, got {values!r}")
    return values


class ByLabelFilter(LabelValueFilter):
    """Keeps endpoints whose `label` is in `validValues`; label-less ones only with `allowsNoLabel`."""

    type_name = "by-label"

    def __init__(self, name: str, params: PluginParams, context: PluginContext) -> None:
        label = params.str("label", None)
        if not label:
            raise ConfigError(f"plugin {name!r}: parameter 'label' is required (a label key)")
        values = _string_list(params, name, "validValues")
        allows = params.bool("allowsNoLabel", False)
        if not values and not allows:
            raise ConfigError(f"plugin {name!r}: parameter 'validValues' must list at least one value "
                              "unless 'allowsNoLabel' is true")
        super().__init__(name, label, values, allows)


class ByLabelSelectorFilter(Filter):
    """Keeps endpoints matching a Kubernetes `matchLabels` selector (every pair must match)."""

    type_name = "by-label-selector"

    def __init__(self, name: str, params: PluginParams, context: PluginContext) -> None:
        super().__init__(name)
        match = params.mapping("matchLabels", None)
        if params.list("matchExpressions", None):
            raise ConfigError(f"plugin {name!r}: parameter 'matchExpressions' is not supported; "
                              "use 'matchLabels'")
        if not match:
            raise ConfigError(f"plugin {name!r}: parameter 'matchLabels' is required (a mapping of label: value)")
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in match.items()):
            raise ConfigError(f"plugin {name!r}: parameter 'matchLabels' must map strings to strings")
        self.match_labels = dict(match)

    def describe(self) -> str:
        return f"matchLabels={self.match_labels}"

    def filter(self, state: CycleState, request: InferenceRequest,
               endpoints: Sequence[Endpoint]) -> list[Endpoint]:
        items = self.match_labels.items()
        return [ep for ep in endpoints if all(ep.labels.get(k) == v for k, v in items)]


class DecodeFilter(LabelValueFilter):
    """Keeps decode endpoints: role label `decode` or `both`, or no role label."""

    type_name = "decode-filter"

    def __init__(self, name: str, params: PluginParams, context: PluginContext) -> None:
        super().__init__(name, ROLE_LABEL, ("decode", "both"), True)


class PrefillFilter(LabelValueFilter):
    """Keeps prefill endpoints: role label `prefill`."""

    type_name = "prefill-filter"

    def __init__(self, name: str, params: PluginParams, context: PluginContext) -> None:
        super().__init__(name, ROLE_LABEL, ("prefill",), False)
