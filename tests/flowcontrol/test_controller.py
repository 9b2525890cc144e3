"""The flow controller on its own: admission, head-of-line blocking, metrics lag, cancellation."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest
import yaml

from epp.flowcontrol.config import parse_flow_control
from epp.flowcontrol.controller import Dispatch, FlowController
from epp.flowcontrol.usage import StaticUsageLimitPolicy
from epp.framework.errors import DropReason, InferenceError
from epp.framework.load import Booking, InflightLedger
from epp.framework.types import Endpoint, EndpointMetrics, InferenceRequest
from epp.scorers.saturation import UtilizationDetector


class Pool:
    """Endpoints whose metrics a test sets, as scraping would."""

    def __init__(self, *waiting: int) -> None:
        self.endpoints = [Endpoint(f"10.0.0.{i + 1}", 8000, metrics=EndpointMetrics(
            waiting_queue_size=q, update_time=time.monotonic())) for i, q in enumerate(waiting)]

    def snapshot(self):
        return tuple(self.endpoints)

    def scrape(self, index: int, waiting: int) -> None:
        ep = self.endpoints[index]
        self.endpoints[index] = dataclasses.replace(ep, metrics=EndpointMetrics(
            waiting_queue_size=waiting, update_time=time.monotonic() + 1.0))  # well after any dispatch


def controller(pool: Pool, section: str = "{}", threshold: float = 1) -> FlowController:
    config = parse_flow_control(yaml.safe_load(section))
    return FlowController(config, UtilizationDetector(queue_depth_threshold=threshold,
                                                      metrics_staleness_threshold=60), pool, InflightLedger())


def place(fc: FlowController, dispatch: Dispatch, endpoint: str) -> Booking:
    """What the director does with a request let through: book the pick, then report it placed."""
    booking = fc.ledger.pick(endpoint, prompt_tokens=10)
    dispatch.placed(endpoint)
    return booking


def request(rid: str, priority: int = 0, tenant: str = "default-flow", **headers: str) -> InferenceRequest:
    return InferenceRequest(rid, "completions", "m", "m", {"prompt": "hi"}, headers=headers,
                            priority=priority, fairness_id=tenant)


async def test_room_now_means_no_wait():
    fc = controller(Pool(0, 0))
    dispatch = fc.admit(request("a"), 10)
    granted = await asyncio.wait_for(dispatch, 0.1)
    place(fc, granted, "10.0.0.1:8000")
    assert fc.queued_requests == 0


async def test_dispatches_the_metrics_do_not_show_yet_count_as_waiting():
    # Threshold 1 and two idle endpoints: exactly two requests fit until the next scrape.
    pool = Pool(0, 0)
    fc = controller(pool)
    tasks = [asyncio.ensure_future(fc.admit(request(f"r{i}"), 1)) for i in range(4)]
    await asyncio.sleep(0.01)
    done = [t for t in tasks if t.done()]
    assert len(done) == 2 and fc.queued_requests == 2
    place(fc, done[0].result(), "10.0.0.1:8000")
    place(fc, done[1].result(), "10.0.0.2:8000")
    pool.scrape(0, 0)  # the first replica finished its request
    fc.on_metrics_update()
    await asyncio.sleep(0.01)
    assert sum(t.done() for t in tasks) == 3
    for t in tasks:
        t.cancel()


async def test_a_dispatch_whose_response_the_picker_never_sees_counts_until_a_scrape_shows_it():
    # Envoy may keep responses from the picker: the stream then ends with the request phase while
    # the replica still works on it. Two idle endpoints, threshold 1: two fit.
    pool = Pool(0, 0)
    fc = controller(pool)
    tasks = [asyncio.ensure_future(fc.admit(request(f"r{i}"), 1)) for i in range(3)]
    await asyncio.sleep(0.01)
    done = [t for t in tasks if t.done()]
    assert len(done) == 2
    for dispatch, endpoint in zip(done, ("10.0.0.1:8000", "10.0.0.2:8000"), strict=True):
        fc.ledger.complete(place(fc, dispatch.result(), endpoint), response_seen=False)
        fc.on_request_complete()
    await asyncio.sleep(0.01)
    assert sum(t.done() for t in tasks) == 2  # no scrape since: both replicas still count as busy
    pool.scrape(1, 0)
    fc.on_metrics_update()
    await asyncio.sleep(0.01)
    assert all(t.done() for t in tasks)
    place(fc, tasks[2].result(), "10.0.0.2:8000")


async def test_an_answered_request_frees_its_room_before_the_next_scrape():
    fc = controller(Pool(0))
    first = place(fc, await fc.admit(request("a"), 1), "10.0.0.1:8000")
    second = asyncio.ensure_future(fc.admit(request("b"), 1))
    await asyncio.sleep(0.01)
    assert not second.done()
    fc.ledger.complete(first, response_seen=True)
    fc.on_request_complete()
    await asyncio.sleep(0.01)
    assert second.done()
    place(fc, second.result(), "10.0.0.1:8000")


async def test_a_saturated_high_band_blocks_lower_bands():
    pool = Pool(1)
    fc = controller(pool)
    low = asyncio.ensure_future(fc.admit(request("low", 0), 1))
    high = asyncio.ensure_future(fc.admit(request("high", 10), 1))
    await asyncio.sleep(0.01)
    assert not low.done() and not high.done()
    pool.scrape(0, 0)
    fc.on_metrics_update()
    await asyncio.sleep(0.01)
    assert high.done() and not low.done()  # one slot: the higher band takes it, the lower one waits
    place(fc, high.result(), "10.0.0.1:8000")
    low.cancel()


async def test_a_failed_placement_frees_its_room_for_the_next_request():
    fc = controller(Pool(0))
    first = await fc.admit(request("a"), 1)
    second = asyncio.ensure_future(fc.admit(request("b"), 1))
    await asyncio.sleep(0.01)
    assert not second.done()
    first.placed(None)  # scheduling failed: nothing reached the replica
    await asyncio.sleep(0.01)
    assert second.done()
    place(fc, second.result(), "10.0.0.1:8000")


async def test_ttl_and_capacity_errors():
    fc = controller(Pool(1), "{defaultRequestTTL: 100ms, maxBytes: 15}")
    started = time.monotonic()
    waiting = asyncio.ensure_future(fc.admit(request("a"), 10))
    await asyncio.sleep(0)
    with pytest.raises(InferenceError) as over:
        await fc.admit(request("b"), 10)
    assert over.value.code.http_status == 429
    with pytest.raises(InferenceError) as expired:
        await waiting
    assert expired.value.code.http_status == 503 and expired.value.message == "request timed out in queue"
    assert 0.09 <= time.monotonic() - started < 1.0
    assert (fc.queued_requests, fc.queued_bytes) == (0, 0)


async def test_a_bands_own_ttl_expires_its_queued_requests_with_the_drop_reason():
    # Sessions at -1 have their own short budget; band 0 keeps the global one (llm-d.ai/v1 per-band TTL).
    fc = controller(Pool(1), "{defaultRequestTTL: 30s, priorityBands: [{priority: -1, defaultRequestTTL: 50ms}, "
                             "{priority: 0}]}")
    session = asyncio.ensure_future(fc.admit(request("session", -1, tenant="s1"), 1))
    interactive = asyncio.ensure_future(fc.admit(request("interactive", 0), 1))
    with pytest.raises(InferenceError) as expired:
        await asyncio.wait_for(session, 5)
    assert expired.value.code.http_status == 503 and expired.value.drop_reason is DropReason.TTL_EXPIRED
    assert expired.value.drop_reason.value == "rejected-ttl-expired"
    assert not interactive.done() and fc.queued_requests == 1  # its 30 s budget still runs
    interactive.cancel()


async def test_edf_takes_envoys_route_deadline():
    fc = controller(Pool(1), "{defaultRequestTTL: 30s, defaultPriorityBand: {orderingPolicyRef: edf-ordering-policy}}")
    relaxed = asyncio.ensure_future(fc.admit(request("relaxed"), 1))
    hurried = asyncio.ensure_future(fc.admit(request("hurried", **{"x-envoy-expected-rq-timeout-ms": "2000"}), 1))
    await asyncio.sleep(0)
    fc.pool.scrape(0, 0)
    fc.on_metrics_update()
    await asyncio.sleep(0.01)
    assert hurried.done() and not relaxed.done()
    relaxed.cancel()


async def test_fairness_ids_beyond_the_label_budget_share_one_series():
    fc = controller(Pool(1))
    fc.metrics.max_flow_labels = 2
    tasks = [asyncio.ensure_future(fc.admit(request(f"r{i}", tenant=f"tenant-{i}" + "x" * 100), 1)) for i in range(4)]
    await asyncio.sleep(0)
    samples = {s.labels["fairness_id"]: s.value for m in fc.metrics.queue_size.collect() for s in m.samples}
    assert samples == {"tenant-0" + "x" * 56: 1, "tenant-1" + "x" * 56: 1, "__other__": 2}
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    assert fc.queued_requests == 0


async def test_a_lower_ceiling_holds_room_back_for_higher_bands():
    pool = Pool(0, 0, 0, 0)
    fc = controller(pool)
    fc.config = dataclasses.replace(fc.config, usage_limit=StaticUsageLimitPolicy(priority_thresholds={0: 0.5}))
    low = [asyncio.ensure_future(fc.admit(request(f"low{i}", 0), 1)) for i in range(4)]
    await asyncio.sleep(0.01)
    assert sum(t.done() for t in low) == 2  # two of four endpoints busy: saturation 0.5 stops priority 0
    high = asyncio.ensure_future(fc.admit(request("high", 10), 1))
    await asyncio.sleep(0.01)
    assert high.done()  # priority 10 keeps the default ceiling 1.0
    for t in (*low, high):
        t.cancel()


async def test_closing_answers_every_queued_request_and_each_new_one_503():
    fc = controller(Pool(5))  # saturated: everything queues
    waiting = [asyncio.ensure_future(fc.admit(request(str(i), priority=i % 2, tenant=f"t{i}"), 10)) for i in range(4)]
    await asyncio.sleep(0)
    assert fc.queued_requests == 4
    fc.close()
    for item in waiting:
        with pytest.raises(InferenceError) as caught:
            await item
        assert (caught.value.code.http_status, caught.value.drop_reason) == (503, "rejected-shutting-down")
    assert (fc.queued_requests, fc.queued_bytes) == (0, 0)
    with pytest.raises(InferenceError, match="shutting down"):
        await fc.admit(request("late"), 10)
