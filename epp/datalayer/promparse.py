"""Extract the few vLLM series the picker needs from a Prometheus text-format `/metrics` page.

A real vLLM page is tens to hundreds of kilobytes, mostly histogram buckets we never read.
Rather than tokenising every line, one compiled regex finds the wanted metric names at line
starts in a single C-level pass and only those lines are parsed; everything else, garbage
included, is never looked at in Python.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass

WAITING = b"vllm:num_requests_waiting"
RUNNING = b"vllm:num_requests_running"
KV_USAGE = b"vllm:kv_cache_usage_perc"
LORA_INFO = b"vllm:lora_requests_info"
CACHE_CONFIG = b"vllm:cache_config_info"
PREFIX_QUERIES = b"vllm:prefix_cache_queries_total"
PREFIX_HITS = b"vllm:prefix_cache_hits_total"
SLEEP_STATE = b"vllm:engine_sleep_state"

WANTED = (WAITING, RUNNING, KV_USAGE, LORA_INFO, CACHE_CONFIG, PREFIX_QUERIES, PREFIX_HITS, SLEEP_STATE)
# One C-level pass over the page: a wanted name at a line start, followed by `{` or a blank
# (so `vllm:num_requests_waiting_by_reason` is not taken), then the rest of the line.
_NAMES = b"|".join(re.escape(name) for name in WANTED)
_WANTED_LINE = re.compile(rb"\n(" + _NAMES + rb")([{ \t][^\n]*)")
_WANTED_FIRST_LINE = re.compile(rb"(" + _NAMES + rb")([{ \t][^\n]*)")
# After the metric name: optional `{labels}` (greedy up to the last `}`, so `}` inside a quoted
# label value is fine), a value, an optional integer millisecond timestamp, nothing else.
_SAMPLE_TAIL = re.compile(rb"(?:\{(.*)\})?[ \t]+(\S+)(?:[ \t]+(-?\d+))?[ \t]*\r?\Z")
_LABEL = re.compile(rb'(?:^|,)[ \t]*([a-zA-Z_][a-zA-Z0-9_]*)[ \t]*=[ \t]*"((?:[^"\\]|\\.)*)"')
_ESCAPE = re.compile(rb"\\(.)")
_UNESCAPED = {b"n": b"\n", b"\\": b"\\", b'"': b'"'}


@dataclass(frozen=True, slots=True)
class Sample:
    """One series line: its raw label block (unparsed until needed), value and timestamp (ms)."""

    raw_labels: bytes
    value: float
    timestamp_ms: int | None

    def labels(self) -> dict[str, str]:
        """The label set, unescaped."""
        return parse_labels(self.raw_labels)


@dataclass(frozen=True, slots=True)
class VllmMetrics:
    """The vLLM values found on one page; `None` where the series was absent or unusable."""

    waiting: float | None = None
    running: float | None = None
    kv_usage: float | None = None
    running_adapters: frozenset[str] | None = None
    waiting_adapters: frozenset[str] | None = None
    max_lora: int | None = None
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    num_cpu_blocks: int | None = None
    prefix_cache_queries: float | None = None
    prefix_cache_hits: float | None = None
    sleeping: bool | None = None  # from vllm:engine_sleep_state{sleep_state="awake"}; None: not exported

    @property
    def found_any(self) -> bool:
        """Whether the page carried at least one vLLM series we know."""
        return any(getattr(self, f) is not None for f in self.__slots__)


def parse_labels(raw: bytes) -> dict[str, str]:
    """Parse `a="x",b="y\\"z"` into a dict (unescaped); malformed pairs are skipped."""
    labels: dict[str, str] = {}
    for key, value in _LABEL.findall(raw):  # one C-level scan instead of a match per pair
        if b"\\" in value:
            value = _ESCAPE.sub(lambda m: _UNESCAPED.get(m.group(1), b"\\" + m.group(1)), value)
        labels[key.decode("ascii")] = value.decode("utf-8", "replace")
    return labels


def collect_samples(page: bytes) -> dict[bytes, list[Sample]]:
    """Every well-formed sample of the wanted metrics, by exact metric name, in page order."""
    found: dict[bytes, list[Sample]] = {}
    matches = list(_WANTED_LINE.finditer(page))
    if page.startswith(b"vllm:"):
        first = _WANTED_FIRST_LINE.match(page)
        if first is not None:
            matches.insert(0, first)
    for line in matches:
        tail = _SAMPLE_TAIL.match(line.group(2))
        if tail is None:
            continue
        value = _parse_value(tail.group(2))
        if value is None:
            continue
        ts = tail.group(3)
        found.setdefault(line.group(1), []).append(
            Sample(tail.group(1) or b"", value, int(ts) if ts is not None else None))
    return found


def _parse_value(text: bytes) -> float | None:
    try:
        return float(text)  # accepts NaN, +Inf, -Inf, 1e3
    except ValueError:
        return None


def choose_sample(samples: Iterable[Sample]) -> Sample | None:
    """GIE's series choice: the largest timestamp wins; without timestamps, the first one.

    Series with a NaN or infinite value carry no usable reading and are skipped.
    """
    best: Sample | None = None
    best_ts = -math.inf
    for sample in samples:
        if not math.isfinite(sample.value):
            continue
        ts = sample.timestamp_ms if sample.timestamp_ms is not None else -math.inf
        if best is None or ts > best_ts:
            best, best_ts = sample, ts
    return best


def choose_lora_sample(samples: Iterable[Sample]) -> Sample | None:
    """GIE's LoRA choice: the series with the largest value (a creation timestamp); first on ties."""
    best: Sample | None = None
    for sample in samples:
        if math.isfinite(sample.value) and (best is None or sample.value > best.value):
            best = sample
    return best


def _adapters(text: str | None) -> frozenset[str]:
    if not text:
        return frozenset()
    return frozenset(name for name in (part.strip() for part in text.split(",")) if name)


def _int_label(labels: dict[str, str], key: str) -> int | None:
    text = labels.get(key)
    if text is None:
        return None
    try:
        number = float(text)  # vLLM writes str(value): "16", "None", occasionally "16.0"
    except ValueError:
        return None
    return int(number) if math.isfinite(number) and number >= 0 else None


def _gauge(found: dict[bytes, list[Sample]], name: bytes) -> float | None:
    sample = choose_sample(found.get(name, ()))
    return None if sample is None else max(0.0, sample.value)


# Label blocks repeat from scrape to scrape (cache_config_info never changes, LoRA lists
# rarely), so their decoded fields are memoised by the raw bytes; LRU-bounded, stats via
# `cache_info()`.
LABEL_CACHE_SIZE = 1024


@functools.lru_cache(maxsize=LABEL_CACHE_SIZE)
def lora_fields(raw_labels: bytes) -> tuple[frozenset[str], frozenset[str], int | None]:
    """(running adapters, waiting adapters, max_lora) from a `lora_requests_info` label block."""
    labels = parse_labels(raw_labels)
    return (_adapters(labels.get("running_lora_adapters")),
            _adapters(labels.get("waiting_lora_adapters")), _int_label(labels, "max_lora"))


@functools.lru_cache(maxsize=LABEL_CACHE_SIZE)
def cache_config_fields(raw_labels: bytes) -> tuple[int | None, int | None, int | None]:
    """(block_size, num_gpu_blocks, num_cpu_blocks) from a `cache_config_info` label block."""
    labels = parse_labels(raw_labels)
    return _int_label(labels, "block_size"), _int_label(labels, "num_gpu_blocks"), _int_label(labels, "num_cpu_blocks")


def _sleeping(samples: Iterable[Sample]) -> bool | None:
    """Asleep when the `awake` series of `vllm:engine_sleep_state` reads 0; None without that series."""
    awake = choose_sample(s for s in samples if b'"awake"' in s.raw_labels
                          and s.labels().get("sleep_state") == "awake")
    return None if awake is None else awake.value < 0.5


def parse_vllm_metrics(page: bytes | str) -> VllmMetrics:
    """Read the series the picker uses from one `/metrics` page; never raises on bad input."""
    if isinstance(page, str):
        page = page.encode("utf-8", "replace")
    found = collect_samples(page)
    running_adapters = waiting_adapters = None
    max_lora = None
    lora = choose_lora_sample(found.get(LORA_INFO, ()))
    if lora is not None:
        running_adapters, waiting_adapters, max_lora = lora_fields(lora.raw_labels)
    block_size = num_gpu_blocks = num_cpu_blocks = None
    cache_config = choose_sample(found.get(CACHE_CONFIG, ()))
    if cache_config is not None:
        block_size, num_gpu_blocks, num_cpu_blocks = cache_config_fields(cache_config.raw_labels)
    return VllmMetrics(
        waiting=_gauge(found, WAITING),
        running=_gauge(found, RUNNING),
        kv_usage=_gauge(found, KV_USAGE),
        running_adapters=running_adapters,
        waiting_adapters=waiting_adapters,
        max_lora=max_lora,
        block_size=block_size,
        num_gpu_blocks=num_gpu_blocks,
        num_cpu_blocks=num_cpu_blocks,
        prefix_cache_queries=_gauge(found, PREFIX_QUERIES),
        prefix_cache_hits=_gauge(found, PREFIX_HITS),
        sleeping=_sleeping(found.get(SLEEP_STATE, ())),
    )
