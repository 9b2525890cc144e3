"""Ordering and fairness policies, as tables: which request a band dispatches next (and the SLO policy's aging bound)."""

from __future__ import annotations

import math
import random

import pytest

from epp.flowcontrol.fairness import GlobalStrictFairnessPolicy, RoundRobinFairnessPolicy
from epp.flowcontrol.ordering import EDFOrderingPolicy, FCFSOrderingPolicy, QueuedRequest, SLODeadlineOrderingPolicy
from epp.flowcontrol.queues import PriorityBand
from epp.framework import ConfigError, PluginParams

INF = math.inf


def band_of(requests: list[tuple[str, str, float, float]], fairness, ordering) -> PriorityBand:
    """A band holding `(id, fairness id, enqueued, deadline)` requests, pushed in list order."""
    band = PriorityBand(0, max_requests=0, max_bytes=0, ordering=ordering, fairness=fairness)
    for seq, (rid, flow, enqueued, deadline) in enumerate(requests):
        band.push(QueuedRequest(rid, flow, 0, 10, enqueued, seq, deadline))
    return band


def drain(band: PriorityBand) -> list[str]:
    out = []
    while (flow := band.next_flow()) is not None:
        out.append(band.pop(flow).request_id)
    return out


@pytest.mark.parametrize("ordering, requests, expected", [
    # FCFS: arrival in the picker, whatever the deadlines.
    (FCFSOrderingPolicy(), [("a", "f", 1.0, 9.0), ("b", "f", 2.0, 3.0), ("c", "f", 3.0, INF)], ["a", "b", "c"]),
    (FCFSOrderingPolicy(), [("late", "f", 5.0, INF), ("early", "f", 1.0, INF)], ["early", "late"]),
    # EDF: the earliest deadline first; no deadline goes last; equal deadlines by arrival.
    (EDFOrderingPolicy(), [("a", "f", 1.0, 9.0), ("b", "f", 2.0, 3.0), ("c", "f", 3.0, INF)], ["b", "a", "c"]),
    (EDFOrderingPolicy(), [("x", "f", 1.0, INF), ("y", "f", 2.0, INF)], ["x", "y"]),
    (EDFOrderingPolicy(), [("p", "f", 2.0, 5.0), ("q", "f", 1.0, 5.0)], ["q", "p"]),
])
def test_ordering_within_a_flow(ordering, requests, expected):
    assert drain(band_of(requests, GlobalStrictFairnessPolicy(), ordering)) == expected


@pytest.mark.parametrize("fairness, requests, expected", [
    # Global strict: flows do not matter, the band is one FCFS queue.
    (GlobalStrictFairnessPolicy(),
     [("h1", "heavy", 1, INF), ("h2", "heavy", 2, INF), ("h3", "heavy", 3, INF), ("l1", "light", 4, INF)],
     ["h1", "h2", "h3", "l1"]),
    # Round robin: flows take turns in the order they first queued.
    (RoundRobinFairnessPolicy(),
     [("h1", "heavy", 1, INF), ("h2", "heavy", 2, INF), ("h3", "heavy", 3, INF), ("l1", "light", 4, INF)],
     ["h1", "l1", "h2", "h3"]),
    (RoundRobinFairnessPolicy(),
     [("a1", "a", 1, INF), ("a2", "a", 2, INF), ("b1", "b", 3, INF), ("b2", "b", 4, INF), ("c1", "c", 5, INF)],
     ["a1", "b1", "c1", "a2", "b2"]),
])
def test_fairness_between_flows(fairness, requests, expected):
    assert drain(band_of(requests, fairness, FCFSOrderingPolicy())) == expected


@pytest.mark.parametrize("fairness, expected", [
    (GlobalStrictFairnessPolicy(), ["b1", "a1"]),   # the band's earliest deadline wins
    (RoundRobinFairnessPolicy(), ["a1", "b1"]),     # turns first, then the flow's own order
])
def test_fairness_asks_the_ordering_policy_for_each_flows_head(fairness, expected):
    requests = [("a1", "a", 1, 9.0), ("b1", "b", 2, 3.0)]
    assert drain(band_of(requests, fairness, EDFOrderingPolicy())) == expected


def test_round_robin_puts_a_returning_flow_at_the_end_of_the_turns():
    band = band_of([("a1", "a", 1, INF), ("b1", "b", 2, INF)], RoundRobinFairnessPolicy(), FCFSOrderingPolicy())
    assert band.pop(band.next_flow()).request_id == "a1"   # flow a is emptied and forgotten
    band.push(QueuedRequest("a2", "a", 0, 10, 3, 7))
    band.push(QueuedRequest("c1", "c", 0, 10, 4, 8))
    assert drain(band) == ["b1", "a2", "c1"]


def test_discarded_requests_leave_the_counts_and_are_never_dispatched():
    band = band_of([("a1", "a", 1, INF), ("a2", "a", 2, INF), ("b1", "b", 3, INF)],
                   GlobalStrictFairnessPolicy(), FCFSOrderingPolicy())
    gone = band.flows["a"].head()
    band.discard(gone)
    assert (band.requests, band.bytes) == (2, 20)
    assert drain(band) == ["a2", "b1"]
    assert (band.requests, band.bytes, dict(band.flows)) == (0, 0, {})


def test_band_limits_count_requests_and_bytes():
    band = PriorityBand(0, max_requests=2, max_bytes=25, ordering=FCFSOrderingPolicy(),
                        fairness=GlobalStrictFairnessPolicy())
    assert band.has_room(25) and not band.has_room(26)
    band.push(QueuedRequest("a", "f", 0, 10, 1, 1))
    assert band.has_room(15) and not band.has_room(16)
    band.push(QueuedRequest("b", "f", 0, 10, 2, 2))
    assert not band.has_room(0)  # the third request is over maxRequests


# -- slo-deadline-ordering-policy ---------------------------------------------------------------

def slo_band(requests: list[tuple[str, float, float, float]], policy: SLODeadlineOrderingPolicy) -> PriorityBand:
    """A band holding `(id, enqueued, predicted prefill s, TTFT objective s or INF)` requests of one flow."""
    band = PriorityBand(0, max_requests=0, max_bytes=0, ordering=policy, fairness=GlobalStrictFairnessPolicy())
    for seq, (rid, enqueued, service, objective) in enumerate(requests):
        band.push(QueuedRequest(rid, "f", 0, 10, enqueued, seq, service_s=service, ttft_deadline=enqueued + objective))
    return band


SLO = SLODeadlineOrderingPolicy(aging_window_s=5.0, service_weight=10.0)


@pytest.mark.parametrize("requests, expected", [
    # Shortest predicted prefill first among requests that arrived together.
    ([("long", 0.0, 0.4, INF), ("short", 0.0, 0.05, INF), ("mid", 0.0, 0.2, INF)], ["short", "mid", "long"]),
    # Aging: a long request (charged the whole 5 s window) is overtaken only by requests that arrive
    # less than 5 s after it, whatever their size.
    ([("long", 0.0, 3.0, INF), ("s1", 1.0, 0.01, INF), ("s2", 4.8, 0.01, INF), ("s3", 5.1, 0.0, INF),
      ("s4", 9.0, 0.0, INF)], ["s1", "s2", "long", "s3", "s4"]),
    # Equal predictions: first come, first served.
    ([("a", 0.0, 0.1, INF), ("b", 0.5, 0.1, INF)], ["a", "b"]),
    # Unknown prediction (0): FCFS ahead of any predicted work that arrived with it.
    ([("known", 0.0, 0.1, INF), ("unknown", 0.0, 0.0, INF)], ["unknown", "known"]),
    # A TTFT objective moves a request up to its latest start (objective - prefill): 0.5 - 0.3 = 0.2
    # after arrival, ahead of a shorter request charged 0.1 x 10 = 1 s.
    ([("short", 0.0, 0.1, INF), ("urgent", 0.0, 0.3, 0.5)], ["urgent", "short"]),
    # ... but not past its own place by size: a loose objective changes nothing.
    ([("short", 0.0, 0.05, INF), ("loose", 0.0, 0.1, 30.0)], ["short", "loose"]),
    # A request that cannot meet its objective any more (prefill 2 s > objective 1 s) keeps its place by size.
    ([("hopeless", 0.0, 2.0, 1.0), ("short", 0.0, 0.1, INF)], ["short", "hopeless"]),
])
def test_slo_deadline_ordering(requests, expected):
    assert drain(slo_band(requests, SLO)) == expected


@pytest.mark.parametrize("window", [0.0, 1.0, 5.0])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_no_request_is_overtaken_by_one_that_arrived_more_than_the_aging_window_later(window, seed):
    rng = random.Random(seed)
    policy = SLODeadlineOrderingPolicy(aging_window_s=window, service_weight=rng.choice([1.0, 10.0, 100.0]))
    requests = [(f"r{i}", rng.uniform(0, 20), rng.choice([0.0, 0.01, 0.3, 2.0, 8.0]),
                 rng.choice([INF, 0.5, 2.0, 10.0])) for i in range(200)]
    requests.sort(key=lambda r: r[1])
    arrival = {rid: enqueued for rid, enqueued, _, _ in requests}
    order = drain(slo_band(requests, policy))
    for i, rid in enumerate(order):
        for later in order[i + 1:]:  # rid went first, so it arrived at most `window` after `later`
            assert arrival[rid] <= arrival[later] + window + 1e-9, (rid, later)


def test_with_a_zero_window_the_slo_policy_is_first_come_first_served():
    policy = SLODeadlineOrderingPolicy(aging_window_s=0.0)
    requests = [("a", 0.0, 5.0, 0.5), ("b", 1.0, 0.0, INF), ("c", 2.0, 0.1, 1.0)]
    assert drain(slo_band(requests, policy)) == ["a", "b", "c"]


@pytest.mark.parametrize("params, message", [
    ({"agingWindow": "-1s"}, "agingWindow"),
    ({"ttftObjective": "0s"}, "ttftObjective"),
    ({"serviceWeight": -1}, "serviceWeight"),
])
def test_slo_policy_parameters_are_checked(params, message):
    with pytest.raises(ConfigError, match=message):
        SLODeadlineOrderingPolicy("p", PluginParams("p", params))
