"""Chunk files (several blocks per file): removals fan out to every block vLLM announced for the chunk."""

from __future__ import annotations

import asyncio

import msgspec
from disk_tier_files import block_hash_int, write_block

from epp.engine.disk_tier.manager import DiskTierConfig, DiskTierManager
from epp.engine.disk_tier.membership import ChunkMembership, follow_vllm_events
from epp.engine.kv_publisher import MEDIUM_GPU, MEDIUM_STORAGE, BlockStored, KVEventPublisher
from tests.support.wait import wait_until

KB = 1024


class ListSink:
    def __init__(self):
        self.events = []

    def publish(self, events, ts=None):
        self.events.extend(events)


def _stored(hashes, medium, group=0):
    return BlockStored(block_hashes=list(hashes), parent_block_hash=None, token_ids=[1] * 32 * len(hashes),
                       block_size=32, lora_id=None, medium=medium, lora_name=None, group_idx=group)


async def test_removal_of_a_chunk_file_names_every_block_vllm_stored_in_it(tmp_path):
    # "vLLM": a publisher announcing chunk (b0, b1, b2) on disk; the file is named by b2.
    vllm = KVEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*", topic="kv@h:1@m")
    chunk = [block_hash_int(100), block_hash_int(101), block_hash_int(2)]
    vllm.publish([_stored(chunk, MEDIUM_STORAGE), _stored([block_hash_int(50)], MEDIUM_GPU)])
    membership = ChunkMembership()
    stop = asyncio.Event()
    # Started after the event was published: the replay from seq 0 brings it.
    follower = asyncio.create_task(follow_vllm_events(
        membership, vllm.bound_endpoint, stop, topic="kv@h:1@m", replay_endpoint=vllm.replay_bound_endpoint))
    try:
        await wait_until(lambda: len(membership) == 1, "the chunk to be learnt")
        vllm.publish([_stored([block_hash_int(200), block_hash_int(3)], MEDIUM_STORAGE)])  # live
        await wait_until(lambda: len(membership) == 2, "the second chunk to be learnt")
    finally:
        stop.set()
        await follower
        vllm.close()
    for i in range(4):
        write_block(tmp_path, i, 30 * KB, age_s=1000 - i)  # 120 KB >= 85 % of 100 KB
    sink = ListSink()
    manager = DiskTierManager(DiskTierConfig(root=tmp_path, budget_bytes=100 * KB, min_free_bytes=0), sink,
                              membership=membership)
    await manager.run_cycle()  # 120 KB down to <= 50 KB: files 0, 1 and 2 (oldest first)
    removed = [e.block_hashes[0] for e in sink.events]
    assert removed == [block_hash_int(0), block_hash_int(1), *chunk]
    assert all(e.medium == MEDIUM_STORAGE and e.group_idx == 0 for e in sink.events)
    assert len(membership) == 1  # the chunk's record went with its file; file 3's stays


def test_gpu_events_and_garbage_do_not_create_records():
    membership = ChunkMembership()
    encoder = msgspec.msgpack.Encoder()
    payload = encoder.encode([1.0, [{"type": "BlockStored", "block_hashes": [7], "parent_block_hash": None,
                                     "token_ids": [], "block_size": 0, "lora_id": None, "medium": "GPU",
                                     "lora_name": None}], 0])
    membership.apply_payload(payload)
    membership.apply_payload(b"not msgpack at all \xc1")
    assert len(membership) == 0
    assert membership.hashes_for(7, None) == (7,)


def test_membership_is_bounded():
    membership = ChunkMembership(capacity=2)
    for i in range(5):
        membership.record((i, i + 100), 0)
    assert len(membership) == 2 and membership.hashes_for(104, 0) == (4, 104)
    assert membership.hashes_for(100, 0) == (100,)
