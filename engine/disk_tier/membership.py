"""Which block hashes a disk-tier file holds, learned from vLLM's own STORAGE BlockStored events.

With chunked offload (`--offload-block-size` > `--block-size`) one file holds a chunk of several
blocks, named by the chunk's last block hash (vLLM: "each chunk's final raw hash is its
OffloadKey"), while vLLM's self-describing events announce every constituent block hash. So
that our BlockRemoved fans out to the same hashes, the manager follows the replica's KV events
and remembers, per (last hash, group), the hashes of each STORAGE BlockStored. Without a record
(one block per file, or an event missed before start) the file's own hash is used.
"""

from __future__ import annotations

import asyncio
import collections
import logging

import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry, Counter, Gauge

from epp.kvevents.decoding import BlockStored, KVEventDecodeError, Tier, decode_batch

log = logging.getLogger(__name__)

END_SEQ = b"\xff" * 8


class ChunkMembership:
    """Bounded LRU map (last block hash, group) → constituent block hashes of a disk-tier chunk."""

    def __init__(self, capacity: int = 1_000_000, registry: CollectorRegistry | None = None):
        self.capacity = capacity
        self._chunks: collections.OrderedDict[tuple[int, int | None], tuple[int, ...]] = collections.OrderedDict()
        reg = registry or CollectorRegistry()
        self._size = Gauge("epp_disk_tier_chunk_records", "Chunk membership records held", registry=reg)
        self._evicted = Counter("epp_disk_tier_chunk_records_evicted", "Records dropped at capacity",
                                registry=reg)
        self.events_seen = Counter("epp_disk_tier_storage_events_seen",
                                   "STORAGE BlockStored events read from vLLM", registry=reg)

    def __len__(self) -> int:
        return len(self._chunks)

    def record(self, block_hashes: tuple[int, ...], group_idx: int | None) -> None:
        """Remember a chunk's blocks under its last hash."""
        if not block_hashes:
            return
        key = (block_hashes[-1], group_idx)
        self._chunks[key] = tuple(block_hashes)
        self._chunks.move_to_end(key)
        while len(self._chunks) > self.capacity:
            self._chunks.popitem(last=False)
            self._evicted.inc()
        self._size.set(len(self._chunks))

    def hashes_for(self, file_hash: int, group_idx: int | None) -> tuple[int, ...]:
        """The block hashes a file named by `file_hash` holds (the hash alone if unknown)."""
        return self._chunks.get((file_hash, group_idx), (file_hash,))

    def forget(self, file_hash: int, group_idx: int | None) -> None:
        """Drop a chunk once its file is gone."""
        self._chunks.pop((file_hash, group_idx), None)
        self._size.set(len(self._chunks))

    def apply_payload(self, payload: bytes) -> None:
        """Record every disk-tier BlockStored of one vLLM batch payload."""
        try:
            batch = decode_batch(payload)
        except KVEventDecodeError:
            return
        for event in batch.events:
            if isinstance(event, BlockStored) and event.tier == Tier.DISK and event.block_hashes:
                self.events_seen.inc()
                self.record(tuple(event.block_hashes), event.group_idx)


async def follow_vllm_events(
    membership: ChunkMembership, endpoint: str, stop: asyncio.Event, *, topic: str = "",
    replay_endpoint: str | None = None, replay_timeout_s: float = 5.0,
) -> None:
    """SUB to the replica's KV events (after a replay from seq 0, if a replay endpoint is given)."""
    ctx = zmq.asyncio.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
    sub.connect(endpoint)
    try:
        if replay_endpoint:
            await _replay(membership, ctx, replay_endpoint, replay_timeout_s)
        while not stop.is_set():
            if not await sub.poll(500):
                continue
            frames = await sub.recv_multipart()
            if len(frames) == 3:
                membership.apply_payload(frames[2])
    finally:
        sub.close(0)


async def _replay(membership: ChunkMembership, ctx: zmq.asyncio.Context, endpoint: str, timeout_s: float) -> None:
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    try:
        await dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        while await dealer.poll(int(timeout_s * 1000)):
            frames = await dealer.recv_multipart()
            if len(frames) >= 4 and frames[-2] == END_SEQ:
                return
            if len(frames) >= 4:
                membership.apply_payload(frames[-1])
        log.warning("KV replay from %s timed out; chunk membership starts from live events", endpoint)
    finally:
        dealer.close(0)
