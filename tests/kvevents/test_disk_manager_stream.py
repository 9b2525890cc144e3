"""A replica's second publisher (the disk-tier manager) feeds the same endpoint without disturbing it."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry

from epp.datalayer.registry import EndpointRegistry, EndpointSpec
from epp.kvevents.decoding import Tier
from epp.kvevents.index import KVBlockIndex
from epp.kvevents.metrics import KVIndexMetrics, KVSubscriberMetrics
from epp.kvevents.subscriber import KVEventSubscriber, SubscriberConfig
from tests.support.wait import wait_until

kv_publisher = pytest.importorskip("epp.engine.kv_publisher")

TOPIC = "kv@127.0.0.1:8000@m"
TOKENS = list(range(1, 33))
ENDPOINT = "127.0.0.1:8000"


@pytest.fixture
async def setup():
    engine = kv_publisher.KVEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*", topic=TOPIC)
    disk = kv_publisher.KVEventPublisher("tcp://127.0.0.1:*", topic=TOPIC)
    registry = CollectorRegistry()
    index = KVBlockIndex(16, 1000, metrics=KVIndexMetrics(registry))
    endpoints = EndpointRegistry()
    endpoints.set_endpoints([EndpointSpec("127.0.0.1", 8000, {
        "kv-events-port": str(engine.port), "kv-replay-port": str(engine.replay_port),
        "kv-disk-events-port": str(disk.port)})])
    sub = KVEventSubscriber(index, SubscriberConfig(replay_timeout_s=2.0), endpoints, KVSubscriberMetrics(registry))
    await sub.start()
    await asyncio.sleep(0.2)  # SUB sockets attach to both publishers
    yield engine, disk, index, registry, sub
    await sub.stop()
    engine.close()
    disk.close()


def tiers(index: KVBlockIndex) -> list[list[Tier]]:
    keys = index.keyer.request_keys(TOKENS, "m")
    return index.lookup(keys).get(ENDPOINT, [])


async def test_disk_removals_from_the_manager_update_the_engines_blocks(setup):
    engine, disk, index, registry, sub = setup
    engine.publish([kv_publisher.BlockStored([11, 12], None, TOKENS, 16, None, "GPU", None),
                    kv_publisher.BlockStored([11, 12], None, TOKENS, 16, None, "STORAGE", None)])
    await wait_until(lambda: len(tiers(index)) == 2 and index.tiers_of(index.keyer.request_keys(TOKENS, "m")[0],
                                                                    ENDPOINT) == {Tier.GPU, Tier.DISK})
    disk.publish([kv_publisher.BlockRemoved([11, 12], "STORAGE")])
    key = index.keyer.request_keys(TOKENS, "m")[0]
    await wait_until(lambda: index.tiers_of(key, ENDPOINT) == {Tier.GPU})
    assert len(tiers(index)) == 2  # the GPU copies stay routable


async def test_a_restarted_disk_manager_never_clears_the_engines_view(setup):
    engine, disk, index, registry, sub = setup
    engine.publish([kv_publisher.BlockStored([11, 12], None, TOKENS, 16, None, "GPU", None)])
    await wait_until(lambda: len(tiers(index)) == 2)
    for _ in range(60):  # a long history, so the restarted publisher's sequence clearly goes back
        disk.publish([kv_publisher.BlockRemoved([999], "STORAGE")])
    await asyncio.sleep(0.2)
    disk.close()
    restarted = kv_publisher.KVEventPublisher(f"tcp://127.0.0.1:{disk.port}", topic=TOPIC, bind=True)  # seq from 0
    try:
        for _ in range(50):  # PUB drops what it sends before the SUB has reconnected
            restarted.publish([kv_publisher.BlockRemoved([998], "STORAGE")])
            await asyncio.sleep(0.05)
            if (registry.get_sample_value("epp_kv_events_publisher_restarts_total") or 0) >= 1:
                break
        assert registry.get_sample_value("epp_kv_events_publisher_restarts_total") >= 1
        assert len(tiers(index)) == 2
        assert (registry.get_sample_value("epp_kv_events_endpoint_resets_total",
                                          {"reason": "gap_unrepairable"}) or 0) == 0
    finally:
        restarted.close()
