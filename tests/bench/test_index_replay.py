"""Replaying a run through the approximate prefix index tells forgotten prefixes and load moves apart."""

from __future__ import annotations

import pytest

from bench.routing.index_replay import replay, request_hashes
from bench.routing.workloads import completion_request


def record(req, sent: float, replica: str, cached_share: float, prompt_tokens: int = 1000) -> dict:
    return {"group": req.group, "sent": sent, "replica": replica, "prompt_tokens": prompt_tokens,
            "cached_tokens": int(cached_share * prompt_tokens)}


def sessions():
    a1 = completion_request("a" * 64 * 20, 8, "session-a")
    b1 = completion_request("b" * 64 * 15, 8, "session-b")
    a2 = completion_request("a" * 64 * 20 + "c" * 64 * 2, 8, "session-a")
    return a1, b1, a2


@pytest.mark.parametrize("chain_aware, forgot", [(True, 0), (False, 1)])
def test_a_head_first_index_forgets_a_history_the_replica_still_serves(chain_aware, forgot):
    a1, b1, a2 = sessions()
    capacity = len(request_hashes(a1)) + len(request_hashes(b1)) - 2  # two of a1's blocks must go
    records = [record(a1, 0, "r0", 0.0), record(b1, 1, "r0", 0.0), record(a2, 2, "r0", 0.85)]
    counts = replay(records, iter([a1, b1, a2]), capacity, chain_aware=chain_aware)
    assert counts["requests"] == 3
    assert counts["forgot"] == forgot


def test_a_move_is_told_from_forgetting():
    a1, b1, a2 = sessions()
    records = [record(a1, 0, "r0", 0.0), record(b1, 1, "r1", 0.0), record(a2, 2, "r1", 0.0)]
    counts = replay(records, iter([a1, b1, a2]), capacity=1000)
    assert counts["moved while the index credited the previous replica"] == 1
    assert counts["forgot"] == counts["phantom"] == 0
    counts = replay(records, iter([a1, b1, a2]), capacity=1)
    assert counts["moved after the index forgot the previous replica"] == 1


def test_records_of_another_workload_are_refused():
    a1, b1, _ = sessions()
    with pytest.raises(ValueError, match="disagree"):
        replay([record(a1, 0, "r0", 0.0)], iter([b1]), capacity=10)
