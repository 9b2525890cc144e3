"""`--emit-endpoint-scores`: the scheduler records a pick's scores only when asked, bounded, into the headers reply."""

from __future__ import annotations

import json

from epp.debug.scores import ENDPOINT_SCORES_KEY, MAX_ENDPOINTS, MAX_VALUE_BYTES, endpoint_scores_value
from epp.framework.scheduler import SCORE_TRACE_STATE_KEY, score_trace
from tests.support.configs import endpoint_picker_config, plugin
from tests.support.extproc import ExtProcClient, request_body, request_headers, started
from tests.support.scheduling import DirectorHarness, endpoint, request

QUEUE_AND_KV = endpoint_picker_config(["queue-scorer", "kv-cache-utilization-scorer"],
                                      {"queue-scorer": 2, "kv-cache-utilization-scorer": 1})
# Endpoint 0: empty queue, KV 90 % used; endpoint 1: ten queued, KV free.
POOL = [endpoint(0, queue=0, kv=0.9), endpoint(1, queue=10, kv=0.0)]


async def test_a_scheduler_keeps_no_scores_unless_asked():
    picker = DirectorHarness(QUEUE_AND_KV)
    _, state = await picker.cycle(request(), POOL)
    assert score_trace(state) is None
    assert state.get(SCORE_TRACE_STATE_KEY) is None


async def test_the_totals_are_the_weighted_sums_best_first():
    picker = DirectorHarness(QUEUE_AND_KV)
    picker.loaded.scheduler.record_scores()
    result, state = await picker.cycle(request(), POOL)
    assert result.targets[0].name == "192.168.1.1:8000"
    value = endpoint_scores_value(score_trace(state))
    # queue 2 x 1 + kv 1 x 0.1 against queue 2 x 0 + kv 1 x 1.0
    assert json.loads(value) == {"default": {"192.168.1.1:8000": 2.1, "192.168.1.2:8000": 1.0}}
    assert list(json.loads(value)["default"]) == ["192.168.1.1:8000", "192.168.1.2:8000"]
    assert " " not in value  # compact


async def test_scorers_mode_adds_each_scorers_score_before_its_weight():
    picker = DirectorHarness(QUEUE_AND_KV)
    picker.loaded.scheduler.record_scores(detailed=True)
    _, state = await picker.cycle(request(), POOL)
    assert json.loads(endpoint_scores_value(score_trace(state))) == {"default": {
        "192.168.1.1:8000": {"total": 2.1, "scorers": {"queue-scorer": 1.0, "kv-cache-utilization-scorer": 0.1}},
        "192.168.1.2:8000": {"total": 1.0, "scorers": {"queue-scorer": 0.0, "kv-cache-utilization-scorer": 1.0}},
    }}


async def test_a_filtered_endpoint_is_not_scored():
    config = endpoint_picker_config([plugin("by-label", label="pool", validValues=["blue"]), "queue-scorer"],
                                    ["by-label", "queue-scorer"])
    picker = DirectorHarness(config)
    picker.loaded.scheduler.record_scores()
    _, state = await picker.cycle(request(), [endpoint(0, labels={"pool": "blue"}), endpoint(1)])
    assert json.loads(endpoint_scores_value(score_trace(state))) == {"default": {"192.168.1.1:8000": 1.0}}


async def test_among_equal_scores_the_picked_endpoint_comes_first():
    picker = DirectorHarness(endpoint_picker_config(["random-picker"], ["random-picker"]))
    picker.loaded.scheduler.record_scores()
    for _ in range(10):
        result, state = await picker.cycle(request(), [endpoint(i) for i in range(4)])
        shown = json.loads(endpoint_scores_value(score_trace(state)))["default"]
        assert list(shown)[0] == result.targets[0].name and set(shown.values()) == {0.0}


async def test_at_most_ten_endpoints_and_the_picked_one_always_among_them():
    # A random picker: the picked endpoint is often not among the ten best scored.
    picker = DirectorHarness(endpoint_picker_config(["queue-scorer", "random-picker"], ["queue-scorer", "random-picker"]))
    picker.loaded.scheduler.record_scores()
    pool = [endpoint(i, queue=i) for i in range(30)]
    seen_outside_top = False
    for _ in range(20):
        result, state = await picker.cycle(request(), pool)
        shown = json.loads(endpoint_scores_value(score_trace(state)))["default"]
        picked = result.targets[0].name
        assert len(shown) == MAX_ENDPOINTS
        assert picked in shown
        seen_outside_top |= pool.index(result.targets[0]) >= MAX_ENDPOINTS
        scores = list(shown.values())
        assert scores == sorted(scores, reverse=True)
    assert seen_outside_top  # 20 random picks of 30: at least one beyond the ten best


async def test_the_value_stays_within_its_byte_cap_keeping_the_pick():
    # Ten scorers with long names, detailed: ten endpoints would take ~6 KB. A random picker: the
    # picked endpoint is often not the best scored, and must stay while better ones are left out.
    names = [f"queue-scorer-with-a-rather-long-name-{i}" for i in range(10)]
    config = endpoint_picker_config([*(plugin("queue-scorer", name=n) for n in names), "random-picker"],
                                    {**dict.fromkeys(names, 1), "random-picker": None})
    picker = DirectorHarness(config)
    picker.loaded.scheduler.record_scores(detailed=True)
    pool = [endpoint(i, queue=i) for i in range(12)]
    for _ in range(10):
        result, state = await picker.cycle(request(), pool)
        value = endpoint_scores_value(score_trace(state))
        shown = json.loads(value)["default"]
        assert len(value.encode()) <= MAX_VALUE_BYTES
        assert result.targets[0].name in shown
        assert 1 <= len(shown) < MAX_ENDPOINTS
        totals = [entry["total"] for entry in shown.values()]
        assert totals == sorted(totals, reverse=True)


async def test_the_headers_reply_carries_the_scores_only_when_emitting():
    for emit in (False, True):
        server = await started(emit_endpoint_scores="totals" if emit else None)
        client = ExtProcClient(server.grpc_port)
        try:
            replies = await client.exchange([request_headers(), request_body(b'{"model":"m","prompt":"hi"}')], 2)
        finally:
            await client.close()
            await server.stop(0)
        lb = replies[0].dynamic_metadata.fields["envoy.lb"].struct_value.fields
        assert lb["x-gateway-destination-endpoint"].string_value == "10.0.0.1:8000"
        if emit:
            assert json.loads(lb[ENDPOINT_SCORES_KEY].string_value) == {
                "default": {"10.0.0.1:8000": 0.0, "10.0.0.2:8000": 0.0, "10.0.0.3:8000": 0.0}}
        else:
            assert ENDPOINT_SCORES_KEY not in lb


async def test_names_that_need_quoting_still_make_ascii_json():
    config = endpoint_picker_config([plugin("queue-scorer", name='file d"attente é'), "max-score-picker"],
                                    {'file d"attente é': 1, "max-score-picker": None})
    picker = DirectorHarness(config)
    picker.loaded.scheduler.record_scores(detailed=True)
    _, state = await picker.cycle(request(), POOL)
    value = endpoint_scores_value(score_trace(state))
    assert value.isascii()
    assert json.loads(value)["default"]["192.168.1.1:8000"]["scorers"] == {'file d"attente é': 1.0}
