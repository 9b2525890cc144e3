"""The sustained-QPS benchmark's workload: valid chat bodies, multi-turn, around the size asked for."""

from __future__ import annotations

import json

import pytest

from bench.sustained_qps import CONVERSATIONS, Conversations, pct


@pytest.mark.parametrize("size", [2048, 50 * 1024])
def test_each_request_is_the_next_turn_of_a_conversation_around_the_size(size):
    conversations = Conversations(size, seed=1)
    first = [json.loads(conversations.body()) for _ in range(CONVERSATIONS)]
    second = [json.loads(conversations.body()) for _ in range(CONVERSATIONS)]
    for before, after in zip(first, second):
        assert before["model"] == after["model"] == "sim-model"
        if len(after["messages"]) > len(before["messages"]):  # not started again
            assert after["messages"][:len(before["messages"])] == before["messages"]
            assert after["messages"][-1]["role"] == "user"
    for _ in range(20 * CONVERSATIONS):
        body = conversations.body()
        assert size * 0.8 <= len(body) <= size * 1.5 + 2 * conversations.turn + 200


def test_percentiles_of_nothing_are_not_numbers():
    assert pct([], 0.5) != pct([], 0.5)
    assert pct([3.0, 1.0, 2.0], 0.5) == 2.0
