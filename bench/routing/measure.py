"""What the harness reads besides the requests: replica counters, process CPU, and statistics.

- Replica counters (`/metrics`): `vllm:prefix_cache_queries_total` / `hits_total` (the cache
  hit rate of a stage is the delta of hits over the delta of queries), `request_success_total`
  (requests each replica finished: the load spread when the router hides `x-sim-replica`).
- Simulator health (`/sim/state`): `lag_resyncs` counts the times a replica's clock fell behind
  the wall clock, i.e. the machine, not the simulated GPU, was the bottleneck.
- Process CPU from `/proc/<pid>/stat` (Linux), to show the load generator, the router and the
  simulator are not saturating the machine.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass

import aiohttp

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? ([0-9.eE+-]+|NaN|[+-]Inf)$", re.MULTILINE)
_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def counter_sum(text: str, name: str) -> float:
    """Sum of every sample of counter `name` (any labels) in a Prometheus text page."""
    total = 0.0
    for match in _SAMPLE.finditer(text):
        if match.group(1) == name:
            total += float(match.group(3))
    return total


@dataclass(frozen=True, slots=True)
class ReplicaCounters:
    """The counters of one replica at one instant."""

    name: str
    queries: float
    hits: float
    finished: float
    generation_tokens: float
    lag_resyncs: int


async def scrape_replica(session: aiohttp.ClientSession, name: str, endpoint: str) -> ReplicaCounters:
    """Read one replica's prefix-cache, request and lag counters."""
    async with session.get(f"http://{endpoint}/metrics") as resp:
        text = await resp.text()
    lag = 0
    try:
        async with session.get(f"http://{endpoint}/sim/state") as resp:
            if resp.status == 200:
                lag = int((await resp.json()).get("lag_resyncs", 0))
    except aiohttp.ClientError:
        pass
    return ReplicaCounters(
        name=name,
        queries=counter_sum(text, "vllm:prefix_cache_queries_total"),
        hits=counter_sum(text, "vllm:prefix_cache_hits_total"),
        finished=counter_sum(text, "vllm:request_success_total"),
        generation_tokens=counter_sum(text, "vllm:generation_tokens_total"),
        lag_resyncs=lag,
    )


async def scrape_fleet(session: aiohttp.ClientSession, info: list[dict]) -> dict[str, ReplicaCounters]:
    """Counters of every replica, keyed by replica name."""
    out = {}
    for d in info:
        c = await scrape_replica(session, d["name"], d["endpoint"])
        out[c.name] = c
    return out


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process and its reaped children (0 when it is gone)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
            fields = fh.read().rpartition(")")[2].split()
    except OSError:
        return 0.0
    # Fields after the command: state is [0]; utime [11], stime [12], cutime [13], cstime [14].
    return sum(int(fields[i]) for i in (11, 12, 13, 14)) / _CLK_TCK


class CpuMeter:
    """CPU used by named groups of processes between two `sample()` calls, as cores busy."""

    def __init__(self, groups: dict[str, list[int]]) -> None:
        self.groups = groups
        self._last = self._read()

    def _read(self) -> tuple[float, dict[str, float]]:
        own = time.process_time()
        values = {name: sum(process_cpu_seconds(p) for p in pids) for name, pids in self.groups.items()}
        values["loadgen"] = own
        return time.perf_counter(), values

    def sample(self) -> dict[str, float]:
        """Cores each group kept busy since the previous sample (1.0 = one core all the time)."""
        t0, before = self._last
        t1, after = self._read()
        self._last = (t1, after)
        span = max(t1 - t0, 1e-9)
        return {name: (after[name] - before.get(name, 0.0)) / span for name in after}


_LE = re.compile(r'le="([^"]+)"')


@dataclass(frozen=True, slots=True)
class Histogram:
    """One Prometheus histogram summed over its label sets: cumulative bucket counts by upper bound, sum, count."""

    buckets: tuple[tuple[float, float], ...]
    total: float
    count: float

    def minus(self, before: Histogram) -> Histogram:
        """The observations made since `before`."""
        earlier = dict(before.buckets)
        return Histogram(tuple((le, n - earlier.get(le, 0.0)) for le, n in self.buckets),
                         self.total - before.total, self.count - before.count)

    @property
    def mean(self) -> float | None:
        return self.total / self.count if self.count > 0 else None

    def quantile(self, q: float) -> float | None:
        """The q-th quantile (0..1), interpolated linearly within its bucket as Prometheus does."""
        if self.count <= 0 or not self.buckets:
            return None
        rank = q * self.count
        lower_le, lower_n = 0.0, 0.0
        for le, n in self.buckets:
            if n >= rank:
                if le == float("inf"):
                    return lower_le
                span = n - lower_n
                return lower_le + (le - lower_le) * ((rank - lower_n) / span if span > 0 else 1.0)
            lower_le, lower_n = le, n
        return lower_le


def histogram(text: str, name: str) -> Histogram:
    """Histogram `name` of a Prometheus text page, summed over every label set (empty when absent)."""
    buckets: dict[float, float] = {}
    total = count = 0.0
    for match in _SAMPLE.finditer(text):
        series, labels, value = match.group(1), match.group(2) or "", float(match.group(3))
        if series == name + "_bucket":
            le = _LE.search(labels)
            if le:
                bound = float(le.group(1))
                buckets[bound] = buckets.get(bound, 0.0) + value
        elif series == name + "_sum":
            total += value
        elif series == name + "_count":
            count += value
    return Histogram(tuple(sorted(buckets.items())), total, count)


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100) by linear interpolation; None for no values."""
    if not values:
        return None
    s = sorted(values)
    if len(s) == 1:
        return s[0]
    pos = (len(s) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


__all__ = ["CpuMeter", "Histogram", "ReplicaCounters", "counter_sum", "histogram", "percentile", "process_cpu_seconds",
           "scrape_fleet", "scrape_replica"]
