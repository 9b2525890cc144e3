"""The picker's own Prometheus metrics (GIE names), on a registry of its own."""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from epp.framework.plugin import Plugin
from epp.limits import DEFAULT_MAX_LABEL_VALUE_LENGTH

# Scheduling takes tens of microseconds to a few milliseconds: sub-millisecond buckets matter.
_LATENCY_BUCKETS = (0.00005, 0.0001, 0.0002, 0.0003, 0.0004, 0.0005, 0.0006, 0.0008, 0.001,
                    0.002, 0.003, 0.004, 0.005, 0.01, 0.02, 0.05, 0.1)
_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768,
                  65536, 131072, 262144)
_DURATION_BUCKETS = (0.005, 0.025, 0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 1.25, 1.5, 2, 3, 4, 5, 6,
                     8, 10, 15, 20, 30, 45, 60, 120, 180, 240, 300, 360, 480, 600, 900, 1200)


# The series every client-chosen value shares once a label's budget of distinct values is spent.
OTHER_LABEL = "__other__"
OTHER_MODELS = OTHER_LABEL


class BoundedLabels:
    """Label values (made safe by `shorten`) as given until `limit` distinct ones were seen, then `__other__`."""

    def __init__(self, limit: int, shorten: Callable[[str], str] | None = None) -> None:
        self.limit = limit
        self.shorten = shorten
        self._seen: set[str] = set()

    def __call__(self, value: str) -> str:
        if self.shorten is not None:
            value = self.shorten(value)
        if value in self._seen:
            return value
        if len(self._seen) < self.limit:
            self._seen.add(value)
            return value
        return OTHER_LABEL


class EppMetrics:
    """Every metric the ext_proc path records; plugins register theirs on `registry` too."""

    def __init__(self, registry: CollectorRegistry | None = None, *, max_model_labels: int = 200,
                 max_label_value_length: int = DEFAULT_MAX_LABEL_VALUE_LENGTH) -> None:
        self.registry = registry or CollectorRegistry()
        # Model names come from client bodies: without a cap, random names would grow the series forever,
        # and without a length bound three 1 MiB names make a 100 MB scrape.
        self.max_model_labels = max_model_labels
        self.max_label_value_length = max_label_value_length
        self._model_labels: set[str] = set()
        self._model_pairs: set[tuple[str, str]] = set()
        r = self.registry
        self.requests = Counter(
            "inference_objective_request", "Requests by model.",
            ["model_name", "target_model_name", "priority"], registry=r)
        self.request_errors = Counter(
            "inference_objective_request_error", "Failed requests by error code.",
            ["model_name", "target_model_name", "error_code"], registry=r)
        self.request_duration = Histogram(
            "inference_objective_request_duration_seconds",
            "From request headers to the end of the response.",
            ["model_name", "target_model_name"], buckets=_DURATION_BUCKETS, registry=r)
        self.request_sizes = Histogram(
            "inference_objective_request_sizes", "Request body sizes in bytes.",
            ["model_name", "target_model_name"],
            buckets=(64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304, 16777216),
            registry=r)
        self.input_tokens = Histogram(
            "inference_objective_input_tokens", "Prompt tokens reported by the model server.",
            ["model_name", "target_model_name"], buckets=_TOKEN_BUCKETS, registry=r)
        self.output_tokens = Histogram(
            "inference_objective_output_tokens", "Completion tokens reported by the model server.",
            ["model_name", "target_model_name"], buckets=_TOKEN_BUCKETS, registry=r)
        self.cached_tokens = Histogram(
            "inference_objective_prompt_cached_tokens", "Prompt tokens served from the prefix cache.",
            ["model_name", "target_model_name"], buckets=_TOKEN_BUCKETS, registry=r)
        self.running_requests = Gauge(
            "inference_objective_running_requests", "Requests in flight through the picker.",
            ["model_name"], registry=r)
        self.scheduler_e2e = Histogram(
            "inference_extension_scheduler_e2e_duration_seconds",
            "From parsed request to picked endpoint (admission, producers, scheduling, hooks).",
            buckets=_LATENCY_BUCKETS, registry=r)
        self.scheduler_attempts = Counter(
            "inference_extension_scheduler_attempts", "Scheduling attempts by outcome.",
            ["status"], registry=r)
        self.plugin_duration = Histogram(
            "inference_extension_plugin_duration_seconds", "Time spent in each plugin call.",
            ["extension_point", "plugin_type", "plugin_name"], buckets=_LATENCY_BUCKETS, registry=r)
        self.ready_endpoints = Gauge(
            "inference_pool_ready_pods", "Endpoints known and healthy.", registry=r)
        self.streams_active = Gauge(
            "epp_extproc_streams_active", "Open ext_proc streams.", registry=r)
        self.stream_errors = Counter(
            "epp_extproc_stream_errors", "ext_proc streams ended by an unexpected error.",
            ["reason"], registry=r)
        self.unreadable_responses = Counter(
            "epp_extproc_unreadable_responses",
            "Model-server responses the picker could not read (passed through unchanged), by reason.",
            ["reason"], registry=r)
        self.messages = Counter(
            "epp_extproc_messages", "ext_proc messages received, by phase.", ["phase"], registry=r)
        self.messages_by_phase = {phase: self.messages.labels(phase) for phase in (
            "request_headers", "request_body", "request_trailers", "response_headers", "response_body",
            "response_trailers")}
        self.gc_pauses = Histogram(
            "epp_gc_pause_seconds",
            "Garbage collections of the picker's process, by generation: the event loop stands still meanwhile.",
            ["generation"], buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0), registry=r)
        self._plugin_children: dict[tuple[str, int], Histogram] = {}

    def label_value(self, value: str) -> str:
        """A client-chosen string as a safe label value: encodable as UTF-8, at most the length limit.

        A lone surrogate would make every later scrape fail to encode; it is shown escaped instead.
        """
        limit = self.max_label_value_length
        cut = len(value) > limit
        value = value[:limit]
        if not value.isascii():
            value = value.encode("utf-8", "backslashreplace").decode("utf-8")
            cut = cut or len(value) > limit
        return value[:limit - 1] + "…" if cut else value

    def model_labels(self, model: str, target_model: str) -> tuple[str, str]:
        """`(model_name, target_model_name)` label values; both `__other__` once `max_model_labels` pairs exist.

        Pairs are capped, not only names: independent caps on each would still allow 200 × 200 series.
        """
        pair = (self.label_value(model), self.label_value(target_model))
        if pair in self._model_pairs:
            return pair
        if len(self._model_pairs) < self.max_model_labels:
            self._model_pairs.add(pair)
            self._model_labels.update(pair)
            return pair
        return OTHER_MODELS, OTHER_MODELS

    def model_label(self, model: str) -> str:
        """`model` as a label value, or `__other__` once `max_model_labels` names have been seen."""
        model = self.label_value(model)
        if model in self._model_labels:
            return model
        if len(self._model_labels) < self.max_model_labels:
            self._model_labels.add(model)
            return model
        return OTHER_MODELS

    def observe_plugin(self, extension_point: str, plugin: Plugin, seconds: float) -> None:
        """Record one plugin call; label children are cached because this runs per request."""
        key = (extension_point, id(plugin))
        child = self._plugin_children.get(key)
        if child is None:
            child = self.plugin_duration.labels(extension_point, plugin.type_name or type(plugin).__name__,
                                                plugin.name)
            self._plugin_children[key] = child
        child.observe(seconds)


class GcPauseRecorder:
    """A `gc.callbacks` entry timing each collection into `EppMetrics.gc_pauses`."""

    def __init__(self, metrics: EppMetrics) -> None:
        self._by_generation = [metrics.gc_pauses.labels(str(generation)) for generation in range(3)]
        self._started = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self._by_generation[info["generation"]].observe(time.perf_counter() - self._started)
