"""vLLM's Prometheus metrics for one simulated replica, rendered in the text exposition format.

Names, types, labels and histogram buckets follow vLLM's ``PrometheusStatLogger``
(labels ``model_name`` and ``engine``; counters exposed with ``_total``; ``cache_config_info``
with one label per cache setting plus ``engine``; ``lora_requests_info`` with only its three
labels and a timestamp value). Rendering by hand keeps a scrape cheap (no registry, no locks).
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable
from dataclasses import dataclass, field

TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0]
REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
ITERATION_TOKENS_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]


class Histogram:
    """Fixed-bucket histogram (cumulative counts computed at render time)."""

    __slots__ = ("buckets", "count", "counts", "sum")

    def __init__(self, buckets: list[float]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float, n: int = 1) -> None:
        """Record `n` observations of `value`."""
        self.counts[bisect.bisect_left(self.buckets, value)] += n
        self.sum += value * n
        self.count += n


@dataclass
class EngineMetrics:
    """Counters and histograms the engine updates; gauges are read from the engine at scrape."""

    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    external_prefix_cache_queries: int = 0
    external_prefix_cache_hits: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    cached_by_source: dict[str, int] = field(default_factory=lambda: {"device": 0, "host": 0, "disk": 0})
    request_success: dict[str, int] = field(default_factory=dict)
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    itl: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS))
    e2e: Histogram = field(default_factory=lambda: Histogram(REQUEST_LATENCY_BUCKETS))
    queue_time: Histogram = field(default_factory=lambda: Histogram(REQUEST_LATENCY_BUCKETS))
    iteration_tokens: Histogram = field(default_factory=lambda: Histogram(ITERATION_TOKENS_BUCKETS))


def _fmt(v: float) -> str:
    if v == float("inf"):
        return "+Inf"
    return repr(float(v))


def _labels(pairs: list[tuple[str, str]]) -> str:
    inner = ",".join(f'{k}="{_escape(v)}"' for k, v in pairs)
    return "{" + inner + "}"


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


class MetricsRenderer:
    """Writes the /metrics text for one replica."""

    def __init__(self, model_name: str, cache_config: dict[str, str],
                 lora_info: Callable[[], tuple[int, list[str], list[str]]] | None = None) -> None:
        self.base = [("engine", "0"), ("model_name", model_name)]
        self.cache_config = sorted(cache_config.items()) + [("engine", "0")]
        self.lora_info = lora_info

    def render(self, *, running: int, waiting: int, kv_usage: float, sleep_level: int | None,
               m: EngineMetrics, cpu_usage: float | None = None) -> str:
        """The exposition text; `sleep_level` None means awake."""
        out: list[str] = []
        lb = _labels(self.base)

        def gauge(name: str, value: float, help_: str, labels: str = lb) -> None:
            out.append(f"# HELP {name} {help_}\n# TYPE {name} gauge\n{name}{labels} {_fmt(value)}")

        def counter(name: str, value: float, help_: str) -> None:
            out.append(f"# HELP {name}_total {help_}\n# TYPE {name}_total counter\n{name}_total{lb} {_fmt(value)}")

        def hist(name: str, h: Histogram, help_: str) -> None:
            lines = [f"# HELP {name} {help_}", f"# TYPE {name} histogram"]
            acc = 0
            for le, c in zip(h.buckets + [float("inf")], h.counts):
                acc += c
                lines.append(f"{name}_bucket{_labels(self.base[:1] + [('le', _fmt(le))] + self.base[1:])} {_fmt(acc)}")
            lines.append(f"{name}_count{lb} {_fmt(h.count)}")
            lines.append(f"{name}_sum{lb} {_fmt(h.sum)}")
            out.append("\n".join(lines))

        gauge("vllm:num_requests_running", running, "Number of requests in model execution batches.")
        gauge("vllm:num_requests_waiting", waiting, "Number of requests waiting to be processed.")
        lines = ["# HELP vllm:num_requests_waiting_by_reason Number of waiting requests by reason.",
                 "# TYPE vllm:num_requests_waiting_by_reason gauge"]
        for reason, v in (("capacity", waiting), ("deferred", 0)):
            lines.append(f"vllm:num_requests_waiting_by_reason{_labels(self.base + [('reason', reason)])} {_fmt(v)}")
        out.append("\n".join(lines))
        gauge("vllm:kv_cache_usage_perc", kv_usage, "KV-cache usage. 1 means 100 percent usage.")
        states = [("awake", sleep_level is None), ("weights_offloaded", sleep_level == 1),
                  ("discard_all", sleep_level == 2)]
        lines = [("# HELP vllm:engine_sleep_state Engine sleep state; awake = 0 means engine is sleeping; "
                  "awake = 1 means engine is awake; weights_offloaded = 1 means sleep level 1; "
                  "discard_all = 1 means sleep level 2."), "# TYPE vllm:engine_sleep_state gauge"]
        for state, on in states:
            lines.append(f"vllm:engine_sleep_state{_labels(self.base + [('sleep_state', state)])} {_fmt(1 if on else 0)}")
        out.append("\n".join(lines))
        counter("vllm:prefix_cache_queries", m.prefix_cache_queries,
                "Prefix cache queries, in terms of number of queried tokens.")
        counter("vllm:prefix_cache_hits", m.prefix_cache_hits,
                "Prefix cache hits, in terms of number of cached tokens.")
        counter("vllm:external_prefix_cache_queries", m.external_prefix_cache_queries,
                "External prefix cache queries from KV connector cross-instance cache sharing, in terms of number of queried tokens.")
        counter("vllm:external_prefix_cache_hits", m.external_prefix_cache_hits,
                "External prefix cache hits from KV connector cross-instance cache sharing, in terms of number of cached tokens.")
        counter("vllm:num_preemptions", 0, "Cumulative number of preemption from the engine.")
        counter("vllm:prompt_tokens", m.prompt_tokens, "Number of prefill tokens processed.")
        counter("vllm:generation_tokens", m.generation_tokens, "Number of generation tokens processed.")
        lines = ["# HELP vllm:prompt_tokens_cached_by_source_total Number of cached prompt tokens by source.",
                 "# TYPE vllm:prompt_tokens_cached_by_source_total counter"]
        for source, v in sorted(m.cached_by_source.items()):
            lines.append(f"vllm:prompt_tokens_cached_by_source_total{_labels(self.base + [('source', source)])} {_fmt(v)}")
        out.append("\n".join(lines))
        lines = ["# HELP vllm:request_success_total Count of successfully processed requests.",
                 "# TYPE vllm:request_success_total counter"]
        for reason in ("stop", "length", "abort", "error", "repetition"):
            lines.append(f"vllm:request_success_total{_labels(self.base[:1] + [('finished_reason', reason)] + self.base[1:])} "
                         f"{_fmt(m.request_success.get(reason, 0))}")
        out.append("\n".join(lines))
        hist("vllm:time_to_first_token_seconds", m.ttft, "Histogram of time to first token in seconds.")
        hist("vllm:inter_token_latency_seconds", m.itl, "Histogram of inter-token latency in seconds.")
        hist("vllm:e2e_request_latency_seconds", m.e2e, "Histogram of e2e request latency in seconds.")
        hist("vllm:request_queue_time_seconds", m.queue_time, "Histogram of time spent in WAITING phase for request.")
        hist("vllm:iteration_tokens_total", m.iteration_tokens, "Histogram of number of tokens per engine_step.")
        if cpu_usage is not None:
            gauge("vllm:kv_offload_cpu_cache_usage_perc", cpu_usage, "CPU offload cache usage. 1 means 100 percent usage.")
        out.append("# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
                   "# TYPE vllm:cache_config_info gauge\n"
                   f"vllm:cache_config_info{_labels(self.cache_config)} 1.0")
        if self.lora_info is not None:
            max_lora, waiting_l, running_l = self.lora_info()
            labels = _labels([("max_lora", str(max_lora)), ("running_lora_adapters", ",".join(running_l)),
                              ("waiting_lora_adapters", ",".join(waiting_l))])
            out.append("# HELP vllm:lora_requests_info Running stats on lora requests.\n"
                       "# TYPE vllm:lora_requests_info gauge\n"
                       f"vllm:lora_requests_info{labels} {_fmt(time.time())}")
        return "\n".join(out) + "\n"
