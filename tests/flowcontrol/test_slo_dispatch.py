"""SLO-aware dispatch in the flow controller: order by prediction, shed what cannot meet its objective,
bound the waits, and bind the endpoint only when a request leaves the queue."""

from __future__ import annotations

import asyncio
import time

import pytest
import yaml

from epp.config.compose import endpoint_picker_config, plugin
from epp.flowcontrol.backlog import PrefillBacklogDetector
from epp.flowcontrol.config import parse_flow_control
from epp.flowcontrol.controller import FlowController, PredictedLatency
from epp.flowcontrol.ordering import SLODeadlineOrderingPolicy
from epp.framework.errors import InferenceError
from epp.framework.load import InflightLedger
from epp.framework.types import Endpoint, EndpointMetrics, InferenceRequest
from epp.scorers.saturation import UtilizationDetector
from tests.flowcontrol.test_controller import Pool, place
from tests.support.scheduling import DirectorHarness


def slo_controller(pool: Pool, policy: SLODeadlineOrderingPolicy, section: str = "{}") -> FlowController:
    """A controller whose default band orders with `policy`; one waiting request saturates an endpoint."""
    raw = yaml.safe_load(section) or {}
    raw.setdefault("defaultPriorityBand", {})["orderingPolicyRef"] = "slo"
    config = parse_flow_control(raw, plugins={"slo": policy})
    return FlowController(config, UtilizationDetector(queue_depth_threshold=1, metrics_staleness_threshold=60),
                          pool, InflightLedger())


def request(rid: str, ttft_ms: float | None = None, priority: int = 0) -> InferenceRequest:
    return InferenceRequest(rid, "completions", "m", "m", {"prompt": "hi"}, priority=priority,
                            slo_ttft_ms=ttft_ms)


async def test_queued_requests_leave_shortest_predicted_prefill_first():
    pool = Pool(1)  # saturated: everything queues
    fc = slo_controller(pool, SLODeadlineOrderingPolicy())
    waits = {rid: asyncio.ensure_future(fc.admit(request(rid), 1, PredictedLatency(service)))
             for rid, service in (("long", 0.4), ("short", 0.02), ("mid", 0.1))}
    await asyncio.sleep(0)
    order = []
    for _ in range(3):
        pool.scrape(0, 0)  # room for one
        fc.on_metrics_update()
        await asyncio.sleep(0.01)
        [rid] = [r for r, t in waits.items() if t.done() and r not in order]
        order.append(rid)
        place(fc, waits[rid].result(), "10.0.0.1:8000")
        pool.scrape(0, 1)
    assert order == ["short", "mid", "long"]


async def test_a_request_predicted_to_miss_its_objective_in_a_saturated_pool_is_answered_429_at_once():
    fc = slo_controller(Pool(1), SLODeadlineOrderingPolicy())
    with pytest.raises(InferenceError) as shed:
        await fc.admit(request("late", ttft_ms=500), 1, PredictedLatency(0.1, ttft_s=0.8))
    assert shed.value.code.http_status == 429
    assert "rejected-saturated" in shed.value.message and "800 ms" in shed.value.message
    assert "500 ms" in shed.value.message
    assert fc.queued_requests == 0
    assert fc.metrics.shed.labels("0", "admission")._value.get() == 1


@pytest.mark.parametrize("case, pool_waiting, ttft_ms, shed_param, predicted_ttft", [
    ("room now: dispatched, whatever the prediction", 0, 500, True, 5.0),
    ("no objective: never shed", 1, None, True, 5.0),
    ("within the objective: queued", 1, 500, True, 0.3),
    ("shedding off: queued", 1, 500, False, 5.0),
    ("no prediction: queued", 1, 500, True, None),
])
async def test_what_is_not_shed_at_admission(case, pool_waiting, ttft_ms, shed_param, predicted_ttft):
    fc = slo_controller(Pool(pool_waiting), SLODeadlineOrderingPolicy(shed=shed_param))
    task = asyncio.ensure_future(fc.admit(request("r", ttft_ms=ttft_ms), 1, PredictedLatency(0.01, predicted_ttft)))
    await asyncio.sleep(0.01)
    if pool_waiting == 0:
        assert task.done() and task.exception() is None
        place(fc, task.result(), "10.0.0.1:8000")
    else:
        assert not task.done() and fc.queued_requests == 1
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_a_queued_request_whose_latest_start_passes_is_answered_503_with_the_reason():
    fc = slo_controller(Pool(1), SLODeadlineOrderingPolicy())
    patient = asyncio.ensure_future(fc.admit(request("patient"), 1, PredictedLatency(0.05)))
    with pytest.raises(InferenceError) as shed:
        # Objective 150 ms, prefill 100 ms: once it has waited 50 ms it can no longer make it.
        await asyncio.wait_for(fc.admit(request("hurried", ttft_ms=150), 1, PredictedLatency(0.1, 0.12)), 5)
    assert shed.value.code.http_status == 503
    assert "rejected-ttl-expired" in shed.value.message and "150 ms" in shed.value.message
    assert fc.queued_requests == 1 and not patient.done()  # the one without an objective keeps waiting
    assert fc.metrics.shed.labels("0", "queue")._value.get() == 1
    patient.cancel()
    await asyncio.gather(patient, return_exceptions=True)


async def test_the_bands_objective_applies_to_requests_without_the_header():
    policy = SLODeadlineOrderingPolicy(ttft_objective_s=0.5)
    fc = slo_controller(Pool(1), policy)
    assert fc.ttft_objective_s(request("plain")) == 0.5
    assert fc.ttft_objective_s(request("own", ttft_ms=2000)) == 2.0
    with pytest.raises(InferenceError) as shed:
        await fc.admit(request("plain"), 1, PredictedLatency(0.1, ttft_s=0.9))
    assert shed.value.code.http_status == 429


async def test_every_wait_ends_by_the_ttl_and_the_longest_wait_is_exported():
    fc = slo_controller(Pool(1), SLODeadlineOrderingPolicy(), "{defaultRequestTTL: 100ms}")
    started = time.monotonic()
    with pytest.raises(InferenceError) as expired:
        await asyncio.wait_for(fc.admit(request("r"), 1, PredictedLatency(30.0)), 5)
    assert expired.value.code.http_status == 503
    waited = fc.metrics.longest_wait._value.get()
    assert 0.09 <= waited <= time.monotonic() - started


async def test_predictions_are_asked_for_only_when_the_request_would_queue_under_the_slo_policy():
    pool = Pool(0)
    fc = slo_controller(pool, SLODeadlineOrderingPolicy())
    assert not fc.wants_prediction(request("r"))  # room: it leaves at once, its order does not matter
    pool.scrape(0, 1)
    assert fc.wants_prediction(request("r"))
    fifo = FlowController(parse_flow_control({}), UtilizationDetector(queue_depth_threshold=1,
                          metrics_staleness_threshold=60), pool, InflightLedger())
    assert not fifo.wants_prediction(request("r"))  # FCFS reads no prediction


# -- prefill-backlog-detector ------------------------------------------------------------------

def endpoint(i: int, waiting: int = 0, healthy: bool = True) -> Endpoint:
    return Endpoint(f"10.0.0.{i}", 8000, healthy=healthy,
                    metrics=EndpointMetrics(waiting_queue_size=waiting, update_time=time.monotonic() - 1))


@pytest.mark.parametrize("case, booked_tokens, waiting, healthy, expected", [
    ("idle pool", (0, 0), (0, 0), (True, True), 0.0),
    ("one replica has room: the pool has room", (5000, 0), (0, 0), (True, True), 0.0),
    ("both busy: the least busy decides", (5000, 1000), (0, 0), (True, True), 1000 * 2e-4 / 0.1),
    ("a scraped waiting request counts the mean request's prefill", (0, 0), (2, 3), (True, True),
     2 * 512 * 2e-4 / 0.1),
    ("own requests show in the scrape too: the larger of the two", (2000, 2000), (1, 1), (True, True),
     2000 * 2e-4 / 0.1),
    ("an unhealthy replica offers no room", (0, 1000), (0, 0), (False, True), 1000 * 2e-4 / 0.1),
    ("no healthy replica: saturated", (0, 0), (0, 0), (False, False), 1.0),
])
def test_prefill_backlog_saturation(case, booked_tokens, waiting, healthy, expected):
    ledger = InflightLedger()
    detector = PrefillBacklogDetector(max_backlog_s=0.1, ledger=ledger)
    endpoints = [endpoint(i + 1, w, h) for i, (w, h) in enumerate(zip(waiting, healthy))]
    now = time.monotonic()
    for ep, tokens in zip(endpoints, booked_tokens):
        if tokens:
            ledger.pick(ep.name, prompt_tokens=tokens, now=now)
    assert detector.saturation(endpoints) == pytest.approx(expected, rel=0.05)


# -- late binding through the real director --------------------------------------------------------

LATE_BINDING_CONFIG = endpoint_picker_config(
    ["queue-scorer", plugin("prefill-backlog-detector", maxBacklog="50ms"), plugin("slo-deadline-ordering-policy")],
    {"queue-scorer": 1}, featureGates=["flowControl"], saturationDetector={"pluginRef": "prefill-backlog-detector"},
    flowControl={"defaultRequestTTL": "10s", "defaultPriorityBand": {"orderingPolicyRef": "slo-deadline-ordering-policy"}})


async def test_the_endpoint_is_chosen_when_the_request_leaves_the_queue_with_the_view_of_then():
    harness = DirectorHarness(LATE_BINDING_CONFIG)
    a, b = endpoint(1, waiting=1), endpoint(2, waiting=3)
    harness.set_pool([a, b])  # both hold queued work: the pool is saturated, and `a` looks better now
    req = request("r")
    pick = asyncio.ensure_future(harness.pick(req))
    await asyncio.sleep(0.01)
    assert not pick.done() and harness.loaded.flow_controller.queued_requests == 1
    # While it waits, `a` gets busier and `b` drains: the scrape shows it and wakes the queue.
    harness.endpoints.update(a.name, metrics=EndpointMetrics(waiting_queue_size=6, update_time=time.monotonic()))
    harness.endpoints.update(b.name, metrics=EndpointMetrics(waiting_queue_size=0, update_time=time.monotonic()))
    result, state = await asyncio.wait_for(pick, 5)
    assert result.targets[0].name == b.name
    harness.answer(state, req, result)
