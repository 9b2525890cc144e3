"""Filters on endpoint labels: by-label, label-selector-filter, and the llm-d P/D role filters."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

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


SELECTOR_OPERATORS = ("In", "NotIn", "Exists", "DoesNotExist")


def _requirement(name: str, index: int, raw: object) -> tuple[str, str, frozenset[str]]:
    """One `matchExpressions` entry: (key, operator, values), checked as Kubernetes checks it."""
    where = f"plugin {name!r}: parameter 'matchExpressions[{index}]'"
    if not isinstance(raw, dict) or not set(raw) <= {"key", "operator", "values"}:
        raise ConfigError(f"{where} must be a mapping with fields key, operator, values, got {raw!r}")
    key, operator, values = raw.get("key"), raw.get("operator"), raw.get("values") or []
    if not isinstance(key, str) or not key:
        raise ConfigError(f"{where}: 'key' is required (a label key)")
    if operator not in SELECTOR_OPERATORS:
        raise ConfigError(f"{where}: 'operator' must be one of {list(SELECTOR_OPERATORS)}, got {operator!r}")
    if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
        raise ConfigError(f"{where}: 'values' must be a list of strings")
    if operator in ("In", "NotIn") and not values:
        raise ConfigError(f"{where}: operator {operator} needs at least one value")
    if operator in ("Exists", "DoesNotExist") and values:
        raise ConfigError(f"{where}: operator {operator} takes no values")
    return key, operator, frozenset(values)


def _matches(labels: Mapping[str, str], key: str, operator: str, values: frozenset[str]) -> bool:
    if operator == "In":
        return labels.get(key) in values
    if operator == "NotIn":
        return labels.get(key) not in values  # an endpoint without the label matches, as in Kubernetes
    if operator == "Exists":
        return key in labels
    return key not in labels


class LabelSelectorFilter(Filter):
    """Keeps endpoints matching a Kubernetes label selector: every `matchLabels` pair and every
    `matchExpressions` requirement (In, NotIn, Exists, DoesNotExist)."""

    type_name = "label-selector-filter"

    def __init__(self, name: str, params: PluginParams, context: PluginContext) -> None:
        super().__init__(name)
        match = params.mapping("matchLabels", None) or {}
        expressions = params.list("matchExpressions", None) or []
        if not match and not expressions:
            raise ConfigError(f"plugin {name!r}: parameter 'matchLabels' or 'matchExpressions' is required")
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in match.items()):
            raise ConfigError(f"plugin {name!r}: parameter 'matchLabels' must map strings to strings")
        self.match_labels = dict(match)
        self.requirements = tuple(_requirement(name, i, raw) for i, raw in enumerate(expressions))

    def describe(self) -> str:
        text = f"matchLabels={self.match_labels}" if self.match_labels else ""
        if self.requirements:
            text += (" " if text else "") + "matchExpressions=" + "; ".join(
                f"{key} {op} {sorted(values)}" if values else f"{key} {op}" for key, op, values in self.requirements)
        return text

    def filter(self, state: CycleState, request: InferenceRequest,
               endpoints: Sequence[Endpoint]) -> list[Endpoint]:
        items = self.match_labels.items()
        requirements = self.requirements
        return [ep for ep in endpoints if all(ep.labels.get(k) == v for k, v in items)
                and all(_matches(ep.labels, *req) for req in requirements)]


# llm-d's role values (R `filter/bylabel/roles.go`): combined roles and the deprecated `both`.
DECODE_ROLES = ("decode", "prefill-decode", "both", "encode-prefill-decode")
PREFILL_ROLES = ("prefill", "encode-prefill", "prefill-decode", "both", "encode-prefill-decode")
ENCODE_ROLES = ("encode", "encode-prefill", "encode-prefill-decode")


class DecodeFilter(LabelValueFilter):
    """Keeps decode endpoints: a role label that includes decode (or `both`), or no role label."""

    type_name = "decode-filter"

    def __init__(self, name: str, params: PluginParams, context: PluginContext) -> None:
        super().__init__(name, ROLE_LABEL, DECODE_ROLES, True)


class EncodeFilter(LabelValueFilter):
    """Keeps encode endpoints: a role label that includes encode (multimodal encoders of E/PD)."""

    type_name = "encode-filter"

    def __init__(self, name: str, params: PluginParams, context: PluginContext) -> None:
        super().__init__(name, ROLE_LABEL, ENCODE_ROLES, False)


class PrefillFilter(LabelValueFilter):
    """Keeps prefill endpoints: a role label that includes prefill (or `both`)."""

    type_name = "prefill-filter"

    def __init__(self, name: str, params: PluginParams, context: PluginContext) -> None:
        super().__init__(name, ROLE_LABEL, PREFILL_ROLES, False)
