"""program-aware-fairness: LAS order, the aging bound (deterministic clock), continuation charging, decay, bounds."""

from __future__ import annotations

import asyncio
import itertools
import random

import pytest
import yaml
from prometheus_client import CollectorRegistry

from epp.config import load_config_text
from epp.flowcontrol.concurrency import ConcurrencyDetector
from epp.flowcontrol.config import parse_flow_control
from epp.flowcontrol.controller import FlowController
from epp.flowcontrol.fairness import ServiceUsage
from epp.flowcontrol.ordering import FCFSOrderingPolicy, QueuedRequest
from epp.flowcontrol.program_aware import ProgramAwareFairness
from epp.flowcontrol.queues import PriorityBand
from epp.framework import ConfigError, CycleState, PluginContext, PluginParams, ResponseInfo
from epp.framework.load import InflightLedger
from epp.framework.types import Endpoint, InferenceRequest
from tests.support.scheduling import DirectorHarness


def policy(**params) -> ProgramAwareFairness:
    return ProgramAwareFairness("paf", PluginParams("paf", params), PluginContext(metrics_registry=CollectorRegistry()))


class Band:
    """One priority band driven by hand: requests pushed at given times, dispatched one at a time."""

    def __init__(self, fairness: ProgramAwareFairness) -> None:
        self.fairness = fairness
        self.band = PriorityBand(0, max_requests=0, max_bytes=0, ordering=FCFSOrderingPolicy(), fairness=fairness)
        self.seq = itertools.count()

    def push(self, program: str, now: float, rid: str | None = None) -> QueuedRequest:
        n = next(self.seq)
        item = QueuedRequest(rid or f"{program}-{n}", program, 0, 1, now, n)
        self.band.push(item)
        self.fairness.on_enqueue(item, now)
        return item

    def dispatch(self, now: float) -> QueuedRequest:
        flow = self.band.next_flow(now)
        assert flow is not None
        item = self.band.pop(flow)
        self.fairness.on_dispatch(item, now)
        return item

    def serve(self, program: str, now: float, prompt: int, completion: int = 0, cached: int = 0) -> None:
        """One whole request of `program`: queued, dispatched and finished at `now`."""
        item = self.push(program, now)
        assert self.dispatch(now) is item
        self.fairness.on_complete(item, ServiceUsage(prompt, cached, completion), now)


def test_least_attained_service_goes_first_and_output_counts_twice():
    band = Band(policy())
    band.serve("heavy", 0.0, prompt=1000, completion=500)
    band.serve("light", 0.0, prompt=1000, completion=100)
    assert band.fairness.service("heavy", 0.0) == 2000 and band.fairness.service("light", 0.0) == 1200
    band.push("heavy", 1.0)
    band.push("light", 1.0)
    band.push("new", 1.0)
    assert [band.dispatch(1.0).fairness_id for _ in range(3)] == ["new", "light", "heavy"]


def test_equal_service_the_longest_waiting_head_wins():
    band = Band(policy())
    band.push("b", 5.0)
    band.push("a", 3.0)
    assert band.dispatch(6.0).fairness_id == "a"


def test_head_wait_weighs_against_service_as_llm_d_weighs_them():
    # Service weight 0.2, wait weight 0.8: the long wait beats the smaller service.
    band = Band(policy(lasWeightService=0.2, lasWeightHeadWait=0.8))
    band.serve("heavy", 0.0, prompt=10_000)
    band.push("heavy", 1.0)
    band.push("light", 9.0)
    assert band.dispatch(10.0).fairness_id == "heavy"


def test_a_heavy_program_is_served_once_its_head_waited_the_aging_window():
    band = Band(policy(agingWindow="10s", lasHalfLifeSeconds=0))
    band.serve("heavy", 0.0, prompt=1_000_000)
    band.push("heavy", 0.0, rid="starving")
    order = []
    for t in range(30):  # a new light program every second, one dispatch a second
        band.push(f"light-{t}", float(t))
        order.append((t, band.dispatch(float(t)).request_id))
    served_at = next(t for t, rid in order if rid == "starving")
    assert served_at == 10  # the first decision at which its head had waited the window
    assert band.fairness.aged_dispatches == 1


def test_no_request_is_overtaken_by_one_that_arrived_more_than_the_aging_window_later():
    """A random overload (more arrivals than dispatches) over programs of very different service."""
    window = 5.0
    rng = random.Random(7)
    band = Band(policy(agingWindow=window, lasHalfLifeSeconds=30))
    arrived: dict[str, float] = {}
    dispatched: list[tuple[float, str]] = []
    now = 0.0
    for _ in range(4000):
        now += rng.expovariate(4.0)  # 4 arrivals a second
        program = f"p{min(int(rng.paretovariate(1.2)), 50)}"
        item = band.push(program, now)
        arrived[item.request_id] = now
        if rng.random() < 0.7:  # about 2.8 dispatches a second: the queue grows
            done = band.dispatch(now)
            dispatched.append((now, done.request_id))
            band.fairness.on_complete(done, ServiceUsage(rng.randint(100, 20_000), 0, rng.randint(10, 500)), now)
    assert band.fairness.aged_dispatches > 0  # the bound was needed
    # Whatever went before a request arrived at most `window` after it.
    latest_before = float("-inf")
    for _, rid in dispatched:
        assert latest_before <= arrived[rid] + window
        latest_before = max(latest_before, arrived[rid])
    # Requests still queued at the end were not overtaken by later ones beyond the window either.
    served = {rid for _, rid in dispatched}
    oldest_waiting = min(t for rid, t in arrived.items() if rid not in served)
    assert latest_before <= oldest_waiting + window


def test_a_continuation_is_charged_what_the_pool_computed_not_its_cached_context():
    band = Band(policy(lasHalfLifeSeconds=0))
    # Turn 2 of an agent session: 40,000 tokens of context already cached, 300 new, 200 out.
    band.serve("agent", 0.0, prompt=40_300, cached=40_000, completion=200)
    assert band.fairness.service("agent", 0.0) == 300 + 2 * 200
    llm_d_charge = Band(policy(lasHalfLifeSeconds=0, cachedTokenWeight=1.0))
    llm_d_charge.serve("agent", 0.0, prompt=40_300, cached=40_000, completion=200)
    assert llm_d_charge.fairness.service("agent", 0.0) == 40_300 + 2 * 200


def test_attained_service_halves_every_half_life_through_a_pause():
    fairness = policy(lasHalfLifeSeconds=60)
    band = Band(fairness)
    band.serve("agent", 0.0, prompt=1000)
    assert fairness.service("agent", 60.0) == pytest.approx(500)
    assert fairness.service("agent", 600.0) == pytest.approx(1000 / 1024)


def test_the_older_lasDecayFactor_decays_idle_programs_once_per_dispatch_decision():
    fairness = policy(lasDecayFactor=0.5)
    assert fairness.decay_factor == 0.5 and fairness.half_life_s == 0
    band = Band(fairness)
    band.serve("idle", 0.0, prompt=1024)  # one decision (its own dispatch), then idle
    band.serve("busy", 0.0, prompt=1024)  # a decision while "idle" is idle: halves it
    busy_before = fairness.service("busy", 0.0)
    band.push("busy", 1.0)  # busy stays queued (active): not decayed by the next decisions
    band.push("other", 1.0)
    band.dispatch(1.0)
    band.dispatch(1.0)
    # Three decisions while "idle" was idle; "busy" was active for the last two and idle for none.
    assert fairness.service("idle", 2.0) == pytest.approx(1024 * 0.5 ** 3)
    assert fairness.service("busy", 2.0) == pytest.approx(busy_before)
    both = policy(lasDecayFactor=0.5, lasHalfLifeSeconds=60)
    assert both.decay_factor is None  # a half-life overrides the factor (as llm-d did)


# -- turn-priority (llm-d's strategy: the deepest session first, a newcomer ages up) ---------------

def turns(band: Band, program: str, n: int, start: float) -> float:
    """`n` whole turns of `program`, one a second from `start`; the time of the last completion."""
    for i in range(n):
        band.serve(program, start + i, prompt=100)
    return start + n - 1


def test_turn_priority_serves_the_deepest_session_first():
    band = Band(policy(strategy="turn-priority"))
    turns(band, "deep", 9, 0.0)
    turns(band, "shallow", 2, 0.0)
    assert band.fairness.describe().startswith("strategy=turn-priority turnPriorityTimeWeight=0.05 "
                                               "turnPriorityInactivitySeconds=120 agingWindow=off")
    for program in ("fresh", "shallow", "deep"):  # arrival order is the reverse of depth
        band.push(program, 20.0)
    assert [band.fairness.turn(p, band.band.flows[p].head(), 20.0) for p in ("deep", "shallow", "fresh")] == \
        [10, 3, 1]
    assert [band.dispatch(20.0).fairness_id for _ in range(3)] == ["deep", "shallow", "fresh"]


@pytest.mark.parametrize("now, first", [(190.0, "deep"), (210.0, "fresh")])
def test_a_newcomer_overtakes_a_session_d_turns_deeper_after_d_over_the_weight_seconds(now, first):
    # deep's head is turn 11; fresh (turn 1) has waited since 0: 1 + 0.05 x wait passes 11 at 200 s.
    band = Band(policy(strategy="turn-priority", turnPriorityInactivitySeconds=0))
    band.push("fresh", 0.0)
    turns(band, "deep", 10, -20.0)
    band.push("deep", now)  # its head has not waited
    assert band.dispatch(now).fairness_id == first


def test_a_session_idle_past_the_inactivity_window_competes_from_turn_one_and_earns_its_depth_again():
    fairness = policy(strategy="turn-priority")
    band = Band(fairness)
    turns(band, "dormant", 10, 0.0)  # last completion at 9 s
    turns(band, "active", 2, 200.0)  # last completion at 201 s
    band.push("dormant", 200.0)      # 191 s after its last completion: past 120 s
    band.push("active", 202.0)
    assert fairness.turn("dormant", band.band.flows["dormant"].head(), 202.0) == 1
    # active: turn 3; dormant: 1 + 0.05 x 2 s of wait.
    assert [band.dispatch(202.0).fairness_id for _ in range(2)] == ["active", "dormant"]
    assert fairness.programs.get("dormant", 202.0).dispatched == 1  # the count restarted at that dispatch
    item = band.push("dormant", 203.0)
    assert fairness.turn("dormant", item, 203.0) == 2  # the one before is still in flight: no reset


def test_a_request_in_flight_or_a_zero_window_keeps_the_depth():
    fairness = policy(strategy="turn-priority")
    band = Band(fairness)
    turns(band, "busy", 5, 0.0)
    band.push("busy", 5.0)
    band.dispatch(5.0)  # in flight, never finished
    head = band.push("busy", 300.0)
    assert fairness.turn("busy", head, 300.0) == 7
    never = policy(strategy="turn-priority", turnPriorityInactivitySeconds=0)
    band = Band(never)
    turns(band, "old", 5, 0.0)
    assert never.turn("old", band.push("old", 3000.0), 3000.0) == 6  # (programs idle 3600 s are dropped)


def test_turn_priority_uses_the_aging_bound_only_when_given():
    for params, first in (({}, "deep"), ({"agingWindow": "30s"}, "fresh")):
        band = Band(policy(strategy="turn-priority", **params))
        band.push("fresh", 0.0)
        turns(band, "deep", 50, -100.0)
        band.push("deep", 31.0)
        assert band.dispatch(31.0).fairness_id == first, params


# The llm-d turn-priority-fairness guide's router config, written here from its facts.
TURN_GUIDE = """apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
featureGates: [flowControl]
plugins:
- type: program-aware-fairness
  parameters: {strategy: turn-priority}
- type: agent-identity
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: prefix-cache-scorer
- type: concurrency-detector
  parameters: {maxConcurrency: 32}
schedulingProfiles:
- name: default
  plugins:
  - {pluginRef: queue-scorer, weight: 2}
  - {pluginRef: kv-cache-utilization-scorer, weight: 2}
  - {pluginRef: prefix-cache-scorer, weight: 3}
flowControl:
  enableEviction: true
  saturationDetector: {pluginRef: concurrency-detector}
  priorityBands:
  - {priority: -1, defaultRequestTTL: 9000s, fairnessPolicyRef: program-aware-fairness}
  - {priority: 0}
"""


def test_the_turn_priority_guides_config_loads_with_llm_ds_meaning():
    controller = DirectorHarness(TURN_GUIDE).loaded.flow_controller
    assert controller is not None
    config = controller.config
    sessions, unlabeled = config.band_for(-1), config.band_for(0)
    assert isinstance(sessions.fairness, ProgramAwareFairness) and sessions.fairness.strategy == "turn-priority"
    assert not isinstance(unlabeled.fairness, ProgramAwareFairness)  # the default policy keeps band 0
    assert (config.ttl_for(-1), config.ttl_for(0)) == (9000.0, 0.0) and config.enable_eviction
    # The guide's weight-TTL product: the depth a newcomer can overcome before its band sheds it.
    assert sessions.fairness.turn_time_weight * config.ttl_for(-1) == pytest.approx(450)


def test_program_state_is_bounded_under_a_flood_of_distinct_sessions():
    registry = CollectorRegistry()
    fairness = ProgramAwareFairness("paf", PluginParams("paf", {"maxPrograms": 500}),
                                    PluginContext(metrics_registry=registry))
    band = Band(fairness)
    for i in range(10_000):
        band.serve(f"session-{i}", float(i) / 1000, prompt=10)
    assert len(fairness.programs) == 500
    assert registry.get_sample_value("epp_session_table_evictions_total",
                                     {"table": "paf", "reason": "capacity"}) == 9_500
    assert 0.0 < fairness.fairness_index() <= 1.0


def test_idle_programs_expire_after_the_ttl():
    fairness = policy(evictionTtlSeconds=100)
    band = Band(fairness)
    band.serve("old", 0.0, prompt=10)
    band.serve("new", 150.0, prompt=10)
    assert "old" not in fairness.programs and "new" in fairness.programs


def test_jains_index_is_one_for_equal_waits_and_falls_for_unequal():
    fairness = policy()
    band = Band(fairness)
    for program in ("a", "b"):
        band.push(program, 0.0)
    band.dispatch(1.0)
    band.dispatch(1.0)
    assert fairness.fairness_index() == pytest.approx(1.0)
    band.push("c", 0.0)
    band.dispatch(100.0)
    assert fairness.fairness_index() < 0.5


@pytest.mark.parametrize("params, message", [
    ({"strategy": "fifo"}, "allowed: las, turn-priority"),
    ({"strategy": "drr"}, "drr and rr are not implemented"),
    ({"strategy": "turn-priority", "turnPriorityTimeWeight": -0.1}, "turnPriorityTimeWeight"),
    ({"strategy": "turn-priority", "turnPriorityInactivitySeconds": -1}, "turnPriorityInactivitySeconds"),
    ({"lasDecayFactor": 1.5}, "lasDecayFactor"),
    ({"lasWeightService": -1}, "lasWeightService"),
    ({"evictionSweepSeconds": 0}, "evictionSweepSeconds"),
    ({"agingWindow": "0s"}, "agingWindow"),
])
def test_bad_parameters_are_refused(params, message):
    with pytest.raises(ConfigError, match=message):
        policy(**params)


class Pool:
    def __init__(self, n: int) -> None:
        self.endpoints = tuple(Endpoint(f"10.0.0.{i + 1}", 8000) for i in range(n))

    def snapshot(self):
        return self.endpoints


def request(rid: str, program: str) -> InferenceRequest:
    return InferenceRequest(rid, "completions", "m", "m", {"prompt": "x" * 400}, fairness_id=program)


async def test_through_the_controller_finished_turns_charge_their_program():
    """One slot (concurrency-detector, maxConcurrency 1): the server's usage orders the next dispatch."""
    clock = [0.0]
    detector = ConcurrencyDetector(max_concurrency=1)
    config = parse_flow_control(yaml.safe_load("{defaultPriorityBand: {fairnessPolicyRef: program-aware-fairness}}"))
    fc = FlowController(config, detector, Pool(1), InflightLedger(), clock=lambda: clock[0])
    fairness = config.default_band.fairness
    assert isinstance(fairness, ProgramAwareFairness)

    async def run_one(rid: str, program: str, usage: dict) -> None:
        state = CycleState()
        dispatch = await fc.admit(request(rid, program), 1, state=state)
        state.put(detector.name, ("10.0.0.1:8000", 100))
        detector.requests["10.0.0.1:8000"] = 1
        dispatch.placed("10.0.0.1:8000")
        clock[0] += 1.0
        detector.requests.pop("10.0.0.1:8000")
        fc.on_request_complete(state, ResponseInfo(status="200", usage=usage))

    await run_one("a1", "a", {"prompt_tokens": 5000, "completion_tokens": 100,
                              "prompt_tokens_details": {"cached_tokens": 1000}})
    assert fairness.service("a", clock[0]) == pytest.approx(4000 + 2 * 100)  # computed prompt + 2 x output
    # The slot is taken: b and a queue; b (no service yet) goes first when it frees.
    detector.requests["10.0.0.1:8000"] = 1
    waits = [asyncio.ensure_future(fc.admit(request(rid, p), 1)) for rid, p in (("a2", "a"), ("b1", "b"))]
    await asyncio.sleep(0)
    assert fc.queued_requests == 2
    detector.requests.pop("10.0.0.1:8000")
    fc.on_request_complete()
    for _ in range(3):
        await asyncio.sleep(0)
    # One slot freed: one dispatch (the request let through counts until placed), and it is b's.
    assert waits[1].done() and not waits[0].done()
    for w in waits:
        w.cancel()


# The llm-d agentic-serving guide's router config, written here from its facts (plugins, parameters, values).
GUIDE = """
apiVersion: {api}
kind: EndpointPickerConfig
plugins:
- type: agent-identity
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: prefix-cache-scorer
- type: concurrency-detector
  parameters:
    maxConcurrency: 133
- type: program-aware-fairness
  parameters: {params}
featureGates:
- flowControl
flowControl:
  saturationDetector:
    pluginRef: concurrency-detector
  defaultPriorityBand:
    fairnessPolicyRef: program-aware-fairness
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: queue-scorer
    weight: 2
  - pluginRef: kv-cache-utilization-scorer
    weight: 2
  - pluginRef: prefix-cache-scorer
    weight: 3
"""


@pytest.mark.parametrize("api, params, half_life, factor", [
    ("llm-d.ai/v1alpha1", "{}", 60.0, None),
    ("inference.networking.x-k8s.io/v1alpha1",
     "{strategy: las, lasWeightService: 0.8, lasWeightHeadWait: 0.2, lasDecayFactor: 0.99997}", 0.0, 0.99997),
])
def test_the_agentic_guides_configs_load_with_llm_ds_meaning(api, params, half_life, factor):
    harness = DirectorHarness(GUIDE.format(api=api, params=params))
    controller = harness.loaded.flow_controller
    assert controller is not None
    fairness = controller.config.default_band.fairness
    assert isinstance(fairness, ProgramAwareFairness)
    assert (fairness.half_life_s, fairness.decay_factor) == (half_life, factor)
    assert (fairness.weight_service, fairness.weight_wait) == (0.8, 0.2)
    assert isinstance(controller.detector, ConcurrencyDetector) and controller.detector.max_concurrency == 133
    assert load_config_text(GUIDE.format(api=api, params=params)).flow_control_section is not None
