"""A late-starting subscriber rebuilds its view from a real vLLM replay exchange (captured frames)."""

from __future__ import annotations

import asyncio
import base64
import json
from pathlib import Path

import pytest
import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry

from epp.datalayer.registry import EndpointRegistry, EndpointSpec
from epp.kvevents.index import KVBlockIndex
from epp.kvevents.metrics import KVIndexMetrics, KVSubscriberMetrics
from epp.kvevents.subscriber import KVEventSubscriber, SubscriberConfig

CAPTURE = Path(__file__).parents[1] / "fixtures" / "vllm_capture"
pytestmark = pytest.mark.skipif(not (CAPTURE / "replay.json").exists(), reason="no vLLM capture recorded")


async def test_replay_of_captured_vllm_frames_rebuilds_the_index():
    manifest = json.loads((CAPTURE / "manifest.json").read_text())
    live = json.loads((CAPTURE / "events.json").read_text())
    replay = [[base64.b64decode(f) for f in msg] for msg in json.loads((CAPTURE / "replay.json").read_text())["messages_b64"]]
    requests = {r["name"]: r for r in json.loads((CAPTURE / "requests.json").read_text())}
    ctx = zmq.asyncio.Context()
    pub = ctx.socket(zmq.PUB)
    router = ctx.socket(zmq.ROUTER)
    for sock in (pub, router):
        sock.setsockopt(zmq.LINGER, 0)
    pub_port = pub.bind_to_random_port("tcp://127.0.0.1")
    replay_port = router.bind_to_random_port("tcp://127.0.0.1")

    async def serve_replay():
        while True:
            ident, _empty, start = await router.recv_multipart()
            assert int.from_bytes(start, "big") == 0
            for frames in replay:  # exactly what vLLM sent: ["", topic, seq8, payload] ... end marker
                await router.send_multipart([ident, *frames])

    server = asyncio.ensure_future(serve_replay())
    registry = CollectorRegistry()
    index = KVBlockIndex(manifest["block_size"], 10_000, metrics=KVIndexMetrics(registry))
    endpoints = EndpointRegistry()
    endpoints.set_endpoints([EndpointSpec("127.0.0.1", manifest["http_port"],
                                          {"kv-events-port": str(pub_port), "kv-replay-port": str(replay_port)})])
    name = endpoints.snapshot()[0].name
    sub = KVEventSubscriber(index, SubscriberConfig(replay_timeout_s=3.0), endpoints, KVSubscriberMetrics(registry))
    await sub.start()
    last = live[-1]
    final = requests["prefix_a_again"]["prompt_token_ids"]
    keys = index.keyer.request_keys(final, manifest["served_model_name"])
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 5
        while len(index.lookup(keys, [name]).get(name, [])) < len(final) // manifest["block_size"]:
            assert loop.time() < deadline, "index not rebuilt from replay"
            # the newest live batch: the subscriber joins late and asks for everything from 0
            await pub.send_multipart([last["topic"].encode(), last["seq"].to_bytes(8, "big"),
                                      base64.b64decode(last["payload_b64"])])
            await asyncio.sleep(0.02)
        assert registry.get_sample_value("epp_kv_events_replays_total", {"outcome": "ok"}) == 1
        assert registry.get_sample_value("epp_kv_events_messages_total", {"source": "replay"}) == len(replay) - 1
        assert (registry.get_sample_value("epp_kv_index_events_dropped_total", {"reason": "unknown_parent"})
                or 0) == 0
        # filler_5 was stored last before prefix_a_again and is still cached
        filler = requests["filler_5"]["prompt_token_ids"]
        assert len(index.lookup(index.keyer.request_keys(filler, "tiny"), [name]).get(name, [])) >= 1
    finally:
        await sub.stop()
        server.cancel()
        await asyncio.gather(server, return_exceptions=True)
        ctx.destroy(linger=0)
