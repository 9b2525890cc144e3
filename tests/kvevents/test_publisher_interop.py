"""Interop: our subscriber and index against the project's vLLM-wire publisher (engine/kv_publisher.py)."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry

from epp.datalayer.registry import EndpointRegistry, EndpointSpec
from epp.kvevents.index import KVBlockIndex
from epp.kvevents.metrics import KVIndexMetrics, KVSubscriberMetrics
from epp.kvevents.subscriber import KVEventSubscriber, SubscriberConfig

kv_publisher = pytest.importorskip("epp.engine.kv_publisher")

TOKENS = list(range(1, 65))


@pytest.mark.parametrize("legacy", [False, True])
async def test_events_published_before_the_subscriber_starts_are_rebuilt_from_replay(legacy):
    pub = kv_publisher.KVEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*",
                                        topic="kv@127.0.0.1:8000@m", legacy_array_events=legacy)
    registry = CollectorRegistry()
    index = KVBlockIndex(16, 1000, metrics=KVIndexMetrics(registry))
    endpoints = EndpointRegistry()
    endpoints.set_endpoints([EndpointSpec("127.0.0.1", 8000, {"kv-events-port": str(pub.port),
                                                            "kv-replay-port": str(pub.replay_port)})])
    sub = KVEventSubscriber(index, SubscriberConfig(replay_timeout_s=2.0), endpoints, KVSubscriberMetrics(registry))
    try:
        pub.publish([kv_publisher.BlockStored([11, 12], None, TOKENS[:32], 16, None, "GPU", None)])
        await asyncio.sleep(0.05)
        await sub.start()
        keys = index.keyer.request_keys(TOKENS, "m")
        parent, n = 12, 0
        while len(index.lookup(keys).get("127.0.0.1:8000", [])) < 3:
            # a live event (chained on the last one) makes the late subscriber replay from 0
            if n < 40:
                n += 1
                pub.publish([kv_publisher.BlockStored([100 + n], parent, TOKENS[32:48], 16, None, "CPU", None)])
            await asyncio.sleep(0.05)
            assert n < 40 or len(index.lookup(keys).get("127.0.0.1:8000", [])) >= 3
        assert registry.get_sample_value("epp_kv_events_replays_total", {"outcome": "ok"}) >= 1
    finally:
        await sub.stop()
        pub.close()
