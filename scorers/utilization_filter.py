"""utilization-filter: llm-d's caps on scraped and in-flight load; an endpoint over any cap is dropped."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from epp.framework import (
    INFLIGHT_LOAD,
    ConfigError,
    CycleState,
    Endpoint,
    Filter,
    InferenceRequest,
    InflightLoad,
    Plugin,
    PluginContext,
    PluginParams,
)
from epp.scorers.load import inflight_source

METRICS = ("active-requests", "running-requests", "waiting-queue", "kv-cache-utilization")


def _conditions(name: str, raw: list[Any] | None) -> tuple[tuple[str, float], ...]:
    """`conditions`: at least one `{metric, maxValue}`, maxValue >= 0 (a fraction <= 1 for KV-cache use)."""
    if not raw:
        raise ConfigError(f"plugin {name!r}: parameter 'conditions' needs at least one {{metric, maxValue}}")
    out = []
    for i, cond in enumerate(raw):
        path = f"conditions[{i}]"
        if not isinstance(cond, dict):
            raise ConfigError(f"plugin {name!r}: parameter {path!r} must be a mapping {{metric, maxValue}}")
        unknown = sorted(set(cond) - {"metric", "maxValue"})
        if unknown:
            raise ConfigError(f"plugin {name!r}: parameter {path!r}: unknown field(s) {unknown}; allowed: metric, "
                              "maxValue")
        metric, cap = cond.get("metric"), cond.get("maxValue")
        if metric not in METRICS:
            raise ConfigError(f"plugin {name!r}: parameter '{path}.metric' must be one of {list(METRICS)}, "
                              f"got {metric!r}")
        if cap is None:
            raise ConfigError(f"plugin {name!r}: parameter '{path}.maxValue' is required for {metric!r}")
        if isinstance(cap, bool) or not isinstance(cap, (int, float)) or cap < 0:
            raise ConfigError(f"plugin {name!r}: parameter '{path}.maxValue' must be a non-negative number, got "
                              f"{cap!r}")
        if metric == "kv-cache-utilization" and cap > 1:
            raise ConfigError(f"plugin {name!r}: parameter '{path}.maxValue' is a fraction for kv-cache-utilization "
                              f"and must be at most 1, got {cap!r}")
        out.append((str(metric), float(cap)))
    return tuple(out)


class UtilizationFilter(Filter):
    """Keeps the endpoints within every cap of `conditions` (active requests in flight, scraped running
    requests, waiting queue, KV-cache use); none kept: all with `fallbackOnEmpty`, else none."""

    type_name = "utilization-filter"

    def __init__(self, name: str, params: PluginParams, context: PluginContext) -> None:
        super().__init__(name)
        self.conditions = _conditions(name, params.list("conditions", None))
        self.fallback_on_empty = params.bool("fallbackOnEmpty", False)
        self.inflight = inflight_source(params)

    def describe(self) -> str:
        caps = ", ".join(f"{metric} <= {cap:g}" for metric, cap in self.conditions)
        return f"conditions=[{caps}] fallbackOnEmpty={str(self.fallback_on_empty).lower()}"

    def consumes(self) -> frozenset[str]:
        active = any(metric == "active-requests" for metric, _ in self.conditions)
        return frozenset({INFLIGHT_LOAD}) if active else frozenset()

    def plugin_refs(self) -> Mapping[str, str]:
        """The producer `inFlightLoadProducerName` names (resolved by the loader)."""
        return self.inflight.refs()

    def bind_plugins(self, plugins: Mapping[str, Plugin]) -> None:
        self.inflight.bind(self.name, plugins)

    def _value(self, state: CycleState, ep: Endpoint, metric: str) -> float:
        if metric == "active-requests":
            load: InflightLoad | None = state.endpoint_data(self.inflight.read_key, ep.name)
            return float(load.requests) if load is not None else 0.0
        m = ep.metrics
        if metric == "running-requests":
            return float(m.running_requests_size)
        if metric == "waiting-queue":
            return float(m.waiting_queue_size)
        return m.kv_cache_usage

    def filter(self, state: CycleState, request: InferenceRequest, endpoints: Sequence[Endpoint]) -> list[Endpoint]:
        kept = [ep for ep in endpoints
                if all(self._value(state, ep, metric) <= cap for metric, cap in self.conditions)]
        if not kept and self.fallback_on_empty:
            return list(endpoints)
        return kept
