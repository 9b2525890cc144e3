"""The ratio of two contenders with its 95 % interval, on synthetic runs whose answer is known."""

from __future__ import annotations

import numpy as np
import pytest

from bench.routing.confidence import MIN_RUNS, RunSamples, compare, t975


def runs(scale: float, rng: np.random.Generator, *, runs: int = 3, requests: int = 400,
         drift: float = 0.0) -> list[RunSamples]:
    """`runs` runs of exponential TTFTs with mean `scale`, each run moved by a lognormal drift."""
    return [RunSamples(list(rng.exponential(scale, requests) * np.exp(rng.normal(0.0, drift))))
            for _ in range(runs)]


def test_a_twice_as_fast_contender_wins_and_its_interval_holds_two():
    rng = np.random.default_rng(3)
    c = compare(runs(1.0, rng), runs(2.0, rng), a="fast", b="slow")
    assert c.runs == 3 and c.low < 2.0 < c.high
    assert c.low > 1.0 and c.verdict() == "met"
    assert c.verdict(target=2.0) == "tie"  # "2x better" is not shown: the interval straddles 2
    assert c.describe().endswith("3 runs")


def test_equal_contenders_tie_and_a_slower_one_loses():
    rng = np.random.default_rng(4)
    same = compare(runs(1.0, rng), runs(1.0, rng))
    assert same.low < 1.0 < same.high and same.verdict() == "tie"
    slower = compare(runs(2.0, rng), runs(1.0, rng))
    assert slower.high < 1.0 and slower.verdict() == "not met"


def test_fewer_than_three_runs_is_never_a_claim_however_clear():
    rng = np.random.default_rng(5)
    c = compare(runs(1.0, rng, runs=2), runs(3.0, rng, runs=2))
    assert c.low > 2.0 and c.runs == 2 < MIN_RUNS
    assert c.verdict() == "too few runs"


def test_paired_requests_cancel_their_own_difficulty():
    # B took exactly 1.5x as long as A on every request: resampling the same requests for both gives 1.5 every time.
    rng = np.random.default_rng(6)
    a = runs(1.0, rng)
    b = [RunSamples([1.5 * t for t in r.ttft]) for r in a]
    c = compare(a, b)
    assert c.ratio == pytest.approx(1.5) and c.low == pytest.approx(1.5) and c.high == pytest.approx(1.5)


def test_the_interval_widens_with_the_spread_across_runs():
    rng = np.random.default_rng(7)
    steady = compare(runs(1.0, rng), runs(1.3, rng))
    drifting = compare(runs(1.0, rng, drift=0.3), runs(1.3, rng, drift=0.3))
    assert drifting.high / drifting.low > steady.high / steady.low


def test_the_interval_covers_the_true_ratio_about_95_percent_of_the_time():
    rng = np.random.default_rng(8)
    trials, covered = 120, 0
    for seed in range(trials):
        c = compare(runs(1.0, rng, requests=200, drift=0.05), runs(1.3, rng, requests=200, drift=0.05),
                    seed=seed, resamples=400)
        covered += c.low <= 1.3 <= c.high
    assert 0.88 <= covered / trials <= 1.0


def test_hit_rate_is_higher_is_better_and_unanswered_requests_count_late():
    more = RunSamples([0.1] * 10, prompt=[100] * 10, cached=[80] * 10)
    fewer = RunSamples([0.1] * 10, prompt=[100] * 10, cached=[40] * 10)
    c = compare([more] * 3, [fewer] * 3, "hit")
    assert c.ratio == pytest.approx(2.0) and c.verdict() == "met"
    # One unanswered request in ten: the p90 over every request sent is past every answer.
    answered = RunSamples([0.1] * 10)
    dropped = RunSamples([0.1] * 9 + [None])
    assert compare([answered] * 3, [dropped] * 3, "ttft_p90_all").low > 100
    assert compare([answered] * 3, [dropped] * 3, "ttft_p90").ratio == pytest.approx(1.0)


def test_runs_are_compared_pairwise_and_t_has_its_table():
    with pytest.raises(ValueError, match="pairwise"):
        compare([RunSamples([1.0])] * 3, [RunSamples([1.0])] * 2)
    assert t975(2) == pytest.approx(4.303) and t975(11) == pytest.approx(2.228) and 1.96 < t975(100) < 2.0
    with pytest.raises(ValueError):
        t975(0)
