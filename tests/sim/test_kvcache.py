"""The simulated KV cache: vLLM block hashes, LRU of unreferenced blocks, tiers and their events."""

from __future__ import annotations

from epp.engine.kv_publisher import AllBlocksCleared, BlockRemoved, BlockStored
from epp.engine.sim.hashing import NO_CONTEXT, HashContext, block_hashes, external_hash
from epp.engine.sim.kvcache import BlockInfo, KVCache, TierConfig

BS = 4


def chain(tokens: list[int], ctx: HashContext = NO_CONTEXT) -> list[BlockInfo]:
    hashes = block_hashes(tokens, BS, ctx)
    return [BlockInfo(h, hashes[i - 1] if i else None, tuple(tokens[i * BS:(i + 1) * BS]), ctx.event_extra_keys(i))
            for i, h in enumerate(hashes)]


def run_request(cache: KVCache, tokens: list[int], total_blocks: int | None = None) -> list[BlockInfo]:
    """Admit a request whose whole prompt is computed, commit its blocks; returns what it holds."""
    blocks = chain(tokens)
    total = total_blocks or len(blocks)
    hit = cache.lookup([b.digest for b in blocks])
    held = cache.admit(hit, total)
    held += cache.commit(blocks[len(held):])
    return held


def test_hashes_match_vllm_sha256_test_vectors():
    hashes = block_hashes(list(range(1, 33)), 16)
    assert [external_hash(h) for h in hashes] == [1403909460543360175, 1643945449041937783]
    salted = block_hashes(list(range(1, 17)), 16, HashContext(cache_salt="tenant-a"))
    assert external_hash(salted[0]) == 14725353451287653808


def test_only_full_blocks_are_hashed_and_salt_changes_the_whole_chain():
    assert len(block_hashes(list(range(10)), BS)) == 2
    plain = block_hashes(list(range(12)), BS)
    salted = block_hashes(list(range(12)), BS, HashContext(cache_salt="s"))
    assert all(a != b for a, b in zip(plain, salted))  # the salt enters block 0, the chain carries it
    ctx = HashContext(cache_salt="s", lora_name="ad", lora_path="/p")
    assert ctx.extra_keys(0) == (("lora", "ad", "/p"), ("cache_salt", "s"))
    assert ctx.extra_keys(1) == (("lora", "ad", "/p"),)
    assert ctx.event_extra_keys(0) == ("ad", "s")


def test_partial_prefix_reuse_finds_the_shared_leading_blocks():
    cache = KVCache(num_gpu_blocks=16, block_size=BS)
    held = run_request(cache, list(range(16)))
    cache.release(held, 0)
    other = list(range(8)) + [99] * 8  # shares two blocks, then diverges
    hit = cache.lookup([b.digest for b in chain(other)])
    assert len(hit.gpu) == 2


def test_lru_evicts_unreferenced_blocks_oldest_first_and_tails_first():
    cache = KVCache(num_gpu_blocks=6, block_size=BS)
    a = run_request(cache, list(range(100, 112)))   # 3 blocks
    cache.release(a, 0)
    b = run_request(cache, list(range(200, 212)))   # 3 blocks, pool now full
    cache.release(b, 0)
    cache.take_events()
    c = run_request(cache, list(range(300, 308)))   # needs 2: evicts a's tail first
    removed = [ev for ev in cache.take_events() if isinstance(ev, BlockRemoved)]
    a_hashes = [external_hash(x.digest) for x in a]
    assert [ev.block_hashes for ev in removed] == [[a_hashes[2]], [a_hashes[1]]]  # one event per block
    assert removed[0].medium == "GPU"
    hit = cache.lookup([x.digest for x in chain(list(range(100, 112)))])
    assert len(hit.gpu) == 1  # a's first block survived
    cache.release(c, 0)


def test_referenced_blocks_are_never_evicted_and_admission_waits():
    cache = KVCache(num_gpu_blocks=4, block_size=BS)
    held = run_request(cache, list(range(16)))  # 4 blocks, all referenced
    blocks = chain(list(range(50, 58)))
    hit = cache.lookup([b.digest for b in blocks])
    assert not cache.can_admit(hit, 2)
    assert cache.usage == 1.0
    cache.release(held, 0)
    assert cache.usage == 0.0
    assert cache.can_admit(hit, 2)


def test_reused_cached_block_counts_against_the_room_it_frees():
    cache = KVCache(num_gpu_blocks=2, block_size=BS)
    held = run_request(cache, list(range(8)))
    cache.release(held, 0)
    # A request hitting both cached blocks and needing 1 more does not fit in 2 blocks.
    hit = cache.lookup([b.digest for b in chain(list(range(8)))])
    assert len(hit.gpu) == 2
    assert not cache.can_admit(hit, 3)
    assert cache.can_admit(hit, 2)


def test_blocks_are_copied_to_cpu_and_written_through_to_disk_with_full_token_ids():
    cache = KVCache(num_gpu_blocks=8, block_size=BS, tiers=TierConfig(cpu_blocks=4, disk_blocks=100))
    run_request(cache, list(range(8)))
    events = cache.take_events()
    stored = {ev.medium: ev for ev in events if isinstance(ev, BlockStored)}
    assert set(stored) == {"GPU", "CPU", "STORAGE"}
    for ev in stored.values():
        assert ev.token_ids == list(range(8))
        assert ev.block_size == BS
        assert ev.parent_block_hash is None
    assert stored["CPU"].block_hashes == stored["GPU"].block_hashes == stored["STORAGE"].block_hashes


def test_cpu_is_lru_and_disk_can_take_only_cpu_evictions():
    tiers = TierConfig(cpu_blocks=2, disk_blocks=100, disk_write_through=False)
    cache = KVCache(num_gpu_blocks=16, block_size=BS, tiers=tiers)
    held = run_request(cache, list(range(16)))  # 4 blocks; CPU keeps the last 2
    events = cache.take_events()
    removed_cpu = [ev for ev in events if isinstance(ev, BlockRemoved) and ev.medium == "CPU"]
    assert [h for ev in removed_cpu for h in ev.block_hashes] == [external_hash(b.digest) for b in held[:2]]
    on_disk = [ev for ev in events if isinstance(ev, BlockStored) and ev.medium == "STORAGE"]
    assert [h for ev in on_disk for h in ev.block_hashes] == [external_hash(b.digest) for b in held[:2]]
    assert set(cache.cpu.blocks) == {b.digest for b in held[2:]}


def test_lookup_goes_gpu_then_cpu_then_disk_and_promotes_hits():
    tiers = TierConfig(cpu_blocks=2, disk_blocks=100)
    cache = KVCache(num_gpu_blocks=4, block_size=BS, tiers=tiers)
    first = run_request(cache, list(range(16)))   # 4 blocks: GPU full, CPU has the last 2, disk all 4
    cache.release(first, 0)
    run_request_blocks = run_request(cache, list(range(500, 516)))  # evicts all of `first` from GPU
    cache.release(run_request_blocks, 0)
    cache.take_events()
    blocks = chain(list(range(16)))
    hit = cache.lookup([b.digest for b in blocks])
    assert (len(hit.gpu), len(hit.cpu), len(hit.disk)) == (0, 0, 4)  # CPU lost them to the newer request
    held = cache.admit(hit, 4)
    assert [b.digest for b in held] == [b.digest for b in blocks]
    events = cache.take_events()
    media = [ev.medium for ev in events if isinstance(ev, BlockStored)]
    assert "GPU" in media and "CPU" in media  # promoted to GPU, and copied back up to CPU
    assert cache.lookup([b.digest for b in blocks]).gpu == held


def test_cpu_hit_comes_before_disk_and_counts_as_cpu():
    tiers = TierConfig(cpu_blocks=8, disk_blocks=100)
    cache = KVCache(num_gpu_blocks=2, block_size=BS, tiers=tiers)
    held = run_request(cache, list(range(8)))
    cache.release(held, 0)
    cache.release(run_request(cache, list(range(40, 48))), 0)  # pushes the first chain off the GPU
    hit = cache.lookup([b.digest for b in chain(list(range(8)))])
    assert (len(hit.gpu), len(hit.cpu), len(hit.disk)) == (0, 2, 0)


def test_disk_evicts_by_access_time_from_high_to_low_watermark():
    tiers = TierConfig(cpu_blocks=0, disk_blocks=10, disk_high_watermark=0.8, disk_low_watermark=0.5)
    cache = KVCache(num_gpu_blocks=64, block_size=BS, tiers=tiers)
    chains = []
    for i in range(8):  # 8 blocks = exactly the 80 % watermark: nothing evicted yet
        held = run_request(cache, [1000 + i] * BS)
        cache.release(held, 0)
        chains.append(held[0].digest)
    assert len(cache.disk.blocks) == 8
    cache.disk.touch(chains[0])  # recently read: must survive
    cache.take_events()
    held = run_request(cache, [2000] * BS)  # 9 > 8 -> evict down to 5
    events = cache.take_events()
    removed = [ev for ev in events if isinstance(ev, BlockRemoved) and ev.medium == "STORAGE"]
    assert len(cache.disk.blocks) == 5
    assert chains[0] in cache.disk.blocks
    assert sorted(h for ev in removed for h in ev.block_hashes) == sorted(external_hash(d) for d in chains[1:5])


def test_clear_drops_every_tier_with_one_event_and_frees_held_blocks_later():
    cache = KVCache(num_gpu_blocks=8, block_size=BS, tiers=TierConfig(cpu_blocks=4, disk_blocks=10))
    held = run_request(cache, list(range(8)))
    cache.take_events()
    cache.clear()
    assert cache.take_events() == [AllBlocksCleared()]
    assert cache.lookup([b.digest for b in chain(list(range(8)))]).num_blocks == 0
    assert cache.used_blocks == 2  # still held by the running request
    cache.release(held, 0)
    assert cache.used_blocks == 0


def test_tier_events_can_be_vllm_default_placeholders():
    tiers = TierConfig(cpu_blocks=4, disk_blocks=10, self_describing_events=False)
    cache = KVCache(num_gpu_blocks=8, block_size=BS, tiers=tiers)
    held = run_request(cache, list(range(8)))
    events = [ev for ev in cache.take_events() if isinstance(ev, BlockStored)]
    gpu = [ev for ev in events if ev.medium == "GPU"]
    cpu = [ev for ev in events if ev.medium == "CPU"]
    assert gpu[0].token_ids == list(range(8))  # GPU events always carry tokens
    assert [ev.block_hashes for ev in cpu] == [[external_hash(b.digest)] for b in held]
    assert all(ev.token_ids == [] and ev.block_size == 0 and ev.parent_block_hash is None for ev in cpu)
