"""The per-pick trace: picks joined to the load generator's records, and the anatomy of the decisions."""

from __future__ import annotations

import dataclasses

from bench.routing.pick_trace import analyse, block_tokens, join
from bench.routing.scenarios import get_scenario

NAMES = {"10.0.0.1:1": "sim-0", "10.0.0.2:1": "sim-1"}


def candidate(uncached: int, ttft: float, free: int | None = None, prefill: float = 3e-4, base: float = 0.04) -> dict:
    return {"uncached": uncached, "ttft_s": ttft, "total_s": ttft, "prefill_s_per_token": prefill, "base_s": base,
            "queue_s": 0.0, "waiting_s": 0.0, "running_s": 0.0, "free_blocks": free, "displacement_s": 0.0}


def pick(at: float, picked: str, candidates: dict, cached: int, tokens: int = 576) -> dict:
    return {"scored_at": at, "picked": picked, "tokens": tokens, "candidates": candidates, "cached_tokens": cached,
            "prompt_tokens": tokens, "ttft_s": 0.1}


def record(sent: float, replica: str, group: str, stage: int = 1, ttft: float = 0.1) -> dict:
    return {"sent": sent, "replica": replica, "group": group, "stage": stage, "ttft": ttft}


def test_picks_join_records_in_send_order_checked_by_replica():
    picks = [pick(5.0, "10.0.0.1:1", {}, 0), pick(5.001, "10.0.0.2:1", {}, 0), pick(6.0, "10.0.0.1:1", {}, 0)]
    # The second and first requests were sent within a pick's time and swapped: the replica decides.
    records = [record(100.0, "sim-1", "a"), record(100.0005, "sim-0", "b"), record(101.0, "sim-0", "c"),
               record(102.0, None, "d")]  # unanswered: no pick to join
    joined = join(picks, records, NAMES)
    assert [(j["record"]["group"], NAMES[j["pick"]["picked"]]) for j in joined] == [
        ("a", "sim-1"), ("b", "sim-0"), ("c", "sim-0")]


def test_a_cold_pick_into_the_fuller_replica_and_a_stale_one_are_counted():
    cold_into_full = pick(1.0, "10.0.0.1:1", {"10.0.0.1:1": candidate(578, 0.205, free=2, prefill=3.1e-4),
                                               "10.0.0.2:1": candidate(578, 0.210, free=40)}, cached=0)
    warm_but_evicted = pick(2.0, "10.0.0.2:1", {"10.0.0.1:1": candidate(578, 0.21, free=2),
                                                 "10.0.0.2:1": candidate(64, 0.06, free=40)}, cached=0)
    joined = join([cold_into_full, warm_but_evicted], [record(1.0, "sim-0", "g0"), record(2.0, "sim-1", "g1")], NAMES)
    a = analyse(joined, NAMES, block=32)
    assert a["cold_picks"] == 1 and a["cold_into_fuller"] == 1
    assert abs(a["cold_margin_ms_median"] - 5.0) < 1e-6  # 0.210 - 0.205 s
    assert abs(a["cold_prefill_us_per_token_gap_median"] - 10.0) < 1e-6
    assert a["stale_picks"] == 1  # the index said 512 tokens on sim-1, the response said 0
    assert a["placed"] == {"sim-0": 1, "sim-1": 1} and a["groups"] == {"g0": {"sim-0": 1}, "g1": {"sim-1": 1}}


def test_a_benchmark_scenarios_blocks_are_its_replicas_profile_unless_the_fleet_sets_them():
    bursty = get_scenario("bursty", "small")
    assert block_tokens(bursty) == 16  # the h100-llama3-8b profile's
    assert block_tokens(dataclasses.replace(bursty, fleet=dataclasses.replace(bursty.fleet, block_size=64))) == 64
