"""The subscriber CPU benchmark reads every message its publisher process sends."""

from __future__ import annotations

from bench import kv_subscriber_cpu


def test_every_published_message_is_received_and_costed():
    result = kv_subscriber_cpu._measure(None, 300, 3000.0, 2)
    assert result["received"] == 300
    assert 0 < result["messages"] <= 300 and result["us_per_message"] > 0
