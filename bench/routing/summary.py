"""What a routing run measured: per stage and per contender (the numbers the report, the standing and
the real-vLLM tables read), and `summarize`, which computes them from the request records.
"""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass, field

from bench.routing.goodput import Goodput, goodput, share_within
from bench.routing.loadgen import RequestRecord
from bench.routing.measure import ReplicaCounters, percentile


@dataclass
class StageSummary:
    """The numbers of one stage (or of the whole run) for one contender."""

    label: str
    offered_rate: float | None
    requests: int
    ok: int
    errors: int
    seconds: float
    output_tokens_per_s: float
    requests_per_s: float
    ttft_mean: float | None
    ttft_p50: float | None
    ttft_p90: float | None
    ttft_p99: float | None
    itl_p50: float | None
    itl_p99: float | None
    e2e_p50: float | None
    hit_rate: float | None
    oracle_hit_rate: float | None
    per_replica: dict[str, int]
    cpu: dict[str, float] = field(default_factory=dict)
    lag_resyncs: int = 0
    error_kinds: dict[str, int] = field(default_factory=dict)
    prompt_tokens: int = 0  # usage.prompt_tokens summed over the successful requests
    sent_span_s: float = 0.0  # first to last request sent (the window the load was offered in)
    peak_prompt_tokens_per_s: float = 0.0  # prompt tokens sent in the busiest 10-s window, per second
    goodput: Goodput | None = None  # within the run's latency objectives (bench/routing/goodput.py)
    # Share of all requests answered within each TTFT (seconds): the goodput curve.
    within: dict[float, float | None] = field(default_factory=dict)

    @property
    def spread(self) -> float | None:
        """Busiest replica's share over the mean share (1.0 = perfectly even)."""
        counts = list(self.per_replica.values())
        if not counts or not sum(counts):
            return None
        return max(counts) / (sum(counts) / len(counts))


@dataclass
class ContenderResult:
    """One contender's run: status, version and per-stage summaries plus the whole run."""

    name: str
    description: str
    status: str = "ok"
    version: str = ""
    stages: list[StageSummary] = field(default_factory=list)
    overall: StageSummary | None = None
    router_metrics: dict[str, float] = field(default_factory=dict)
    flags: str = ""  # how the router was started (ports elided) and the fleet options it needed
    verdict: str = ""  # validity from the router's own counters: valid | invalid | unverified
    validity: str = ""  # what those counters said
    # Per request sent, in send order: (seconds after the first send, prompt tokens, tokens any router could
    # have served from cache): the workload's TTFT floor (bench/routing/ttft_floor.py) at learned costs.
    floor_requests: list[tuple[float, int, int]] = field(default_factory=list)
    # Per request sent, in send order: TTFT (None: not answered), prompt and cached tokens (usage): what the
    # confidence intervals of bench/routing/confidence.py resample.
    samples: dict[str, list] = field(default_factory=dict)


def summarize(label: str, rate: float | None, records: list[RequestRecord], seconds: float,
              counters: tuple[dict[str, ReplicaCounters], dict[str, ReplicaCounters]] | None,
              oracle_rate: float | None, cpu: dict[str, float] | None = None) -> StageSummary:
    """Statistics of a set of request records and the replica counter deltas around them."""
    ok = [r for r in records if r.ok]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    itl = [g for r in ok for g in r.itl]
    e2e = [r.e2e for r in ok if r.e2e is not None]
    out_tokens = sum(r.output_tokens for r in ok)
    hit_rate = None
    per_replica: dict[str, int] = {}
    lag = 0
    if counters is not None:
        before, after = counters
        dq = sum(after[n].queries - before[n].queries for n in after)
        dh = sum(after[n].hits - before[n].hits for n in after)
        hit_rate = dh / dq if dq else None
        per_replica = {n: int(after[n].finished - before[n].finished) for n in sorted(after)}
        lag = sum(after[n].lag_resyncs - before[n].lag_resyncs for n in after)
    tagged = Counter(r.replica for r in ok if r.replica)
    if ok and sum(tagged.values()) >= 0.9 * len(ok) and not per_replica:
        per_replica = dict(sorted(tagged.items()))
    seconds = max(seconds, 1e-9)
    return StageSummary(
        label=label, offered_rate=rate, requests=len(records), ok=len(ok), errors=len(records) - len(ok),
        seconds=seconds, output_tokens_per_s=out_tokens / seconds, requests_per_s=len(ok) / seconds,
        ttft_mean=statistics.fmean(ttft) if ttft else None, ttft_p50=percentile(ttft, 50),
        ttft_p90=percentile(ttft, 90), ttft_p99=percentile(ttft, 99), itl_p50=percentile(itl, 50),
        itl_p99=percentile(itl, 99), e2e_p50=percentile(e2e, 50), hit_rate=hit_rate,
        oracle_hit_rate=oracle_rate, per_replica=per_replica, cpu=cpu or {}, lag_resyncs=lag,
        error_kinds=dict(Counter(r.error for r in records if r.error)),
        prompt_tokens=sum(r.prompt_tokens or 0 for r in ok),
        sent_span_s=(max(r.sent for r in records) - min(r.sent for r in records)) if records else 0.0,
        peak_prompt_tokens_per_s=_busiest_window_tokens(ok, PEAK_WINDOW_S) / PEAK_WINDOW_S,
        goodput=goodput(records, seconds), within={t: share_within(records, t) for t in GOODPUT_CURVE_S})


PEAK_WINDOW_S = 10.0
GOODPUT_CURVE_S = (0.5, 1.0, 2.0, 4.0)


def _busiest_window_tokens(records: list[RequestRecord], window_s: float) -> int:
    """The most prompt tokens sent within any `window_s` seconds (a trace's load is not steady)."""
    sent = sorted((r.sent, r.prompt_tokens or 0) for r in records)
    best = total = start = 0
    for t, tokens in sent:
        total += tokens
        while sent[start][0] <= t - window_s:
            total -= sent[start][1]
            start += 1
        best = max(best, total)
    return best


def request_samples(records: list[RequestRecord]) -> dict[str, list]:
    """The per-request columns a run keeps for its confidence intervals (TTFT to 0.1 ms)."""
    return {"ttft": [round(r.ttft, 4) if r.ok and r.ttft is not None else None for r in records],
            "prompt": [r.prompt_tokens if r.ok else None for r in records],
            "cached": [r.cached_tokens if r.ok else None for r in records]}


__all__ = ["GOODPUT_CURVE_S", "PEAK_WINDOW_S", "ContenderResult", "StageSummary", "request_samples", "summarize"]
