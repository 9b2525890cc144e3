"""What a session replay measured, per program: completion time, slowdown, fairness; and the samples the
confidence intervals resample.

- **Program** (a root session and every sub-agent it spawned): its **completion time** (makespan) runs
  from its root's start to the end of the last answer of any of its sessions; a program with a failed
  or cancelled turn is incomplete (it counts as infinitely late in the p90 of the intervals).
- **Slowdown**: the completion time over the program's ideal time: every turn served at once with its
  context cached (only the tokens that are new since the session's previous turn prefilled, and an
  agent kind's shared prefix cached too), output at one decode step a token on an idle replica, plus
  the pauses as replayed, sub-agents on the critical path where the parent waits for them
  (`TurnCost` from the replicas' latency profile). **Jain's index** of the slowdowns,
  (sum x)^2 / (n sum x^2), is 1 when every program is slowed alike and falls towards 1/n as a few
  take the delay.
- **Samples** for bench/routing/confidence.py, in plan order (the same order for every contender, so
  comparisons are paired): program completion times (None: incomplete), turn TTFTs, prompt and
  cached tokens.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from bench.agentic.replay import PauseScale, ReplayResult
from bench.agentic.workload import SessionPlan, TurnPlan
from bench.routing.confidence import UNANSWERED_S, Metric, RunSamples
from bench.routing.measure import percentile
from epp.engine.sim.profiles import LatencyProfile


@dataclass(frozen=True)
class TurnCost:
    """Wall seconds a turn takes alone on an idle replica (the ideal a program's slowdown is measured against)."""

    prefill_s_per_token: float
    prefill_step_s: float  # a prefill step's fixed part
    decode_step_s: float  # one decode step of one sequence
    chunk_tokens: int  # tokens prefilled per step (max_num_batched_tokens)

    @classmethod
    def from_profile(cls, p: LatencyProfile, time_scale: float, chunk_tokens: int | None = None) -> TurnCost:
        """A simulated (or calibrated) replica's costs, slowed by `time_scale`."""
        return cls(p.prefill_per_token * time_scale,
                   (p.step_overhead + p.forward_base + p.prefill_overhead) * time_scale,
                   (p.step_overhead + p.forward_base + p.decode_per_seq) * time_scale,
                   chunk_tokens or p.max_num_batched_tokens)

    def turn_s(self, new_tokens: int, output_tokens: int) -> float:
        """Prefilling `new_tokens` (in chunks) and decoding `output_tokens` (the first comes with the prefill)."""
        chunks = max(1, math.ceil(new_tokens / self.chunk_tokens))
        return chunks * self.prefill_step_s + new_tokens * self.prefill_s_per_token + \
            max(0, output_tokens - 1) * self.decode_step_s


def new_tokens(prev: TurnPlan | None, turn: TurnPlan) -> int:
    """Tokens of `turn` not in `prev`'s prompt (its first turn: all but an agent kind's shared prefix)."""
    if prev is None:
        return sum(s.tokens for s in turn.segments if s.role != "prefix")
    common = 0
    for a, b in zip(prev.segments, turn.segments):
        if a != b:
            break
        common += a.tokens
    return turn.prompt_tokens - common


def ideal_seconds(plans: Sequence[SessionPlan], pauses: PauseScale, cost: TurnCost) -> dict[int, float]:
    """Each program's ideal completion time (wall seconds), by root index."""

    def session(i: int) -> tuple[float, float]:
        """(the session's own duration, the extent of everything it started) from its start."""
        plan = plans[i]
        t, extent, prev = 0.0, 0.0, None
        for turn in plan.turns:
            t += cost.turn_s(new_tokens(prev, turn), turn.output_tokens)
            prev = turn
            joined = t
            for c in turn.spawns:
                child = plans[c]
                start = t + pauses.wall(child.delay_kind, child.start_delay_s)
                own, ext = session(c)
                extent = max(extent, start + ext)
                if turn.join:
                    joined = max(joined, start + own)
            t = joined + pauses.wall(turn.pause_kind, turn.pause_s)
        return t, max(t, extent)

    return {p.index: session(p.index)[1] for p in plans if p.root}


def jain(values: Sequence[float]) -> float | None:
    """Jain's fairness index of positive values (1: all equal)."""
    if not values:
        return None
    total = sum(values)
    squares = sum(v * v for v in values)
    return total * total / (len(values) * squares) if squares else None


@dataclass
class SessionMetrics:
    """The program-level numbers of one contender's replay."""

    programs: int
    complete: int
    sessions: int
    sessions_complete: int
    completion_p50: float | None
    completion_p90: float | None
    completion_p99: float | None
    completion_mean: float | None
    slowdown_p50: float | None
    slowdown_p90: float | None
    jain_slowdown: float | None
    programs_per_min: float
    compactions: int
    turns_moved: int  # turns served by another replica than their session's previous turn
    later_turns: int


def program_completion(result: ReplayResult) -> dict[int, float | None]:
    """Each program's completion time (wall seconds), None when any of its turns failed, by root index."""
    out: dict[int, float | None] = {}
    for root, sessions in result.roots().items():
        start = sessions[0].started
        if start is None or not all(s.complete and s.finished is not None for s in sessions):
            out[root] = None
            continue
        out[root] = max(s.finished for s in sessions if s.finished is not None) - start
    return out


def session_metrics(result: ReplayResult, plans: Sequence[SessionPlan], ideal: dict[int, float]) -> SessionMetrics:
    """Completion times, slowdowns and their fairness over the programs of `result`."""
    done = {k: v for k, v in program_completion(result).items() if v is not None}
    times = sorted(done.values())
    slowdowns = [v / ideal[k] for k, v in done.items() if ideal.get(k)]
    moved = later = 0
    for s in result.sessions:
        replicas = [t.record.replica for t in s.turns if t.record.ok]
        for a, b in zip(replicas, replicas[1:]):
            if a and b:
                later += 1
                moved += a != b
    span = max(result.finished - result.started, 1e-9)
    return SessionMetrics(
        programs=len(program_completion(result)), complete=len(done), sessions=len(result.sessions),
        sessions_complete=sum(s.complete for s in result.sessions), completion_p50=percentile(times, 50),
        completion_p90=percentile(times, 90), completion_p99=percentile(times, 99),
        completion_mean=statistics.fmean(times) if times else None, slowdown_p50=percentile(slowdowns, 50),
        slowdown_p90=percentile(slowdowns, 90), jain_slowdown=jain(slowdowns), programs_per_min=len(done) / span * 60,
        compactions=sum(t.compaction for p in plans for t in p.turns), turns_moved=moved, later_turns=later)


def samples(result: ReplayResult) -> dict[str, list[Any]]:
    """Per program (completion, None: incomplete) and per turn (TTFT, prompt, cached tokens), in plan order."""
    completion = program_completion(result)
    turns = [t.record for s in result.sessions for t in s.turns]
    return {"completion": [None if v is None else round(v, 4) for _, v in sorted(completion.items())],
            "ttft": [round(r.ttft, 4) if r.ok and r.ttft is not None else None for r in turns],
            "prompt": [r.prompt_tokens if r.ok else None for r in turns],
            "cached": [r.cached_tokens if r.ok else None for r in turns]}


def _column(values: Sequence[float | None], missing: float) -> np.ndarray:
    return np.array([missing if v is None else v for v in values], dtype=float).reshape(-1, 1)


def _pct(q: float) -> Callable[[np.ndarray], np.ndarray]:
    def statistic(x: np.ndarray) -> np.ndarray:
        return np.asarray(np.percentile(x[..., 0], q, axis=-1))

    return statistic


def _completion(s: RunSamples) -> np.ndarray:
    return _column(s.ttft, UNANSWERED_S)  # completion times ride in RunSamples' first column (see `run_samples`)


def _ttft(s: RunSamples) -> np.ndarray:
    return _column(s.ttft, math.nan)


# The statistics the agentic claims compare (lower is better); an incomplete program is infinitely late.
CLAIM_METRICS = {
    "completion_p50": Metric("program completion p50", True, _completion, _pct(50)),
    "completion_p90": Metric("program completion p90", True, _completion, _pct(90)),
    "completion_p99": Metric("program completion p99", True, _completion, _pct(99)),
    "ttft_p90": Metric("turn TTFT p90", True, _ttft, _pct(90)),
    "ttft_p99": Metric("turn TTFT p99", True, _ttft, _pct(99)),
}


def run_samples(doc: dict[str, list[Any]], metric: str) -> RunSamples:
    """The samples of one run as the confidence module reads them: the metric's column first."""
    column = doc["completion"] if metric.startswith("completion") else doc["ttft"]
    return RunSamples(column, doc.get("prompt", []), doc.get("cached", []))


__all__ = ["CLAIM_METRICS", "SessionMetrics", "TurnCost", "ideal_seconds", "jain", "new_tokens", "program_completion",
           "run_samples", "samples", "session_metrics"]
