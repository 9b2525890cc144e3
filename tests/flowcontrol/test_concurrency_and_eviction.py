"""concurrency-detector, priority-holdback-policy and enableEviction (in-flight sheddable requests) in the controller."""

from __future__ import annotations

import asyncio

import pytest
import yaml

from epp.flowcontrol.concurrency import ConcurrencyDetector
from epp.flowcontrol.config import parse_flow_control
from epp.flowcontrol.controller import (
    DISPATCH_STATE_KEY,
    EVICTION_CONFIRMATION_TIMEOUT_S,
    FlowController,
    eviction_signal,
)
from epp.flowcontrol.usage import PriorityHoldbackPolicy
from epp.framework import ConfigError, CycleState, PluginParams, ProfileRunResult, SchedulingResult
from epp.framework.load import InflightLedger
from epp.framework.types import Endpoint, InferenceRequest, ResponseInfo

A, B = Endpoint("10.0.0.1", 8000), Endpoint("10.0.0.2", 8000)


def request(rid: str, priority: int = 0, prompt_chars: int = 400) -> InferenceRequest:
    return InferenceRequest(rid, "completions", "m", "m", {"prompt": "x" * prompt_chars}, priority=priority)


def placed_on(detector: ConcurrencyDetector, endpoint: Endpoint, req: InferenceRequest) -> CycleState:
    state = CycleState()
    detector.pre_request(state, req, SchedulingResult({"default": ProfileRunResult((endpoint,))}, "default"))
    return state


def test_requests_mode_sums_the_pool_and_filters_endpoints_at_their_limit_plus_headroom():
    detector = ConcurrencyDetector(max_concurrency=2, headroom=0.5)
    states = [placed_on(detector, A, request(f"r{i}")) for i in range(3)]
    assert detector.saturation([A, B]) == pytest.approx(3 / 4)
    assert detector.saturation([]) == 1.0
    # A holds 3: under 2 x 1.5 = 3 it is not; B is empty.
    assert detector.filter(CycleState(), request("x"), [A, B]) == [B]
    for state in states:
        detector.on_response_complete(state, request("r"), ResponseInfo(status="200"), A)
    detector.on_response_complete(states[0], request("r"), ResponseInfo(status="200"), A)  # released once only
    assert detector.saturation([A, B]) == 0 and detector.requests == {}


def test_tokens_and_hybrid_modes():
    tokens = ConcurrencyDetector(max_token_concurrency=1000, mode="tokens")
    placed_on(tokens, A, request("r", prompt_chars=2000))  # 500 tokens at 4 characters each
    assert tokens.saturation([A, B]) == pytest.approx(500 / 2000)
    hybrid = ConcurrencyDetector(max_concurrency=10, max_token_concurrency=1000, mode="hybrid")
    placed_on(hybrid, A, request("r", prompt_chars=3200))  # A: 1/10 requests, 800/1000 tokens
    assert hybrid.saturation([A, B]) == pytest.approx((0.8 + 0) / 2)
    assert hybrid.filter(CycleState(), request("x"), [A, B]) == [A, B]
    placed_on(hybrid, A, request("r2", prompt_chars=800))  # 1000 tokens: at the limit
    assert hybrid.filter(CycleState(), request("x"), [A, B]) == [B]


def test_requests_let_through_but_not_placed_count():
    detector = ConcurrencyDetector(max_concurrency=1)
    assert detector.saturation_with_pending([A, B], 2) == 1.0


@pytest.mark.parametrize("params, message", [
    ({"maxConcurrency": 0}, "maxConcurrency"), ({"headroom": -0.1}, "headroom"),
    ({"concurrencyMode": "bytes"}, "concurrencyMode"), ({"maxTokenConcurrency": 0}, "maxTokenConcurrency")])
def test_concurrency_detector_parameters_are_checked(params, message):
    with pytest.raises(ConfigError, match=message):
        ConcurrencyDetector("c", PluginParams("c", params))


def test_priority_holdback_ceilings_by_rank_and_by_value():
    rank = PriorityHoldbackPolicy(min_ceiling=0.4, max_ceiling=0.9)
    assert rank.ceilings([10, 0, -5], 0.0) == pytest.approx({10: 0.9, 0: 0.65, -5: 0.4})
    assert rank.ceilings([3], 0.0) == {3: 0.9}
    value = PriorityHoldbackPolicy(min_ceiling=0.4, max_ceiling=0.9, domain="value")
    assert value.ceilings([10, 0, -10], 0.0) == pytest.approx({10: 0.9, 0: 0.65, -10: 0.4})
    assert value.ceilings([100, 90, 0], 0.0) == pytest.approx({100: 0.9, 90: 0.85, 0: 0.4})
    with pytest.raises(ConfigError, match="minCeiling' is required"):
        PriorityHoldbackPolicy("h", PluginParams("h", {}))
    with pytest.raises(ConfigError, match="below 'maxCeiling'"):
        PriorityHoldbackPolicy("h", PluginParams("h", {"minCeiling": 0.9, "maxCeiling": 0.5}))


class Pool:
    def __init__(self, *endpoints: Endpoint) -> None:
        self.endpoints = endpoints

    def snapshot(self):
        return self.endpoints


def controller(section: str, detector: ConcurrencyDetector, clock: list[float] | None = None) -> FlowController:
    config = parse_flow_control(yaml.safe_load(section), plugins={})
    kwargs = {"clock": (lambda: clock[0])} if clock is not None else {}
    return FlowController(config, detector, Pool(A), InflightLedger(), **kwargs)


async def run(fc: FlowController, detector: ConcurrencyDetector, req: InferenceRequest) -> CycleState:
    """What the director does: admit, place on A (counted by the detector), keep the state for completion."""
    state = CycleState()
    dispatch = await fc.admit(req, 1, state=state)
    detector.pre_request(state, req, SchedulingResult({"default": ProfileRunResult((A,))}, "default"))
    dispatch.placed(A.name)
    return state


def finish(fc: FlowController, detector: ConcurrencyDetector, state: CycleState, req: InferenceRequest) -> None:
    detector.on_response_complete(state, req, ResponseInfo(status="200"), A)
    fc.on_request_complete(state, ResponseInfo(status="200"))


async def test_holdback_keeps_room_for_the_higher_band():
    detector = ConcurrencyDetector(max_concurrency=4)
    holdback = PriorityHoldbackPolicy(min_ceiling=0.5, max_ceiling=1.0)
    config = parse_flow_control(yaml.safe_load("{priorityBands: [{priority: 10}, {priority: 0}]}"))
    fc = FlowController(type(config)(usage_limit=holdback, bands=config.bands), detector, Pool(A), InflightLedger())
    low = [asyncio.ensure_future(run(fc, detector, request(f"low{i}", 0))) for i in range(4)]
    await asyncio.sleep(0.01)
    assert sum(t.done() for t in low) == 2  # priority 0's ceiling is 0.5 of 4 slots
    high = [asyncio.ensure_future(run(fc, detector, request(f"high{i}", 10))) for i in range(2)]
    await asyncio.sleep(0.01)
    assert all(t.done() for t in high)  # priority 10 fills to 1.0
    for t in low:
        t.cancel()


async def test_eviction_takes_the_newest_lowest_priority_in_flight_request_for_a_blocked_band():
    clock = [0.0]
    detector = ConcurrencyDetector(max_concurrency=3)
    fc = controller("{enableEviction: true}", detector, clock)
    states = {}
    for rid, priority in (("shed-old", -1), ("shed-new", -1), ("keep", 0)):
        req = request(rid, priority)
        states[rid] = (await run(fc, detector, req), req)
        clock[0] += 1.0
    assert eviction_signal(states["keep"][0]) is None  # not sheddable: never evicted
    old, new = eviction_signal(states["shed-old"][0]), eviction_signal(states["shed-new"][0])
    assert old is not None and new is not None
    # The pool is full (3 of 3); a priority-0 request must wait, and makes room.
    waiting = asyncio.ensure_future(run(fc, detector, request("urgent", 0)))
    await asyncio.sleep(0.01)
    assert not waiting.done()
    assert new.done() and not old.done()  # one victim: the most recently dispatched of the lowest priority
    assert fc.metrics.evictions.labels("-1", "issued")._value.get() == 1
    # The evicted stream ends (its completion hooks run): after the grace the room is seen and used.
    finish(fc, detector, *states["shed-new"])
    clock[0] += fc.eviction_grace_s
    await asyncio.sleep(fc.eviction_grace_s + 0.05)
    assert waiting.done()
    assert not old.done()  # one eviction was enough
    assert fc.metrics.evictions.labels("-1", "confirmed")._value.get() == 1


async def test_no_eviction_without_the_flag_or_for_a_band_not_above_the_victim():
    detector = ConcurrencyDetector(max_concurrency=1)
    fc = controller("{}", detector)
    state = await run(fc, detector, request("shed", -1))
    assert eviction_signal(state) is None
    detector2 = ConcurrencyDetector(max_concurrency=1)
    fc2 = controller("{enableEviction: true}", detector2)
    victim = eviction_signal(await run(fc2, detector2, request("shed", -1)))
    same = asyncio.ensure_future(run(fc2, detector2, request("also-shed", -1)))
    await asyncio.sleep(0.01)
    assert victim is not None and not victim.done()  # same priority: no churn
    same.cancel()


async def test_an_unconfirmed_eviction_holds_the_next_decision_until_its_timeout():
    clock = [0.0]
    detector = ConcurrencyDetector(max_concurrency=2)
    fc = controller("{enableEviction: true}", detector, clock)
    first = eviction_signal(await run(fc, detector, request("a", -1)))
    second = eviction_signal(await run(fc, detector, request("b", -1)))
    blocked = asyncio.ensure_future(run(fc, detector, request("urgent", 5)))
    await asyncio.sleep(0.01)
    assert second.done() and not first.done()
    fc.wake()
    await asyncio.sleep(0.01)
    assert not first.done()  # stop-and-wait: nothing more while the first is unconfirmed
    clock[0] += EVICTION_CONFIRMATION_TIMEOUT_S + fc.eviction_grace_s
    fc._gate_open(clock[0])  # the timeout retires it; the grace after it expires too
    clock[0] += fc.eviction_grace_s
    fc.wake()
    await asyncio.sleep(0.01)
    assert first.done()
    assert fc.metrics.evictions.labels("-1", "timed_out")._value.get() == 1
    blocked.cancel()


async def test_the_dispatch_is_kept_in_the_state_for_completion():
    detector = ConcurrencyDetector(max_concurrency=1)
    fc = controller("{}", detector)
    req = request("a")
    state = await run(fc, detector, req)
    assert state.get(DISPATCH_STATE_KEY) is not None and fc.inflight == 1
    finish(fc, detector, state, req)
    finish(fc, detector, state, req)  # once only
    assert fc.inflight == 0
