"""Goodput of a routing run: objectives sent per group, good requests, moved turns, the floor's gap closed."""

from __future__ import annotations

import math

import pytest

from bench.routing.goodput import Objectives, goodput, is_good, moved_turns
from bench.routing.loadgen import RequestRecord
from bench.routing.report import floor_p90, floors
from bench.routing.runner import ContenderResult


def record(group: str = "g", sent: float = 0.0, ttft: float | None = 0.5, e2e: float | None = 1.5, tokens: int = 11,
           replica: str | None = "r1", error: str | None = None, status: int | None = 200, ttft_ms: float = 1000,
           tpot_ms: float | None = None, sensitive: bool = False) -> RequestRecord:
    return RequestRecord(stage=0, group=group, sent=sent, ttft=ttft, e2e=e2e, output_tokens=tokens, replica=replica,
                         error=error, status=status, slo_ttft_ms=ttft_ms, slo_tpot_ms=tpot_ms, sensitive=sensitive)


@pytest.mark.parametrize("case, rec, good", [
    ("within its TTFT objective", record(ttft=0.9), True),
    ("late", record(ttft=1.1), False),
    ("rejected by the router", record(ttft=None, e2e=None, error="HTTP 429", status=429), False),
    ("timed out", record(error="timeout"), False),
    ("TPOT met: (1.5 - 0.5) / 10 = 100 ms", record(tpot_ms=100), True),
    ("TPOT missed", record(tpot_ms=90), False),
    ("one token: no TPOT to check", record(tokens=1, tpot_ms=1), True),
])
def test_what_counts_as_good(case, rec, good):
    assert is_good(rec) is good


def test_objectives_mark_the_same_groups_for_every_contender():
    objectives = Objectives(ttft_ms=2000, sensitive_share=0.25, sensitive_ttft_ms=500, sensitive_tpot_ms=50)
    groups = [f"conv-{i}" for i in range(400)]
    marked = [g for g in groups if objectives.sensitive(g)]
    assert 0.18 < len(marked) / len(groups) < 0.32
    assert marked == [g for g in groups if Objectives(2000, 0.25, 500, 50).sensitive(g)]
    assert objectives.headers(marked[0]) == {"x-llm-d-slo-ttft-ms": "500", "x-llm-d-slo-tpot-ms": "50"}
    plain = next(g for g in groups if g not in marked)
    assert objectives.headers(plain) == {"x-llm-d-slo-ttft-ms": "2000"}
    with pytest.raises(ValueError):
        Objectives(ttft_ms=0)


def test_later_turns_moved_follow_each_group_in_send_order():
    records = [record("a", 0, replica="r1"), record("a", 2, replica="r2"), record("a", 1, replica="r1"),
               record("b", 0, replica="r3"), record("b", 5, replica="r3"), record("c", 0, replica=None),
               record("c", 1, replica="r1")]
    assert moved_turns(records) == (3, 1)  # a: r1 -> r1 -> r2 (one move); b: stays; c: replica unknown


def test_goodput_counts_every_request_sent_and_the_tokens_of_the_good_ones():
    records = [record(ttft=0.2), record(ttft=3.0), record(ttft=None, e2e=None, error="HTTP 503", status=503),
               record(ttft=0.4, sensitive=True, ttft_ms=500), record(ttft=0.6, sensitive=True, ttft_ms=500)]
    g = goodput(records, seconds=10.0)
    assert (g.requests, g.good, g.rejected) == (5, 2, 1)
    assert g.good_tokens_per_s == pytest.approx(2.2)
    assert (g.sensitive, g.sensitive_good) == (2, 1)
    assert g.sensitive_ttft_p90 == pytest.approx(0.58)
    assert math.isinf(g.ttft_p90_all)  # one of five unanswered sits above the 90th percentile


def test_the_floor_comes_from_the_costs_learned_in_the_run():
    calibrating = ContenderResult("epp-x", "", router_metrics={
        'epp_ttft_calibration{endpoint="a",model="m",plugin="p",term="prefill_seconds_per_token"}': 1e-3,
        'epp_ttft_calibration{endpoint="a",model="m",plugin="p",term="base_seconds"}': 0.05},
        floor_requests=[(0.0, 100, 0, 0), (0.0, 100, 0, 0), (10.0, 300, 200, 0)])
    source, prefill, base, plain, queued = floor_p90([calibrating], replicas=1)
    assert (source, prefill, base) == ("epp-x", 1e-3, 0.05)
    assert plain == pytest.approx(0.15)  # every request prefills 100 uncached tokens
    # On one replica the second waits for the first: TTFTs 0.15, 0.25, 0.15 s; p90 by interpolation 0.23 s.
    assert queued == pytest.approx(0.23)
    assert floor_p90([ContenderResult("rr", "")], replicas=1) is None
    # With finite capacity the third lost its 200 shared tokens: TTFTs 0.15, 0.15, 0.35 s; p90 0.31 s, and that
    # request is the tail: a long prompt whose shared prefix the caches lost.
    full = floors([calibrating], replicas=1)
    assert full is not None and full["p90_capacity"] == pytest.approx(0.31)
    assert full["tail_capacity"] == {"requests": 1.0, "cold": 0.0, "long": 1.0, "evicted": 1.0}
    assert full["tail_queued"]["requests"] == 1.0 and full["tail_queued"]["queued"] == 0.0
