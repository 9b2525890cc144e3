"""Synthetic `/metrics` pages shaped like vLLM's (prometheus_client exposition) for benchmarks.

Fixed content (every counter 42, every histogram alike), so page sizes and parse costs compare
across checkouts and with recorded results. Tests use tests/support/vllm_metrics.py instead,
built on a page a real vLLM served."""

from __future__ import annotations

from dataclasses import dataclass, field

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                    5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)
_HISTOGRAMS = (
    ("vllm:time_to_first_token_seconds", _LATENCY_BUCKETS),
    ("vllm:inter_token_latency_seconds", _LATENCY_BUCKETS),
    ("vllm:request_time_per_output_token_seconds", _LATENCY_BUCKETS),
    ("vllm:e2e_request_latency_seconds", _LATENCY_BUCKETS),
    ("vllm:request_queue_time_seconds", _LATENCY_BUCKETS),
    ("vllm:request_inference_time_seconds", _LATENCY_BUCKETS),
    ("vllm:request_prefill_time_seconds", _LATENCY_BUCKETS),
    ("vllm:request_decode_time_seconds", _LATENCY_BUCKETS),
    ("vllm:request_prompt_tokens", _TOKEN_BUCKETS),
    ("vllm:request_generation_tokens", _TOKEN_BUCKETS),
    ("vllm:iteration_tokens_total", _TOKEN_BUCKETS),
    ("vllm:request_params_n", _TOKEN_BUCKETS),
    ("vllm:request_params_max_tokens", _TOKEN_BUCKETS),
    ("vllm:request_max_num_generation_tokens", _TOKEN_BUCKETS),
    ("vllm:request_prefill_kv_computed_tokens", _TOKEN_BUCKETS),
)
_COUNTERS = ("vllm:num_preemptions", "vllm:prompt_tokens", "vllm:generation_tokens",
             "vllm:prompt_tokens_cached", "vllm:prefix_cache_queries", "vllm:prefix_cache_hits",
             "vllm:external_prefix_cache_queries", "vllm:external_prefix_cache_hits")


@dataclass
class VllmState:
    """What one vLLM server reports; `engines` > 1 repeats every per-engine series (DP ranks)."""

    waiting: float = 0
    running: float = 0
    kv_usage: float = 0.0
    model: str = "tiny"
    engines: int = 1
    block_size: int = 16
    num_gpu_blocks: int | None = 1024
    lora: list[tuple[str, str, int, float]] | None = None  # (running, waiting, max_lora, value)
    prefix_queries: float = 0.0
    prefix_hits: float = 0.0
    extra_lines: list[str] = field(default_factory=list)


def _labels(**labels: object) -> str:
    return ",".join(f'{key}="{value}"' for key, value in labels.items())


def vllm_metrics_page(state: VllmState) -> str:
    """A full page in the order and shape prometheus_client gives vLLM's registry."""
    out: list[str] = [
        "# HELP python_gc_objects_collected_total Objects collected during gc",
        "# TYPE python_gc_objects_collected_total counter",
        'python_gc_objects_collected_total{generation="0"} 12345.0',
        'python_gc_objects_collected_total{generation="1"} 2345.0',
        "# HELP process_resident_memory_bytes Resident memory size in bytes.",
        "# TYPE process_resident_memory_bytes gauge",
        "process_resident_memory_bytes 3.1e+09",
    ]
    engines = [_labels(model_name=state.model, engine=str(e)) for e in range(state.engines)]

    def gauge(name: str, help_text: str, value: float) -> None:
        out.append(f"# HELP {name} {help_text}")
        out.append(f"# TYPE {name} gauge")
        out.extend(f"{name}{{{lbl}}} {float(value)!r}" for lbl in engines)

    gauge("vllm:num_requests_running", "Number of requests in model execution batches.", state.running)
    gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", state.waiting)
    out.append("# HELP vllm:num_requests_waiting_by_reason Waiting requests by reason.")
    out.append("# TYPE vllm:num_requests_waiting_by_reason gauge")
    for lbl in engines:
        out.append(f'vllm:num_requests_waiting_by_reason{{{lbl},reason="capacity"}} 99.0')
        out.append(f'vllm:num_requests_waiting_by_reason{{{lbl},reason="deferred"}} 98.0')
    gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", state.kv_usage)
    out.append("# HELP vllm:engine_sleep_state Engine sleep state")
    out.append("# TYPE vllm:engine_sleep_state gauge")
    for lbl in engines:
        for sleep_state, value in (("awake", 1.0), ("weights_offloaded", 0.0), ("discard_all", 0.0)):
            out.append(f'vllm:engine_sleep_state{{{lbl},sleep_state="{sleep_state}"}} {value}')
    for name in _COUNTERS:
        value = {"vllm:prefix_cache_queries": state.prefix_queries,
                 "vllm:prefix_cache_hits": state.prefix_hits}.get(name, 42.0)
        out.append(f"# HELP {name}_total Counter {name}.")
        out.append(f"# TYPE {name}_total counter")
        out.extend(f"{name}_total{{{lbl}}} {float(value)!r}" for lbl in engines)
        out.append(f"# HELP {name}_created Counter {name}.")
        out.append(f"# TYPE {name}_created gauge")
        out.extend(f"{name}_created{{{lbl}}} 1.7e+09" for lbl in engines)
    out.append("# HELP vllm:request_success_total Count of successfully processed requests.")
    out.append("# TYPE vllm:request_success_total counter")
    for lbl in engines:
        for reason in ("stop", "length", "abort", "error"):
            out.append(f'vllm:request_success_total{{{lbl},finished_reason="{reason}"}} 7.0')
    for name, buckets in _HISTOGRAMS:
        out.append(f"# HELP {name} Histogram {name}.")
        out.append(f"# TYPE {name} histogram")
        for lbl in engines:
            for i, le in enumerate(buckets):
                out.append(f'{name}_bucket{{{lbl},le="{float(le)!r}"}} {float(i * 3)!r}')
            out.append(f'{name}_bucket{{{lbl},le="+Inf"}} 100.0')
            out.append(f"{name}_count{{{lbl}}} 100.0")
            out.append(f"{name}_sum{{{lbl}}} 12.5")
        out.append(f"# HELP {name}_created Histogram {name}.")
        out.append(f"# TYPE {name}_created gauge")
        out.extend(f"{name}_created{{{lbl}}} 1.7e+09" for lbl in engines)
    out.append("# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig")
    out.append("# TYPE vllm:cache_config_info gauge")
    for e in range(state.engines):
        cfg = _labels(block_size=state.block_size, cache_dtype="auto", calculate_kv_scales="False",
                      cpu_offload_gb="0", enable_prefix_caching="True", engine=str(e),
                      gpu_memory_utilization="0.9", hash_block_size=state.block_size,
                      is_attention_free="False", kv_offloading_size="None",
                      num_cpu_blocks="None", num_gpu_blocks=state.num_gpu_blocks,
                      num_gpu_blocks_override="None", prefix_caching_hash_algo="sha256",
                      sliding_window="None", swap_space="4", swap_space_bytes="4294967296")
        out.append(f"vllm:cache_config_info{{{cfg}}} 1.0")
    if state.lora is not None:
        out.append("# HELP vllm:lora_requests_info Running stats on lora requests.")
        out.append("# TYPE vllm:lora_requests_info gauge")
        for running, waiting, max_lora, value in state.lora:
            lbl = _labels(max_lora=max_lora, running_lora_adapters=running, waiting_lora_adapters=waiting)
            out.append(f"vllm:lora_requests_info{{{lbl}}} {value!r}")
    out.extend(state.extra_lines)
    return "\n".join(out) + "\n"
