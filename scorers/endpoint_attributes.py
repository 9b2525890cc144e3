"""llm-d's `endpoint-attribute-filter` and `endpoint-attribute-scorer`: routing on one numeric endpoint attribute.

The attribute is published before scheduling, per endpoint, under `<producer>/<attribute>` in
`ENDPOINT_ATTRIBUTES` (today by `dcgm-extractor`, epp.datalayer.dcgm: `GPUUtilization`).

`endpoint-attribute-filter` keeps endpoints whose attribute satisfies `algorithm.threshold`
(`operator`, `value`); `onMissing: Pass` (default) keeps those without it, `Fail` drops them;
`fallbackOnEmpty` returns every candidate when none is left. `endpoint-attribute-scorer` scores the
attribute linearly, `linear_lower_is_better` or `linear_higher_is_better`, over `fixedRange`
(`min`, `max`, clamped) or the candidates' own range (`adaptiveRange`, the default; all equal: 1.0);
an endpoint without the attribute scores 0. Both read the attribute of the extractor named by
`producer`. llm-d's default producer, the core metrics extractor's custom metrics, is not read here
(its `engineConfigs` are refused): name the extractor.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from epp.framework import (
    ConfigError,
    CycleState,
    DataKey,
    Endpoint,
    Filter,
    InferenceRequest,
    PluginContext,
    PluginParams,
    PluginRegistry,
    Scorer,
)

# Per endpoint: "<producer>/<attribute>" -> value, for the attribute filter and scorer.
ENDPOINT_ATTRIBUTES: DataKey[Mapping[str, float]] = DataKey("endpoint-attributes")
OPERATORS = {
    "LessThan": lambda a, b: a < b, "LessThanOrEqual": lambda a, b: a <= b,
    "GreaterThan": lambda a, b: a > b, "GreaterThanOrEqual": lambda a, b: a >= b,
    "Equal": lambda a, b: a == b, "NotEqual": lambda a, b: a != b,
}


def _fail(name: str, key: str, message: str) -> ConfigError:
    return ConfigError(f"plugin {name!r}: parameter {key!r} {message}")


def _attribute_key(name: str, params: PluginParams, key: str) -> str:
    attribute = params.str(key, "")
    if not attribute:
        raise _fail(name, key, "is required (the endpoint attribute to read, e.g. GPUUtilization)")
    producer = params.str("producer", None)
    if producer is None:
        raise _fail(name, "producer", "is required here: llm-d's default, the core metrics extractor's custom "
                    "metrics, is not read; name the extractor publishing the attribute (e.g. dcgm-extractor)")
    if not producer:
        raise _fail(name, "producer", "'' (any producer) is not supported; name the extractor")
    return f"{producer}/{attribute}"


def _value(state: CycleState, ep: Endpoint, key: str) -> float | None:
    attributes = state.endpoint_data(ENDPOINT_ATTRIBUTES, ep.name)
    return attributes.get(key) if attributes else None


class EndpointAttributeFilter(Filter):
    """Keeps endpoints whose attribute passes the threshold (onMissing, fallbackOnEmpty as llm-d)."""

    type_name = "endpoint-attribute-filter"

    def __init__(self, name: str, params: PluginParams, context: PluginContext) -> None:
        super().__init__(name)
        self.key = _attribute_key(name, params, "attribute")
        self.on_missing = params.str("onMissing", "Pass", choices=("Pass", "Fail"))
        self.fallback_on_empty = params.bool("fallbackOnEmpty", False)
        algorithm = params.mapping("algorithm", None)
        if not isinstance(algorithm, Mapping) or algorithm.get("type") != "threshold":
            raise _fail(name, "algorithm", "must be {type: threshold, threshold: {operator, value}} (the only "
                        f"algorithm), got {algorithm!r}")
        if set(algorithm) - {"type", "threshold"}:
            raise _fail(name, "algorithm", f"unknown field(s) {sorted(set(algorithm) - {'type', 'threshold'})}")
        threshold = algorithm.get("threshold")
        if not isinstance(threshold, Mapping) or set(threshold) != {"operator", "value"}:
            raise _fail(name, "algorithm.threshold", f"must be {{operator, value}}, got {threshold!r}")
        if threshold["operator"] not in OPERATORS:
            raise _fail(name, "algorithm.threshold.operator", f"must be one of {', '.join(OPERATORS)}, got "
                        f"{threshold['operator']!r}")
        value = threshold["value"]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _fail(name, "algorithm.threshold.value", f"must be a number, got {value!r}")
        self.operator = str(threshold["operator"])
        self.threshold = float(value)

    def describe(self) -> str:
        return (f"{self.key} {self.operator} {self.threshold:g}; onMissing={self.on_missing} "
                f"fallbackOnEmpty={str(self.fallback_on_empty).lower()}")

    def filter(self, state: CycleState, request: InferenceRequest, endpoints: Sequence[Endpoint]) -> list[Endpoint]:
        compare = OPERATORS[self.operator]
        kept = []
        for ep in endpoints:
            value = _value(state, ep, self.key)
            if (self.on_missing == "Pass") if value is None else compare(value, self.threshold):
                kept.append(ep)
        return kept if kept or not self.fallback_on_empty else list(endpoints)


class EndpointAttributeScorer(Scorer):
    """Linear score of an attribute, lower or higher is better, over a fixed or the candidates' range."""

    type_name = "endpoint-attribute-scorer"

    def __init__(self, name: str, params: PluginParams, context: PluginContext) -> None:
        super().__init__(name)
        self.key = _attribute_key(name, params, "attributeKey")
        algorithm = params.mapping("algorithm", None)
        if not isinstance(algorithm, Mapping) or set(algorithm) - {"type", "normalization"}:
            raise _fail(name, "algorithm", f"must be {{type, normalization}}, got {algorithm!r}")
        kind = algorithm.get("type")
        if kind not in ("linear_lower_is_better", "linear_higher_is_better"):
            raise _fail(name, "algorithm.type", f"must be linear_lower_is_better or linear_higher_is_better, got "
                        f"{kind!r}")
        self.lower_is_better = kind == "linear_lower_is_better"
        self.fixed: tuple[float, float] | None = None
        normalization = algorithm.get("normalization") or {}
        if not isinstance(normalization, Mapping) or len(normalization) > 1 or set(normalization) - {
                "adaptiveRange", "fixedRange"}:
            raise _fail(name, "algorithm.normalization", "must hold at most one of adaptiveRange, fixedRange, got "
                        f"{normalization!r}")
        if "fixedRange" in normalization:
            bounds = normalization["fixedRange"]
            if not isinstance(bounds, Mapping) or set(bounds) != {"min", "max"} or not all(
                    isinstance(bounds[k], (int, float)) and not isinstance(bounds[k], bool) for k in ("min", "max")):
                raise _fail(name, "algorithm.normalization.fixedRange", f"must be {{min, max}} numbers, got {bounds!r}")
            if bounds["min"] >= bounds["max"]:
                raise _fail(name, "algorithm.normalization.fixedRange", "min must be less than max")
            self.fixed = (float(bounds["min"]), float(bounds["max"]))

    def describe(self) -> str:
        direction = "lower" if self.lower_is_better else "higher"
        span = f"fixed [{self.fixed[0]:g}, {self.fixed[1]:g}]" if self.fixed else "adaptive range"
        return f"{self.key}, {direction} is better, {span}"

    def score(self, state: CycleState, request: InferenceRequest,
              endpoints: Sequence[Endpoint]) -> Mapping[str, float]:
        values = {ep.name: v for ep in endpoints if (v := _value(state, ep, self.key)) is not None}
        out = dict.fromkeys((ep.name for ep in endpoints), 0.0)
        if not values:
            return out
        low, high = self.fixed if self.fixed else (min(values.values()), max(values.values()))
        for name, value in values.items():
            if high == low:
                out[name] = 1.0
                continue
            fraction = (min(max(value, low), high) - low) / (high - low)
            out[name] = 1.0 - fraction if self.lower_is_better else fraction
        return out


def register(registry: PluginRegistry) -> None:
    """Entry point of the `epp.plugins` group (through the built-in scorers): registers the filter and the scorer."""
    for cls in (EndpointAttributeFilter, EndpointAttributeScorer):
        registry.register_class(cls)
