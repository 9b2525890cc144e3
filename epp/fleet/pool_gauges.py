"""Pool-level scaling signals per model, computed from the endpoint registry when Prometheus scrapes.

An autoscaler (KEDA, HPA with a Prometheus adapter) targets these, not per-replica vLLM series:

- `epp_pool_replicas{model,state}`: awake / sleeping / unhealthy replicas;
- `epp_pool_waiting_requests{model}`, `epp_pool_running_requests{model}`: summed over awake replicas;
- `epp_pool_kv_cache_usage{model}`: mean KV-cache usage (0..1) over awake replicas;
- `epp_pool_prefill_demand_tokens_per_second{model}`: computed (uncached) prompt tokens per second
  routed to the model's replicas over the last `window` seconds;
- `epp_pool_prefill_capacity_tokens_per_second{model}` and `epp_pool_prefill_demand_ratio{model}`:
  awake replicas x the configured per-replica prefill throughput, and demand / capacity (only
  when a throughput is configured).

A replica's model is its `model` label ("" when unlabeled: a one-model pool).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from epp.datalayer.registry import EndpointRegistry
from epp.framework.types import Endpoint

_BUCKET_S = 5.0


class RateWindow:
    """Events per second over the last `window` seconds, in fixed buckets (bounded memory)."""

    def __init__(self, window: float = 60.0, bucket: float = _BUCKET_S) -> None:
        self.bucket = bucket
        self.size = max(1, math.ceil(window / bucket))
        self._counts: dict[int, float] = {}

    def add(self, amount: float, now: float | None = None) -> None:
        """Record `amount` at `now` (time.monotonic())."""
        slot = int((time.monotonic() if now is None else now) // self.bucket)
        self._counts[slot] = self._counts.get(slot, 0.0) + amount
        for old in [s for s in self._counts if s <= slot - self.size]:
            del self._counts[old]

    def rate(self, now: float | None = None) -> float:
        """Amount per second over the window ending at `now`."""
        slot = int((time.monotonic() if now is None else now) // self.bucket)
        total = sum(v for s, v in self._counts.items() if s > slot - self.size)
        return total / (self.size * self.bucket)


class PoolGauges(Collector):
    """The pool's per-model scaling gauges, read from the endpoint registry at collection time."""

    def __init__(self, endpoints: EndpointRegistry, *, model_label: str = "model",
                 prefill_capacity_tokens_per_s: float = 0.0, window: float = 60.0, max_models: int = 100) -> None:
        self.endpoints = endpoints
        self.model_label = model_label
        self.capacity_per_replica = prefill_capacity_tokens_per_s
        self.window = window
        self.max_models = max_models
        self._demand: dict[str, RateWindow] = {}

    def register(self, registry: CollectorRegistry) -> PoolGauges:
        """Add the gauges to `registry`; returns self."""
        registry.register(self)
        return self

    def model_of(self, endpoint: Endpoint) -> str:
        return endpoint.labels.get(self.model_label, "")

    def record_prefill(self, endpoint: Endpoint, tokens: int) -> None:
        """Count `tokens` computed prompt tokens sent to `endpoint` (its model's demand)."""
        model = self.model_of(endpoint)
        window = self._demand.get(model)
        if window is None:
            if len(self._demand) >= self.max_models:
                return  # models come from endpoint labels; the bound only guards a runaway discovery
            window = self._demand[model] = RateWindow(self.window)
        window.add(max(0, tokens))

    def describe(self) -> list:
        return []  # collected on demand: nothing to check at registration

    def collect(self) -> Iterator[GaugeMetricFamily]:
        replicas = GaugeMetricFamily("epp_pool_replicas", "Replicas of each model by state (awake, sleeping, "
                                     "unhealthy).", labels=["model", "state"])
        waiting = _model_gauge("epp_pool_waiting_requests", "Requests waiting on the awake replicas of a model "
                               "(vLLM num_requests_waiting, summed).")
        running = _model_gauge("epp_pool_running_requests", "Requests running on the awake replicas of a model, "
                               "summed.")
        kv = _model_gauge("epp_pool_kv_cache_usage", "Mean KV-cache usage (0..1) of the awake replicas of a model.")
        demand = _model_gauge("epp_pool_prefill_demand_tokens_per_second", "Computed (uncached) prompt tokens per "
                              "second routed to a model's replicas.")
        capacity = _model_gauge("epp_pool_prefill_capacity_tokens_per_second", "Awake replicas x the configured "
                                "prefill throughput per replica.")
        ratio = _model_gauge("epp_pool_prefill_demand_ratio", "Prefill demand / prefill capacity (above 1: more "
                             "replicas needed).")
        by_model: dict[str, list[Endpoint]] = {}
        for ep in self.endpoints.snapshot():
            by_model.setdefault(self.model_of(ep), []).append(ep)
        now = time.monotonic()
        for model in sorted(set(by_model) | set(self._demand)):
            eps = by_model.get(model, [])
            awake = [ep for ep in eps if ep.healthy and not ep.metrics.sleeping]
            asleep = sum(1 for ep in eps if ep.healthy and ep.metrics.sleeping)
            replicas.add_metric([model, "awake"], len(awake))
            replicas.add_metric([model, "sleeping"], asleep)
            replicas.add_metric([model, "unhealthy"], len(eps) - len(awake) - asleep)
            waiting.add_metric([model], sum(ep.metrics.waiting_queue_size for ep in awake))
            running.add_metric([model], sum(ep.metrics.running_requests_size for ep in awake))
            kv.add_metric([model], sum(ep.metrics.kv_cache_usage for ep in awake) / len(awake) if awake else 0.0)
            rate = self._demand[model].rate(now) if model in self._demand else 0.0
            demand.add_metric([model], rate)
            if self.capacity_per_replica > 0:
                cap = len(awake) * self.capacity_per_replica
                capacity.add_metric([model], cap)
                ratio.add_metric([model], rate / cap if cap > 0 else (math.inf if rate > 0 else 0.0))
        yield from (replicas, waiting, running, kv, demand)
        if self.capacity_per_replica > 0:
            yield from (capacity, ratio)


def _model_gauge(name: str, documentation: str) -> GaugeMetricFamily:
    """A gauge family labelled by model."""
    return GaugeMetricFamily(name, documentation, labels=["model"])
