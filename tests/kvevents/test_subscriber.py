"""The ZMQ subscriber against real pyzmq sockets on 127.0.0.1: order, gaps, restarts, replay."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry

from epp.datalayer.registry import EndpointRegistry, EndpointSpec
from epp.kvevents.decoding import Tier
from epp.kvevents.index import KVBlockIndex
from epp.kvevents.metrics import KVIndexMetrics, KVSubscriberMetrics
from epp.kvevents.subscriber import KVEventSubscriber, SubscriberConfig
from tests.kvevents import wire
from tests.kvevents.publisher import FakePublisher
from tests.support.wait import wait_until

MODEL = "m"
BS = 4


def tokens_of(prompt: int, n_blocks: int) -> list[int]:
    return [prompt * 1000 + i for i in range(n_blocks * BS)]


def block_event(prompt: int, block: int):
    """Block `block` of prompt `prompt`, chained on its previous block (engine hash = p*100+b)."""
    toks = tokens_of(prompt, block + 1)[block * BS:]
    parent = None if block == 0 else prompt * 100 + block - 1
    return wire.stored([prompt * 100 + block], toks, parent=parent, block_size=BS)


class Rig:
    """A registry with one endpoint, an index, a subscriber (per-endpoint mode) and a publisher."""

    def __init__(self, *, replay=True, buffer_steps=10_000, cooldown=30.0, apply_budget_s=None):
        self.registry = CollectorRegistry()
        self.index = KVBlockIndex(BS, 10_000, metrics=KVIndexMetrics(self.registry))
        self.endpoints = EndpointRegistry()
        self.pub = FakePublisher(f"kv@127.0.0.1:9000@{MODEL}", replay=replay, buffer_steps=buffer_steps)
        labels = {"kv-events-port": str(self.pub.port)}
        if replay:
            labels["kv-replay-port"] = str(self.pub.replay_port)
        self.name = "127.0.0.1:9000"
        self.endpoints.set_endpoints([EndpointSpec("127.0.0.1", 9000, labels)])
        self.sub = KVEventSubscriber(
            self.index, SubscriberConfig(mode="per-endpoint", replay_timeout_s=2.0, replay_cooldown_s=cooldown,
                                         **({} if apply_budget_s is None else {"apply_budget_s": apply_budget_s})),
            self.endpoints, KVSubscriberMetrics(self.registry))

    def metric(self, name, labels=None):
        return self.registry.get_sample_value(name, labels or {}) or 0.0

    def matched(self, prompt: int, n_blocks: int) -> int:
        keys = self.index.keyer.request_keys(tokens_of(prompt, n_blocks), MODEL)
        return len(self.index.lookup(keys, [self.name]).get(self.name, []))

    async def connect(self):
        await self.sub.start()
        await self.pub.heartbeat_until(lambda: self.metric("epp_kv_events_messages_total", {"source": "live"}) > 0)
        await wait_until(lambda: not self.sub._streams[self.name].repairing)

    async def close(self):
        await self.sub.stop()
        await self.pub.close()


@pytest.fixture
async def rig_factory():
    rigs = []

    def make(**kw):
        rig = Rig(**kw)
        rigs.append(rig)
        return rig

    yield make
    for rig in rigs:
        await rig.close()


async def test_in_order_batches_are_applied_without_replay(rig_factory):
    rig = rig_factory(replay=False)
    await rig.connect()
    for block in range(3):
        await rig.pub.publish([block_event(1, block)])
    await wait_until(lambda: rig.matched(1, 3) == 3)
    assert rig.metric("epp_kv_events_sequence_gaps_total") == 0


async def test_a_sequence_gap_is_repaired_through_the_replay_socket(rig_factory):
    rig = rig_factory()
    await rig.connect()
    await rig.pub.publish([block_event(1, 0)])
    await rig.pub.publish([block_event(1, 1)], send=False)  # lost on the wire
    await rig.pub.publish([block_event(1, 2)])
    await wait_until(lambda: rig.matched(1, 3) == 3)
    assert rig.metric("epp_kv_events_sequence_gaps_total") == 1
    assert rig.metric("epp_kv_events_replays_total", {"outcome": "ok"}) == 2  # initial + gap
    assert rig.metric("epp_kv_events_endpoint_resets_total", {"reason": "gap_unrepairable"}) == 0


async def test_a_publisher_restart_clears_the_endpoint_and_rebuilds_from_replay(rig_factory):
    rig = rig_factory(cooldown=0.0)
    await rig.connect()
    await rig.pub.publish([block_event(1, 0), block_event(1, 1)])
    await wait_until(lambda: rig.matched(1, 2) == 2)
    rig.pub.restart()
    await rig.pub.publish([block_event(2, 0)], send=False)  # seq 0 of the new process, missed
    await rig.pub.publish([block_event(2, 1)])
    await wait_until(lambda: rig.matched(2, 2) == 2)
    assert rig.matched(1, 2) == 0  # the old process's cache is gone
    assert rig.metric("epp_kv_events_publisher_restarts_total") == 1


async def test_a_late_starting_subscriber_rebuilds_its_view_from_replay(rig_factory):
    rig = rig_factory()
    for block in range(4):  # published before anyone listens
        await rig.pub.publish([block_event(3, block)])
    await rig.connect()
    await wait_until(lambda: rig.matched(3, 4) == 4)
    assert rig.metric("epp_kv_index_events_dropped_total", {"reason": "unknown_parent"}) == 0


async def test_a_replay_counts_as_ok_only_once_every_replayed_batch_is_applied(rig_factory):
    rig = rig_factory(apply_budget_s=0.0)  # the subscriber yields to the loop after every batch
    for block in range(20):
        await rig.pub.publish([block_event(4, block)])
    seen_when_counted = []

    async def watch():
        while rig.metric("epp_kv_events_replays_total", {"outcome": "ok"}) == 0:
            await asyncio.sleep(0)
        seen_when_counted.append(rig.matched(4, 20))

    watcher = asyncio.create_task(watch())
    await rig.connect()
    await asyncio.wait_for(watcher, 5)
    assert seen_when_counted == [20]


async def test_an_unrepairable_gap_drops_the_endpoints_entries_and_says_so(rig_factory):
    rig = rig_factory(buffer_steps=1)  # the publisher keeps only the newest batch
    await rig.connect()
    await rig.pub.publish([block_event(1, 0), block_event(1, 1)])
    await wait_until(lambda: rig.matched(1, 2) == 2)
    await rig.pub.publish([block_event(2, 0)], send=False)
    await rig.pub.publish([block_event(4, 0)])
    await wait_until(lambda: rig.metric("epp_kv_events_endpoint_resets_total", {"reason": "gap_unrepairable"}) == 1)
    await wait_until(lambda: rig.matched(4, 1) == 1)
    assert rig.matched(1, 2) == 0
    assert rig.metric("epp_kv_events_replays_total", {"outcome": "failed"}) == 1


async def test_gap_without_a_replay_socket_is_a_reset(rig_factory):
    rig = rig_factory(replay=False)
    await rig.connect()
    await rig.pub.publish([block_event(1, 0)])
    await wait_until(lambda: rig.matched(1, 1) == 1)
    await rig.pub.publish([], send=False)
    await rig.pub.publish([block_event(4, 0)])
    await wait_until(lambda: rig.matched(4, 1) == 1)
    assert rig.matched(1, 1) == 0
    assert rig.metric("epp_kv_events_endpoint_resets_total", {"reason": "gap_unrepairable"}) == 1


async def test_endpoint_removal_closes_the_subscription_and_drops_entries(rig_factory):
    rig = rig_factory()
    await rig.connect()
    await rig.pub.publish([block_event(1, 0)])
    await wait_until(lambda: rig.matched(1, 1) == 1)
    rig.endpoints.set_endpoints([])
    await wait_until(lambda: rig.matched(1, 1) == 0)
    assert rig.metric("epp_kv_events_subscriptions") == 0


async def test_centralized_mode_binds_and_routes_by_topic():
    registry = CollectorRegistry()
    index = KVBlockIndex(BS, 1000, metrics=KVIndexMetrics(registry))
    endpoints = EndpointRegistry()
    endpoints.set_endpoints([EndpointSpec("127.0.0.1", 9001), EndpointSpec("127.0.0.2", 9002)])
    sub = KVEventSubscriber(index, SubscriberConfig(mode="centralized", bind_endpoint="tcp://127.0.0.1:0"),
                            endpoints, KVSubscriberMetrics(registry))
    await sub.start()
    pubs = [FakePublisher("kv@127.0.0.1:9001@m", replay=False, connect_to=sub.bound_address),
            FakePublisher("kv@127.0.0.2@m", replay=False, connect_to=sub.bound_address)]  # IP-only topic
    try:
        def live() -> float:
            return registry.get_sample_value("epp_kv_events_messages_total", {"source": "live"}) or 0

        for pub in pubs:
            before = live()
            await pub.heartbeat_until(lambda before=before: live() > before)
        await pubs[0].publish([block_event(1, 0)])
        await pubs[1].publish([block_event(2, 0), block_event(2, 1)])
        keys1 = index.keyer.request_keys(tokens_of(1, 1), MODEL)
        keys2 = index.keyer.request_keys(tokens_of(2, 2), MODEL)
        await wait_until(lambda: index.lookup(keys2) == {"127.0.0.2:9002": [Tier.GPU, Tier.GPU]})
        assert index.lookup(keys1) == {"127.0.0.1:9001": [Tier.GPU]}
    finally:
        await sub.stop()
        for pub in pubs:
            await pub.close()
