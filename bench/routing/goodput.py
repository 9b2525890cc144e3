"""Latency objectives of a routing run and what each contender delivered within them (goodput).

Every request of a run carries a TTFT objective (`x-llm-d-slo-ttft-ms`, default
`DEFAULT_TTFT_OBJECTIVE_MS`); a seeded share of the sharing groups (a trace's conversations, a
multi-turn workload's sessions) is marked latency-sensitive and carries a tighter TTFT objective,
and optionally a TPOT objective (`x-llm-d-slo-tpot-ms`). Routers that ignore the headers are
measured against the same objectives.

A request is **good** when it was answered (200, streamed to the end), its TTFT met its
objective and, when it has a TPOT objective and at least two output tokens, its time per output
token after the first ((e2e - TTFT) / (tokens - 1)) met that. Goodput: the share of all requests
sent that were good (a rejection, a timeout or a late answer all count against it) and the
output tokens per second of the good ones. Latency-sensitive requests get their own TTFT p90
(over the answered ones) and share.

Later turns moved: requests of a group sent after its first whose replica differs from that of
the group's previous request (from `x-sim-replica`), the stickiness measure of the trace runs.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from bench.routing.loadgen import RequestRecord
from bench.routing.measure import percentile
from bench.routing.objectives import DEFAULT_TTFT_OBJECTIVE_MS, Objectives  # re-exported: the run's objectives


@dataclass(frozen=True)
class Goodput:
    """What one contender delivered within the objectives."""

    requests: int
    good: int
    good_tokens_per_s: float
    rejected: int  # answered 429 or 503 (shed, over capacity, timed out in a queue)
    sensitive: int
    sensitive_good: int
    sensitive_ttft_p90: float | None  # over the answered ones
    ttft_p90_all: float  # over every request sent, an unanswered one counting as infinitely late
    tpot_checked: int  # requests with a TPOT objective and >= 2 output tokens
    tpot_good: int
    later_turns: int
    moved_turns: int

    @property
    def share(self) -> float | None:
        return self.good / self.requests if self.requests else None

    @property
    def sensitive_share(self) -> float | None:
        return self.sensitive_good / self.sensitive if self.sensitive else None


def tpot_of(record: RequestRecord) -> float | None:
    """Seconds per output token after the first, or None (fewer than 2 tokens, not answered)."""
    if record.ttft is None or record.e2e is None or record.output_tokens < 2:
        return None
    return (record.e2e - record.ttft) / (record.output_tokens - 1)


def is_good(record: RequestRecord) -> bool:
    """Answered, within its TTFT objective and, where it has one and streamed >= 2 tokens, its TPOT objective."""
    if not record.ok or record.ttft is None:
        return False
    if record.slo_ttft_ms is not None and record.ttft * 1e3 > record.slo_ttft_ms:
        return False
    tpot = tpot_of(record)
    return record.slo_tpot_ms is None or tpot is None or tpot * 1e3 <= record.slo_tpot_ms


def moved_turns(records: Sequence[RequestRecord]) -> tuple[int, int]:
    """(later turns, later turns sent to another replica than their group's previous request)."""
    by_group: dict[str, list[tuple[float, str | None]]] = defaultdict(list)
    for r in records:
        by_group[r.group].append((r.sent, r.replica))
    later = moved = 0
    for turns in by_group.values():
        turns.sort(key=lambda t: t[0])
        for (_, before), (_, after) in zip(turns, turns[1:]):
            if before is None or after is None:
                continue
            later += 1
            moved += before != after
    return later, moved


def goodput(records: Sequence[RequestRecord], seconds: float) -> Goodput:
    """The goodput of a set of request records over `seconds` of busy time."""
    good = [r for r in records if is_good(r)]
    sensitive = [r for r in records if r.sensitive]
    with_tpot = [(r, tpot) for r in records if r.slo_tpot_ms is not None and (tpot := tpot_of(r)) is not None]
    later, moved = moved_turns(records)
    return Goodput(
        requests=len(records), good=len(good),
        good_tokens_per_s=sum(r.output_tokens for r in good) / max(seconds, 1e-9),
        rejected=sum(r.status in (429, 503) for r in records),
        sensitive=len(sensitive), sensitive_good=sum(is_good(r) for r in sensitive),
        sensitive_ttft_p90=percentile([r.ttft for r in sensitive if r.ok and r.ttft is not None], 90),
        ttft_p90_all=percentile([r.ttft if r.ok and r.ttft is not None else math.inf for r in records], 90) or math.inf,
        tpot_checked=len(with_tpot),
        tpot_good=sum(r.slo_tpot_ms is not None and tpot * 1e3 <= r.slo_tpot_ms for r, tpot in with_tpot),
        later_turns=later, moved_turns=moved)


def share_within(records: Sequence[RequestRecord], objective_s: float) -> float | None:
    """Share of all requests answered with a TTFT within `objective_s` (one point of a goodput curve)."""
    if not records:
        return None
    return sum(r.ok and r.ttft is not None and r.ttft <= objective_s for r in records) / len(records)


__all__ = ["DEFAULT_TTFT_OBJECTIVE_MS", "Goodput", "Objectives", "goodput", "is_good", "moved_turns", "share_within",
           "tpot_of"]
