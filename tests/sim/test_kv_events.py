"""KV events on the wire, read by a plain pyzmq SUB / DEALER and msgspec (no shared types)."""

from __future__ import annotations

import asyncio

import aiohttp
import msgspec
import pytest
import zmq
import zmq.asyncio

from epp.engine.kv_publisher import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventPublisher,
)
from epp.engine.sim import FleetConfig, SimFleet
from epp.engine.sim.hashing import block_hashes, external_hash, none_hash

END = b"\xff" * 8


async def replay(endpoint: str, start: int) -> list[list[bytes]]:
    """Ask the ROUTER for everything from `start`, as a DEALER: frames after the empty delimiter."""
    ctx = zmq.asyncio.Context.instance()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    try:
        await dealer.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        while True:
            frames = await asyncio.wait_for(dealer.recv_multipart(), 2)
            assert frames[0] == b""
            out.append(frames[1:])
            if frames[2] == END:
                return out
    finally:
        dealer.close(0)


async def test_publisher_wire_format_live_and_replay(subscriber_factory):
    pub = KVEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*", topic="kv@1.2.3.4:80@m")
    try:
        sub = subscriber_factory(pub.bound_endpoint, "kv@")
        await sub.ready()
        stored = BlockStored(block_hashes=[123], parent_block_hash=None, token_ids=[1, 2], block_size=2,
                             lora_id=None, medium="GPU", lora_name=None, extra_keys=[None], group_idx=0)
        pub.publish([stored], ts=1.5)
        pub.publish([BlockRemoved(block_hashes=[123], medium="GPU", group_idx=0)], ts=2.0)
        pub.publish([AllBlocksCleared()], ts=3.0)
        msgs = [await sub.recv() for _ in range(3)]
        assert [(t, s) for t, s, _ in msgs] == [("kv@1.2.3.4:80@m", 0), ("kv@1.2.3.4:80@m", 1), ("kv@1.2.3.4:80@m", 2)]
        assert msgs[0][2] == [1.5, [{"type": "BlockStored", "block_hashes": [123], "parent_block_hash": None,
                                     "token_ids": [1, 2], "block_size": 2, "lora_id": None, "medium": "GPU",
                                     "lora_name": None, "extra_keys": [None], "group_idx": 0}], 0]
        assert msgs[1][2][1] == [{"type": "BlockRemoved", "block_hashes": [123], "medium": "GPU", "group_idx": 0}]
        assert msgs[2][2][1] == [{"type": "AllBlocksCleared"}]
        frames = await replay(pub.replay_bound_endpoint, 1)
        assert [f[0] for f in frames[:-1]] == [b"kv@1.2.3.4:80@m"] * 2
        assert [int.from_bytes(f[1], "big") for f in frames[:-1]] == [1, 2]
        assert msgspec.msgpack.decode(frames[0][2])[1][0]["type"] == "BlockRemoved"
        assert frames[-1] == [b"", END, b""]
    finally:
        pub.close()


async def test_legacy_array_form(subscriber_factory):
    pub = KVEventPublisher("tcp://127.0.0.1:*", legacy_array_events=True)
    try:
        sub = subscriber_factory(pub.bound_endpoint)
        await sub.ready()
        pub.publish([BlockStored(block_hashes=[7], parent_block_hash=5, token_ids=[1], block_size=1, lora_id=None,
                                 medium="CPU", lora_name=None), AllBlocksCleared()], ts=1.0)
        _, seq, batch = await sub.recv()
        assert seq == 0
        assert batch[1] == [["BlockStored", [7], 5, [1], 1, None, "CPU", None], ["AllBlocksCleared"]]
    finally:
        pub.close()


@pytest.fixture
async def replica(tokenizer_dir):
    config = FleetConfig(replicas=1, tokenizer_dir=tokenizer_dir, num_gpu_blocks=24, cpu_blocks=8,
                         disk_blocks=100, lora_modules={"sql-lora": "/adapters/sql"}, enable_prompt_tokens_details=True)
    async with SimFleet(config) as fleet:
        yield fleet


async def test_replica_events_chain_carry_tokens_and_follow_eviction(replica, subscriber_factory, tokenizer):
    info = replica.info[0]
    assert info["kv_topic"] == f"kv@{info['endpoint']}@sim-model"
    sub = subscriber_factory(info["kv_events_endpoint"], "kv@")
    await sub.ready()
    prompt = "Select the invoices of every customer in the database order by the year. " * 4
    async with aiohttp.ClientSession() as http:
        base = f"http://{info['endpoint']}"
        async with http.post(base + "/tokenize", json={"prompt": prompt}) as r:
            ids = (await r.json())["tokens"]
        async with http.post(base + "/v1/completions", json={"prompt": prompt, "max_tokens": 1}) as r:
            assert r.status == 200
        await sub.drain()
        gpu = [e for e in sub.events() if e["type"] == "BlockStored" and e["medium"] == "GPU"]
        assert gpu, sub.events()
        first = gpu[0]
        n_full = len(ids) // 16
        assert first["parent_block_hash"] is None
        assert first["token_ids"] == ids[: n_full * 16]  # same block boundaries and token ids
        assert first["block_hashes"] == [external_hash(h) for h in block_hashes(ids, 16, root=none_hash())]
        assert first["block_size"] == 16 and first["extra_keys"] == [None] * n_full
        media = {e["medium"] for e in sub.events() if e["type"] == "BlockStored"}
        assert media == {"GPU", "CPU", "STORAGE"}
        # Fill the 24-block GPU cache with other prompts: the first chain gets evicted.
        for i in range(4):
            other = f"Question {i}: which product has the highest number of sales in group {i}? " * 4
            async with http.post(base + "/v1/completions", json={"prompt": other, "max_tokens": 1}) as r:
                assert r.status == 200
        await sub.drain()
        removed = {h for e in sub.events() if e["type"] == "BlockRemoved" and e["medium"] == "GPU"
                   for h in e["block_hashes"]}
        assert removed & set(first["block_hashes"])
        seqs = [s for _, s, _ in sub.messages]
        assert seqs == list(range(len(seqs)))
        # A later BlockStored whose parent is set continues a known chain.
        known = set()
        for e in sub.events():
            if e["type"] == "BlockStored" and e["medium"] == "GPU":
                assert e["parent_block_hash"] is None or e["parent_block_hash"] in known
                known.update(e["block_hashes"])
        # Sleep level 1: AllBlocksCleared.
        async with http.post(base + "/sleep?level=1") as r:
            assert r.status == 200
        await sub.drain()
        assert sub.events()[-1] == {"type": "AllBlocksCleared"}
    frames = await replay(info["kv_replay_endpoint"], 0)
    assert len(frames) == len(sub.messages) + 1
    assert [msgspec.msgpack.decode(f[2]) for f in frames[:-1]] == [b for _, _, b in sub.messages]


async def test_cache_salt_appears_in_first_block_extra_keys(replica, subscriber_factory):
    info = replica.info[0]
    sub = subscriber_factory(info["kv_events_endpoint"])
    await sub.ready()
    body = {"prompt": "tenant data " * 20, "max_tokens": 1, "cache_salt": "tenant-a"}
    async with aiohttp.ClientSession() as http, http.post(f"http://{info['endpoint']}/v1/completions", json=body) as r:
        assert r.status == 200
    await sub.drain()
    ev = next(e for e in sub.events() if e["type"] == "BlockStored" and e["medium"] == "GPU")
    assert ev["extra_keys"][0] == ["tenant-a"] and all(k is None for k in ev["extra_keys"][1:])


async def test_publisher_connects_for_a_concrete_endpoint_like_vllm():
    """A concrete tcp address makes the PUB connect (centralized mode: the consumer binds)."""
    ctx = zmq.asyncio.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    pub = KVEventPublisher(f"tcp://127.0.0.1:{port}", topic="t")
    try:
        assert pub.bound_endpoint == f"tcp://127.0.0.1:{port}"
        # A connecting PUB joins late and drops what it sends before: publish until one arrives.
        sent = 0
        for _ in range(50):
            pub.publish([AllBlocksCleared()])
            sent += 1
            if await sub.poll(100):
                break
        topic, seq, payload = await sub.recv_multipart()
        assert topic == b"t" and int.from_bytes(seq, "big") < sent
        assert msgspec.msgpack.decode(payload)[1] == [{"type": "AllBlocksCleared"}]
    finally:
        pub.close()
        sub.close(0)


async def test_sim_state_reports_tiers_and_event_counts(replica):
    info = replica.info[0]
    async with aiohttp.ClientSession() as http:
        async with http.post(f"http://{info['endpoint']}/v1/completions",
                             json={"prompt": "count me " * 30, "max_tokens": 2}) as r:
            assert r.status == 200
        await asyncio.sleep(0.1)
        async with http.get(f"http://{info['endpoint']}/sim/state") as r:
            state = await r.json()
    assert state["gpu"]["capacity"] == 23 and state["gpu"]["cached"] > 0
    assert state["cpu"]["blocks"] > 0 and state["disk"]["blocks"] > 0
    assert state["kv_events"]["published"] >= 1 and state["kv_events"]["dropped"] == 0


async def test_lora_requests_hash_differently_and_name_the_adapter(replica, subscriber_factory):
    info = replica.info[0]
    sub = subscriber_factory(info["kv_events_endpoint"])
    await sub.ready()
    prompt = "adapter data " * 20
    async with aiohttp.ClientSession() as http:
        for model in ("sim-model", "sql-lora"):
            body = {"prompt": prompt, "max_tokens": 1, "model": model}
            async with http.post(f"http://{info['endpoint']}/v1/completions", json=body) as r:
                assert r.status == 200
                assert (await r.json())["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    await sub.drain()
    base, lora = [e for e in sub.events() if e["type"] == "BlockStored" and e["medium"] == "GPU"]
    assert base["lora_name"] is None and lora["lora_name"] == "sql-lora"
    assert base["token_ids"] == lora["token_ids"]
    assert not set(base["block_hashes"]) & set(lora["block_hashes"])
    assert all(k == ["sql-lora"] for k in lora["extra_keys"])
