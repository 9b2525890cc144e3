"""The offered prefill load as a share of the fleet's prefill throughput, from what a user can know."""

from __future__ import annotations

import pytest

from bench.routing.loadgen import RequestRecord
from bench.routing.prefill_load import learned_prefill_s_per_token, prefill_load, prefill_load_lines
from bench.routing.runner import ContenderResult, summarize


def calibration(endpoint: str, term: str, value: float) -> tuple[str, float]:
    return (f'epp_ttft_calibration{{endpoint="{endpoint}",model="m",plugin="predicted-ttft-scorer",'
            f'term="{term}"}}', value)


def run_of(name: str, prompts: list[int], every_s: float, oracle: float, metrics: dict[str, float]) -> ContenderResult:
    """A contender that sent one request of each prompt length every `every_s` seconds."""
    records = [RequestRecord(0, "g", sent=i * every_s, ttft=0.1, e2e=0.2, prompt_tokens=p, cached_tokens=0)
               for i, p in enumerate(prompts)]
    stage = summarize("trace", None, records, len(prompts) * every_s, None, oracle)
    return ContenderResult(name, "", stages=[stage], overall=stage, router_metrics=metrics)


def test_share_is_uncached_tokens_per_second_over_the_learned_throughput():
    metrics = dict([calibration(ep, "prefill_seconds_per_token", v) for ep, v in (("a", 1e-4), ("b", 3e-4),
                                                                                  ("c", 2e-4))]
                   + [calibration("a", "base_seconds", 0.05)])
    peer = run_of("sglang", [1000] * 11, 0.5, 0.25, {})
    ours = run_of("epp-approx-ttft", [1000] * 11, 0.5, 0.25, metrics)
    assert learned_prefill_s_per_token([peer, ours]) == ("epp-approx-ttft", pytest.approx(2e-4))
    # 11 prompts of 1,000 tokens sent over 5 s, a quarter reusable: 1,650 uncached tokens/s against
    # 2 replicas of 5,000 tokens/s each.
    load = prefill_load(peer.overall, replicas=2, s_per_token=2e-4)
    assert load.uncached_tokens_per_s == pytest.approx(1650)
    assert load.fleet_tokens_per_s == pytest.approx(10_000)
    assert load.share == pytest.approx(0.165)
    lines = prefill_load_lines([peer, ours], replicas=2)
    # All 11 sends fall within 10 s: the busiest 10 s carry 11,000 tokens, a quarter reusable.
    assert load.peak_uncached_tokens_per_s == pytest.approx(825)
    assert "| trace | 1,650 | 10,000 | 16% | 8% |" in lines


def test_a_burst_shows_in_the_busiest_window_not_in_the_mean():
    sends = [0.0, 1.0, 2.0, 3.0, 60.0]  # four requests in the first seconds, one a minute later
    records = [RequestRecord(0, "g", sent=t, ttft=0.1, e2e=0.2, prompt_tokens=2000) for t in sends]
    summary = summarize("trace", None, records, 60.0, None, 0.0)
    load = prefill_load(summary, replicas=1, s_per_token=1e-3)  # 1,000 tokens/s
    assert load.share == pytest.approx(10_000 / 60 / 1000)
    assert load.peak_share == pytest.approx(8_000 / 10 / 1000)


def test_without_a_calibrating_contender_the_load_is_not_measured():
    lines = prefill_load_lines([run_of("sglang", [1000] * 3, 1.0, 0.0, {})], replicas=2)
    assert lines[0].startswith("Prefill load: not measured")
