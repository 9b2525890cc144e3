"""The TTFT floor: each request prefills at least what no earlier request shared with it."""

from __future__ import annotations

import pytest

from bench.routing.oracle import prompt_token_ids
from bench.routing.ttft_floor import (
    capacity_reusable,
    capacity_ttft_floor,
    queued_ttft_floor,
    reusable_tokens,
    ttft_floor,
)
from bench.routing.workloads import completion_request


def test_only_a_prefix_shared_with_an_earlier_request_can_be_cached():
    history = " ".join(f"word{i}" for i in range(200))
    first = completion_request(history, 4, "a")
    second = completion_request(history + " more words of the next turn", 4, "a")
    other = completion_request("something else entirely " * 20, 4, "b")
    (n1, hit1), (n2, hit2), (n3, hit3) = reusable_tokens([first, second, other], block_size=16)
    assert hit1 == 0 and hit3 == 0  # nothing earlier shares their first block
    assert n1 == len(prompt_token_ids(first))
    assert 0 < n1 - hit2 < 16 + 1  # the whole history but its partial last block
    assert hit2 % 16 == 0 and hit2 <= n2 - 1
    floor = ttft_floor([first, second, other], prefill_s_per_token=1e-3, base_s=0.01, block_size=16)
    assert floor[0] == pytest.approx(0.01 + 1e-3 * n1)
    assert floor[1] == pytest.approx(0.01 + 1e-3 * (n2 - hit2))


def test_with_queueing_a_burst_waits_for_the_replica_that_frees_first():
    burst = [completion_request(f"prompt {i} " + "filler " * 100, 4, f"g{i}", at=0.0) for i in range(3)]
    later = completion_request("a late one " + "filler " * 100, 4, "late", at=100.0)
    n = [len(prompt_token_ids(r)) for r in burst]
    queued = queued_ttft_floor([*burst, later], replicas=2, prefill_s_per_token=1e-3, base_s=0.0)
    assert queued[0] == pytest.approx(1e-3 * n[0]) and queued[1] == pytest.approx(1e-3 * n[1])
    # the third starts when the first replica frees up: it waits a whole prefill
    assert queued[2] > 1e-3 * n[0]
    assert queued[3] < queued[2]  # nothing ahead of a request long after the burst


def test_with_finite_capacity_a_prefix_the_caches_cannot_keep_is_prefilled_again():
    # Three groups' prefixes asked in turn twice. One replica holding one prefix at a time: Belady keeps the one asked
    # again soonest, the others are prefilled again. Room for all three: each second ask finds its whole prefix.
    prefixes = [" ".join(f"g{g}w{i}" for i in range(20)) for g in range(3)]
    requests = [completion_request(prefixes[g] + f" question {k}", 4, f"g{g}") for k in range(2) for g in range(3)]
    unbounded = reusable_tokens(requests, block_size=16)
    blocks = max(h for _, h in unbounded) // 16
    assert blocks >= 2 and all(h > 0 for _, h in unbounded[3:])
    tight = capacity_reusable(requests, replicas=1, blocks_per_replica=blocks + 2, block_size=16)
    assert sum(h for _, h in tight[3:]) < sum(h for _, h in unbounded[3:])  # not every second ask finds its prefix
    assert all(h <= (blocks + 1) * 16 for _, h in tight)  # never more than one replica's blocks
    assert capacity_reusable(requests, replicas=2, blocks_per_replica=10 * blocks, block_size=16) == unbounded
    floor = capacity_ttft_floor(requests, 1, blocks + 2, prefill_s_per_token=1e-3, base_s=0.0, block_size=16)
    assert floor == pytest.approx([1e-3 * (n - h) for n, h in tight])
