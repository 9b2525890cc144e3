"""How sure a claim "A beats B" is: the ratio of two contenders' statistics with a 95 % interval over runs.

A routing run sends the same seeded requests to every contender, and a claim compares one statistic
of two contenders (TTFT p90, the hit rate) over those requests. Two things make the measured ratio
uncertain, and the interval counts both:

1. **Within a run**, the statistic rests on a sample of requests (a p90 of 45 requests is about
   the 5th-slowest). Resampling the run's requests with replacement (a bootstrap, `RESAMPLES`
   times; the same request indices for both contenders when they were sent the same requests, so
   a hard request weighs on both as it did in the run) gives the spread of the run's log-ratio,
   `v_i`.
2. **Across runs**, the machine, the arrival jitter and the routers' own timing move the whole
   run: the log-ratios `l_i` of the runs scatter by more than `v_i` alone. Their sample variance
   `s²` measures that, but with three runs it is itself noisy and can come out below the
   within-run noise, which every run's estimate carries for sure.

The combined log-ratio is the mean `L` of the runs' `l_i`, with standard error and quantile:

- `sqrt(s² / n)` and Student's t with n - 1 degrees of freedom (4.30 for three runs) when the runs
  scatter at least as much as their requests explain (`s² >= mean v_i`): the run-to-run spread
  dominates and is known only from n runs;
- `sqrt(mean v_i / n)` and the normal 1.96 when they agree more closely than that: the runs'
  agreement is luck, the within-run variance is the floor of every run's error, and it is known
  from thousands of resamples.

The interval is `exp(L ± quantile x SE)`. On synthetic runs whose true ratio is known (exponential
TTFTs, 200 requests a run, run-to-run drift of 0 to 20 %), it covers the true ratio in 92–97 % of
experiments with 3 or 5 runs (`tests/bench/test_confidence.py`). Flooring the variance and keeping
Student's t covered 98–100 % with intervals up to 1.45 times wider: real wins read as ties. A
two-level bootstrap (runs, then requests within each) is the other natural design; with three runs it
has only ten distinct resamples of the runs and shrinks their spread by (n - 1) / n, so its
intervals come out too narrow exactly when runs are few. One run gives the within-run bootstrap's
percentile interval, and is never enough for a claim (`MIN_RUNS`).

A ratio is oriented so that > 1 means A is better: B / A for a lower-is-better statistic (TTFT),
A / B for a higher-is-better one (hit rate). The verdict against a target ratio `r` (1 for
"A beats B", 2 for "2x better", 0.95 for "within 5 %"): `met` when the interval's low end is at
least `r`, `not met` when its high end is below `r`, a **tie** when the interval includes `r`, and
`too few runs` under `MIN_RUNS` runs whatever the interval says.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

MIN_RUNS = 3
RESAMPLES = 2000
LEVEL = 0.95
Z975 = 1.959964
# An unanswered request counts as later than any answered one (`ttft_p90_all`): a finite stand-in
# keeps the interpolated percentile finite and far above every measured TTFT.
UNANSWERED_S = 1e6
# Student's t quantile at 0.975 by degrees of freedom (larger: the normal's 1.96 with a correction).
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
         12: 2.179, 15: 2.131, 20: 2.086, 30: 2.042}


def t975(df: int) -> float:
    """Student's t 0.975 quantile for `df` degrees of freedom (the largest tabulated df at or below it)."""
    if df < 1:
        raise ValueError("a t quantile needs at least one degree of freedom")
    if df > 30:
        return Z975 + (Z975 ** 3 + Z975) / (4 * df)  # Cornish-Fisher: within 0.001 of the true quantile past 30
    return _T975[max(d for d in _T975 if d <= df)]


@dataclass(frozen=True)
class RunSamples:
    """One contender's per-request measurements in one run, in send order (None: not answered / not reported)."""

    ttft: Sequence[float | None]
    prompt: Sequence[int | None] = ()
    cached: Sequence[int | None] = ()

    @classmethod
    def from_json(cls, doc: dict) -> RunSamples:
        """From a results.json `samples` object ({"ttft": [...], "prompt": [...], "cached": [...]})."""
        return cls(doc.get("ttft", []), doc.get("prompt", []), doc.get("cached", []))


@dataclass(frozen=True)
class Metric:
    """A statistic of a set of requests, and whether lower is better."""

    name: str
    lower_is_better: bool
    columns: Callable[[RunSamples], np.ndarray]  # (requests, k) array the statistic reads; NaN rows: no value
    statistic: Callable[[np.ndarray], np.ndarray]  # (resamples, requests, k) -> (resamples,)


def _ttft_answered(s: RunSamples) -> np.ndarray:
    return np.array([math.nan if t is None else t for t in s.ttft], dtype=float).reshape(-1, 1)


def _ttft_all(s: RunSamples) -> np.ndarray:
    return np.array([UNANSWERED_S if t is None else t for t in s.ttft], dtype=float).reshape(-1, 1)


def _usage(s: RunSamples) -> np.ndarray:
    rows = [(c, p) if c is not None and p else (math.nan, math.nan) for c, p in zip(s.cached, s.prompt)]
    return np.array(rows, dtype=float).reshape(-1, 2)


def _p90(x: np.ndarray) -> np.ndarray:
    return np.percentile(x[..., 0], 90, axis=-1)


def _share(x: np.ndarray) -> np.ndarray:
    return x[..., 0].sum(axis=-1) / np.maximum(x[..., 1].sum(axis=-1), 1e-12)


METRICS = {
    # TTFT p90 over the answered requests (the summary's `ttft_p90`).
    "ttft_p90": Metric("TTFT p90", True, _ttft_answered, _p90),
    # TTFT p90 over every request sent, an unanswered one infinitely late (goodput's `ttft_p90_all`).
    "ttft_p90_all": Metric("TTFT p90 (unanswered = late)", True, _ttft_all, _p90),
    # Cached prompt tokens over prompt tokens, from the responses' usage (what the replicas served from cache).
    "hit": Metric("prompt tokens served from cache", False, _usage, _share),
}


@dataclass(frozen=True)
class Comparison:
    """A against B on one metric over runs: how many times better A is, with its 95 % interval."""

    a: str
    b: str
    metric: str
    runs: int
    ratio: float  # > 1: A better
    low: float
    high: float
    per_run: tuple[float, ...] = ()

    def verdict(self, target: float = 1.0) -> str:
        """'met', 'not met', 'tie' (the interval includes `target`) or 'too few runs'."""
        if self.runs < MIN_RUNS:
            return "too few runs"
        if self.low >= target:
            return "met"
        if self.high < target:
            return "not met"
        return "tie"

    def describe(self) -> str:
        """'1.52x [1.31x–1.77x], 3 runs' (95 % interval)."""
        if not math.isfinite(self.ratio):
            return f"no ratio ({self.runs} runs)"
        return f"{self.ratio:.2f}x [{self.low:.2f}x–{self.high:.2f}x], {self.runs} run{'s' * (self.runs != 1)}"


def _run_log_ratio(x: np.ndarray, y: np.ndarray, paired: bool, rng: np.random.Generator, resamples: int,
            metric: Metric) -> tuple[float, np.ndarray]:
    """(the run's log-ratio, its bootstrap replicates), A better when > 0."""
    sx, sy = float(metric.statistic(x[None])[0]), float(metric.statistic(y[None])[0])
    if paired:
        idx = rng.integers(0, len(x), size=(resamples, len(x)))
        bx, by = metric.statistic(x[idx]), metric.statistic(y[idx])
    else:
        bx = metric.statistic(x[rng.integers(0, len(x), size=(resamples, len(x)))])
        by = metric.statistic(y[rng.integers(0, len(y), size=(resamples, len(y)))])
    with np.errstate(divide="ignore", invalid="ignore"):
        if metric.lower_is_better:
            point, boot = math.log(sy / sx) if sx > 0 and sy > 0 else math.nan, np.log(by / bx)
        else:
            point, boot = math.log(sx / sy) if sx > 0 and sy > 0 else math.nan, np.log(bx / by)
    return point, boot[np.isfinite(boot)]


def compare(a_runs: Sequence[RunSamples], b_runs: Sequence[RunSamples], metric: str | Metric = "ttft_p90", *,
            a: str = "A", b: str = "B", seed: int = 42, resamples: int = RESAMPLES) -> Comparison:
    """A against B over paired runs (run i of A beside run i of B): the ratio and its 95 % interval.

    `metric`: a name of `METRICS` or a `Metric` of the caller's own (its name goes into the comparison)."""
    if len(a_runs) != len(b_runs):
        raise ValueError(f"{a} has {len(a_runs)} runs and {b} {len(b_runs)}: runs are compared pairwise")
    m = metric if isinstance(metric, Metric) else METRICS[metric]
    metric = metric.name if isinstance(metric, Metric) else metric
    rng = np.random.default_rng(seed)
    logs: list[float] = []
    variances: list[float] = []
    per_run_intervals: list[tuple[float, float]] = []
    for sa, sb in zip(a_runs, b_runs):
        x, y = m.columns(sa), m.columns(sb)
        # The same requests for both when the run sent both the same ones in the same order (the harness
        # does): keep the requests with a value for both and resample them together.
        paired = len(x) == len(y)
        if paired:
            keep = ~(np.isnan(x).any(axis=1) | np.isnan(y).any(axis=1))
            x, y = x[keep], y[keep]
        else:
            x, y = x[~np.isnan(x).any(axis=1)], y[~np.isnan(y).any(axis=1)]
        if not len(x) or not len(y):
            continue
        point, boot = _run_log_ratio(x, y, paired, rng, resamples, m)
        if not math.isfinite(point) or len(boot) < 2:
            continue
        logs.append(point)
        variances.append(float(np.var(boot, ddof=1)))
        per_run_intervals.append((float(np.percentile(boot, 2.5)), float(np.percentile(boot, 97.5))))
    n = len(logs)
    if n == 0:
        return Comparison(a, b, metric, 0, math.nan, math.nan, math.nan)
    mean = statistics.fmean(logs)
    if n == 1:
        low, high = per_run_intervals[0]
    else:
        spread, within = statistics.variance(logs), statistics.fmean(variances)
        # Runs that scatter more than their requests explain: Student's t on that scatter. Runs that agree
        # more closely than their own requests allow: the within-run variance, known from thousands of
        # resamples, with the normal quantile.
        se, q = (math.sqrt(spread / n), t975(n - 1)) if spread >= within else (math.sqrt(within / n), Z975)
        low, high = mean - q * se, mean + q * se
    return Comparison(a, b, metric, n, math.exp(mean), math.exp(low), math.exp(high),
                      tuple(math.exp(v) for v in logs))


__all__ = ["LEVEL", "METRICS", "MIN_RUNS", "RESAMPLES", "Z975", "Comparison", "Metric", "RunSamples", "compare", "t975"]
