"""KV blocks are allocated chunk by chunk, as vLLM's `allocate_slots` does for each scheduled chunk.

A long prompt under a small token budget takes its blocks in the step that schedules each chunk:
the cached blocks it evicts for a chunk are removed in that step (not all at admission), each
step's batch lists that chunk's BlockRemoved before its BlockStored, and the stored blocks chain
on across chunks. The rest of the request is set aside at admission, so a later request cannot
take the blocks a running prefill still needs: it waits, and nothing is preempted.
"""

from __future__ import annotations

import asyncio

from epp.engine.kv_publisher import BlockRemoved, BlockStored
from epp.engine.sim.engine import EngineConfig, SimEngine
from epp.engine.sim.hashing import external_hash
from epp.engine.sim.profiles import FAST

BLOCK = 16
BUDGET = 64  # tokens per step: a 160-token prompt is prefilled in chunks of 64, 64 and 32


class _StepRecorder:
    """A publisher stand-in that keeps each step's events and the blocks in use when it was published."""

    def __init__(self, engine: SimEngine) -> None:
        self.engine = engine
        self.batches: list[list] = []
        self.used: list[int] = []
        self.on_batch = None

    def publish(self, events, ts=None) -> None:
        self.batches.append(list(events))
        self.used.append(self.engine.cache.used_blocks)
        if self.on_batch is not None:
            self.on_batch(len(self.batches))


def _engine() -> tuple[SimEngine, _StepRecorder]:
    # 13 blocks = 12 usable (vLLM's null block); a small budget forces chunked prefill.
    e = SimEngine(EngineConfig(profile=FAST, num_gpu_blocks=13, block_size=BLOCK, max_num_batched_tokens=BUDGET,
                               max_num_seqs=4), output_token_pool=[5, 6, 7])
    rec = _StepRecorder(e)
    e.publisher = rec
    return e, rec


async def _until_finished(*requests) -> None:
    while not all(r.finished for r in requests):
        await asyncio.sleep(0.001)


def _removed(batch) -> list[bytes]:
    return [h for ev in batch if isinstance(ev, BlockRemoved) for h in ev.block_hashes]


def _stored(batch) -> list[bytes]:
    return [h for ev in batch if isinstance(ev, BlockStored) for h in ev.block_hashes]


async def test_a_long_prompt_takes_its_blocks_chunk_by_chunk_evicting_as_each_chunk_is_scheduled():
    e, rec = _engine()
    e.start()
    try:
        old = e.new_request(list(range(1000, 1176)), 1)  # 11 blocks, cached and free once it finishes
        e.submit(old)
        await _until_finished(old)
        assert len(e.cache.free_lru) == 11 and e.cache.used_blocks == 0
        rec.batches.clear()
        rec.used.clear()
        long = e.new_request(list(range(2000, 2160)), 2)  # 10 prompt blocks + 1 for the decode token
        e.submit(long)
        await _until_finished(long)
    finally:
        await e.stop()
    prefill = rec.batches[:3]
    # Chunk 1 (4 blocks) takes the one never-used block and evicts 3; chunks 2 and 3 evict 4 and 2;
    # the decode token's block is evicted one step later, in a batch of removals only.
    assert [len(_removed(b)) for b in prefill] == [3, 4, 2]
    assert [len(_stored(b)) for b in prefill] == [4, 4, 2]
    assert rec.used[:3] == [4, 8, 10]  # blocks in use after each chunk
    assert len(_removed(rec.batches[3])) == 1 and not _stored(rec.batches[3])
    for batch in prefill:  # within a step, the chunk's evictions come before its stores
        kinds = [type(ev) for ev in batch]
        assert kinds == sorted(kinds, key=lambda k: k is BlockStored)
    # The old chain loses its tail first (it was freed tail first), one chunk's worth at a time.
    evicted = [h for b in rec.batches for h in _removed(b)]
    assert evicted == [external_hash(h) for h in reversed(old.hashes)][:10]
    assert old.hashes[0] in e.cache.cached  # the one block no chunk needed is still cached
    # The stored blocks chain across chunk boundaries: each chunk's first parent is the last stored block.
    stored_events = [ev for b in prefill for ev in b if isinstance(ev, BlockStored)]
    assert [ev.parent_block_hash for ev in stored_events[1:]] == [ev.block_hashes[-1] for ev in stored_events[:-1]]
    assert [h for ev in stored_events for h in ev.block_hashes] == [external_hash(h) for h in long.hashes[:10]]
    assert long.finish_reason == "length" and len(long.output) == 2


async def test_a_later_request_cannot_take_the_blocks_a_chunked_prefill_still_needs():
    e, rec = _engine()
    long = e.new_request(list(range(2000, 2160)), 2)  # 11 of the 12 blocks in the end
    small = e.new_request(list(range(3000, 3020)), 4)  # 2 blocks
    rec.on_batch = lambda n: e.submit(small) if n == 1 else None  # arrives after chunk 1
    e.start()
    try:
        e.submit(long)
        await _until_finished(long, small)
    finally:
        await e.stop()
    # After chunk 1 only 4 blocks were in use, but 7 more were set aside for the long request:
    # the small one waited for it to finish instead of taking them (and nothing was preempted).
    assert small.scheduled >= long.finished_at
    assert long.finish_reason == "length" and len(long.output) == 2
    assert small.finish_reason == "length" and len(small.output) == 4
    assert max(rec.used) == 10  # its prompt (the decode block came in its last step, freed with it)
    c = e.cache
    assert (c.used_blocks, c.private, c.promised) == (0, 0, 0)


async def test_aborting_a_request_mid_prefill_returns_the_blocks_it_never_allocated():
    e, rec = _engine()
    long = e.new_request(list(range(2000, 2160)), 2)
    rec.on_batch = lambda n: e.abort(long) if n == 1 else None  # after its first chunk
    e.start()
    try:
        e.submit(long)
        await _until_finished(long)
        await asyncio.sleep(0.01)
    finally:
        await e.stop()
    assert long.finish_reason == "abort"
    c = e.cache
    assert (c.used_blocks, c.private, c.promised) == (0, 0, 0)
    assert len(c.free_lru) >= 4  # the first chunk's blocks stay cached (vLLM cached them when it scheduled it)
    assert c.available() == c.capacity
