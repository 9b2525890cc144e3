"""The rendezvous home of a prefix no endpoint holds: the same in every picker, moved only by load or churn."""

from __future__ import annotations

import time

import pytest

from epp.framework.datakeys import PREFIX_HOME
from epp.framework.load import InflightLedger
from epp.framework.plugin import CycleState
from epp.framework.rendezvous import KV_SLACK, WAITING_SLACK, prefix_home, publish_home
from epp.framework.types import Endpoint, EndpointMetrics

ANCHORS = range(1, 401)  # stand-ins for the first block hashes of 400 different prefixes


def fleet(n: int, **metrics_of: EndpointMetrics) -> list[Endpoint]:
    endpoints = []
    for i in range(n):
        name = f"10.0.0.{i + 1}"
        endpoints.append(Endpoint(name, 8000, metrics=metrics_of.get(f"e{i}", EndpointMetrics())))
    return endpoints


def homes(endpoints: list[Endpoint], ledger: InflightLedger | None = None) -> dict[int, str]:
    ledger = ledger or InflightLedger()
    return {anchor: prefix_home(anchor, endpoints, ledger.load).name for anchor in ANCHORS}


def test_every_picker_computes_the_same_home_from_the_prefix_alone():
    # Two pickers with their own (empty) ledgers and their own endpoint objects, listed in another order.
    first, second = fleet(4), list(reversed(fleet(4)))
    assert homes(first, InflightLedger()) == homes(second, InflightLedger())


def test_homes_spread_over_the_endpoints():
    counts: dict[str, int] = {}
    for home in homes(fleet(4)).values():
        counts[home] = counts.get(home, 0) + 1
    assert len(counts) == 4
    assert min(counts.values()) >= 70, counts  # 100 each on average


def test_an_endpoint_leaving_moves_only_the_prefixes_it_was_home_to():
    before = homes(fleet(4))
    after = homes(fleet(4)[:3])
    gone = fleet(4)[3].name
    moved = {anchor for anchor in ANCHORS if before[anchor] != after[anchor]}
    assert moved == {anchor for anchor in ANCHORS if before[anchor] == gone}


def test_a_home_loaded_beyond_the_bound_is_passed_over_for_the_next_in_rank():
    endpoints = fleet(4)
    idle = homes(endpoints)
    busy = endpoints[0].name
    anchors = [a for a in ANCHORS if idle[a] == busy]
    ledger = InflightLedger()
    for _ in range(int(WAITING_SLACK)):  # within the bound: still home
        ledger.pick(busy, prompt_tokens=10)
    assert all(prefix_home(a, endpoints, ledger.load).name == busy for a in anchors)
    ledger.pick(busy, prompt_tokens=10)  # one more than the slack above the idle ones
    moved = {prefix_home(a, endpoints, ledger.load).name for a in anchors}
    assert busy not in moved and len(moved) > 1  # its prefixes spread over the others
    # Prefixes homed elsewhere keep their homes.
    assert all(prefix_home(a, endpoints, ledger.load).name == idle[a] for a in ANCHORS if idle[a] != busy)


def test_kv_cache_use_beyond_the_bound_passes_a_home_over():
    now = time.monotonic()
    full = EndpointMetrics(kv_cache_usage=0.1 + KV_SLACK + 0.05, update_time=now)
    fine = EndpointMetrics(kv_cache_usage=0.1 + KV_SLACK - 0.05, update_time=now)
    low = EndpointMetrics(kv_cache_usage=0.1, update_time=now)
    endpoints = fleet(3, e0=full, e1=fine, e2=low)
    chosen = set(homes(endpoints).values())
    assert chosen == {endpoints[1].name, endpoints[2].name}


def test_the_home_is_published_beside_the_match_info_not_in_it():
    state = CycleState()
    endpoints = fleet(4)
    name = publish_home(state, 7, endpoints, InflightLedger().load)
    assert state.all_endpoint_data(PREFIX_HOME) == {name: 1.0}
    assert publish_home(CycleState(), 7, [], InflightLedger().load) is None


async def test_the_approximate_producer_names_a_home_only_while_no_endpoint_holds_the_prefix():
    from epp.framework import ProfileRunResult, SchedulingResult
    from epp.framework.datakeys import PREFIX_MATCH_INFO
    from tests.support.scheduling import endpoint, make_plugin, request

    producer = make_plugin("approx-prefix-cache-producer", {"autoTune": False, "rendezvousHome": True})
    scorer = make_plugin("prefix-cache-scorer")
    eps = [endpoint(i) for i in range(4)]
    prompt = request("tenant 7 system prompt " * 40)
    state = CycleState()
    await producer.prepare(state, prompt, eps)
    [home] = state.all_endpoint_data(PREFIX_HOME)
    # The match info still says nothing is cached (bookings and accounting read it); the scorer scores the home.
    assert all(info.matched_blocks == 0 for info in state.all_endpoint_data(PREFIX_MATCH_INFO).values())
    assert scorer.score(state, prompt, eps) == {ep.name: 1.0 if ep.name == home else 0.0 for ep in eps}
    # A second producer (another picker) names the same home.
    other = CycleState()
    await make_plugin("approx-prefix-cache-producer", {"autoTune": False, "rendezvousHome": True}).prepare(
        other, prompt, eps)
    assert dict(other.all_endpoint_data(PREFIX_HOME)) == {home: 1.0}
    # Once routed somewhere (not the home, say), the history decides and no home is named.
    elsewhere = next(ep for ep in eps if ep.name != home)
    producer.pre_request(state, prompt, SchedulingResult({"default": ProfileRunResult((elsewhere,))}, "default"))
    after = CycleState()
    await producer.prepare(after, prompt, eps)
    assert not after.all_endpoint_data(PREFIX_HOME)
    assert scorer.score(after, prompt, eps)[elsewhere.name] == 1.0


@pytest.mark.parametrize("params", [{"rendezvousHome": False}, {}], ids=["off", "default"])
async def test_rendezvous_home_off_or_by_default_names_no_home(params):
    # Without the home new prefixes are placed by load, as GIE does.
    from tests.support.scheduling import endpoint, make_plugin, request

    producer = make_plugin("approx-prefix-cache-producer", {"autoTune": False, **params})
    state = CycleState()
    await producer.prepare(state, request("tenant 7 system prompt " * 40), [endpoint(i) for i in range(4)])
    assert not state.all_endpoint_data(PREFIX_HOME)
    gie = make_plugin("gie-approx-prefix-cache-producer", {"autoTune": False})
    await gie.prepare(state, request("tenant 7 system prompt " * 40), [endpoint(i) for i in range(4)])
    assert not state.all_endpoint_data(PREFIX_HOME)  # GIE's algorithm, unchanged


@pytest.mark.parametrize("params,homes", [({}, 0), ({"rendezvousHome": True}, 1)], ids=["default", "on"])
async def test_a_picker_with_peers_names_homes_only_when_asked(params, homes):
    from epp.framework import PluginContext
    from epp.framework.sharing import DecisionSharing
    from tests.support.scheduling import endpoint, make_plugin, request

    class Linked(DecisionSharing):
        """Stands for the peer link (epp.peer.PeerNode): a sharing service with peers."""

        @property
        def has_peers(self) -> bool:
            return True

    context = PluginContext(sharing=Linked())
    producer = make_plugin("approx-prefix-cache-producer", {"autoTune": False, **params}, context=context)
    state = CycleState()
    await producer.prepare(state, request("tenant 7 system prompt " * 40), [endpoint(i) for i in range(4)])
    assert len(state.all_endpoint_data(PREFIX_HOME)) == homes
