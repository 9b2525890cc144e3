"""Continuous batching and the latency model, checked in simulated time."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from epp.engine.sim.engine import EngineConfig, EngineError, SimEngine
from epp.engine.sim.profiles import FAST, H100_LLAMA3_8B, LatencyProfile, get_profile

# Slow enough in simulated time that loop jitter (tens of microseconds) is negligible, and
# time_scale keeps the wall time of the tests short.
PROFILE = LatencyProfile(
    name="test", prefill_per_token=100e-6, forward_base=5e-3, decode_per_seq=1e-3, step_overhead=0.0,
    cpu_load_per_token=10e-6, disk_load_per_token=50e-6, num_gpu_blocks=64, block_size=16,
    max_num_seqs=4, max_num_batched_tokens=4096, max_model_len=1024)
POOL = list(range(100, 200))


def ttft(r) -> float:
    """Simulated time from admission to the first token (arrival adds loop jitter, not model time)."""
    assert r.first_token - r.arrival >= r.first_token - r.scheduled - 1e-9
    return r.first_token - r.scheduled


async def run(engine: SimEngine, requests) -> None:
    for r in requests:
        engine.submit(r)
    while not all(r.finished for r in requests):
        await asyncio.sleep(0.005)


@pytest.fixture
async def engine():
    e = SimEngine(EngineConfig(profile=PROFILE, time_scale=0.2), output_token_pool=POOL)
    e.start()
    yield e
    await e.stop()


def test_step_time_grows_with_prefill_tokens_and_batch():
    assert PROFILE.step_time(0, 0) == 0
    assert PROFILE.step_time(100, 0) == pytest.approx(5e-3 + 100 * 100e-6)
    assert PROFILE.step_time(0, 8) > PROFILE.step_time(0, 1)
    assert get_profile("fast*2").forward_base == 2 * FAST.forward_base
    assert H100_LLAMA3_8B.prefill_per_token < H100_LLAMA3_8B.forward_base


async def test_ttft_is_one_prefill_step_and_cached_prefix_makes_it_shorter(engine):
    prompt = list(range(1, 161))  # 10 full blocks
    r1 = engine.new_request(prompt, 4)
    await run(engine, [r1])
    ttft1 = ttft(r1)
    assert ttft1 == pytest.approx(PROFILE.step_time(160, 0))
    r2 = engine.new_request(prompt, 4)
    await run(engine, [r2])
    assert r2.num_cached_tokens == 144  # 9 blocks: the last prompt token is always recomputed
    ttft2 = ttft(r2)
    assert ttft2 == pytest.approx(PROFILE.step_time(16, 0))
    assert ttft2 < ttft1
    assert engine.metrics.prefix_cache_queries == 320
    assert engine.metrics.prefix_cache_hits == 144


async def test_long_prompt_is_prefilled_in_chunks_of_the_token_budget():
    profile = dataclasses.replace(PROFILE, max_num_batched_tokens=64)
    e = SimEngine(EngineConfig(profile=profile, time_scale=0.2), output_token_pool=POOL)
    e.start()
    try:
        r = e.new_request(list(range(1, 161)), 2)
        await run(e, [r])
        steps = [profile.step_time(64, 0), profile.step_time(64, 0), profile.step_time(32, 0)]
        assert ttft(r) == pytest.approx(sum(steps))
    finally:
        await e.stop()


async def test_decode_time_per_token_grows_with_batch_size(engine):
    one = engine.new_request(list(range(1, 20)), 20)
    await run(engine, [one])
    solo = (one.finished_at - one.first_token) / 19
    batch = [engine.new_request([7, i] * 10, 20) for i in range(4)]
    await run(engine, batch)
    shared = max((r.finished_at - r.first_token) / 19 for r in batch)
    assert solo == pytest.approx(PROFILE.step_time(0, 1), rel=0.05)
    assert shared == pytest.approx(PROFILE.step_time(0, 4), rel=0.05)
    assert [len(r.output) for r in batch] == [20] * 4
    assert all(r.finish_reason == "length" for r in batch)


async def test_max_num_seqs_queues_the_rest(engine):
    reqs = [engine.new_request([3, i, 5] * 7, 30) for i in range(6)]
    for r in reqs:
        engine.submit(r)
    await asyncio.sleep(0.01)
    assert len(engine.running) == 4 and len(engine.waiting) == 2
    await run(engine, reqs)
    # The last two started only after the first batch finished.
    assert min(r.scheduled for r in reqs[4:]) >= min(r.finished_at for r in reqs[:4]) - 1e-9


async def test_request_waits_when_its_blocks_do_not_fit():
    profile = dataclasses.replace(PROFILE, num_gpu_blocks=8, max_num_seqs=8)
    e = SimEngine(EngineConfig(profile=profile, time_scale=0.2), output_token_pool=POOL)
    e.start()
    try:
        big = e.new_request(list(range(1, 65)), 40)       # 7 blocks: all but vLLM's null block
        small = e.new_request(list(range(500, 510)), 4)  # 1 block
        e.submit(big)
        e.submit(small)
        await asyncio.sleep(0.01)
        assert e.running == [big] and list(e.waiting) == [small]
        await run(e, [big, small])
        assert small.scheduled >= big.finished_at - 1e-9
        with pytest.raises(EngineError):
            e.new_request(list(range(1, 200)), 10)  # 13 blocks > 7
    finally:
        await e.stop()


async def test_cpu_tier_hit_costs_load_time_not_prefill():
    from epp.engine.sim.kvcache import TierConfig
    profile = dataclasses.replace(PROFILE, num_gpu_blocks=12)
    e = SimEngine(EngineConfig(profile=profile, tiers=TierConfig(cpu_blocks=64), time_scale=0.2),
                  output_token_pool=POOL)
    e.start()
    try:
        prompt = list(range(1, 161))
        await run(e, [e.new_request(prompt, 1)])
        await run(e, [e.new_request(list(range(1000, 1160)), 1)])  # pushes the first prompt off the GPU
        gpu_hits_before = e.metrics.prefix_cache_hits
        r = e.new_request(prompt, 1)
        await run(e, [r])
        assert r.num_cached_tokens == 144
        gpu_hit = e.metrics.prefix_cache_hits - gpu_hits_before
        cpu_hit = e.metrics.external_prefix_cache_hits
        assert gpu_hit + cpu_hit == 144 and cpu_hit >= 128  # LRU kept at most the chain's head on GPU
        expected = profile.step_time(16, 0, cpu_hit * profile.cpu_load_per_token)
        assert ttft(r) == pytest.approx(expected)
        assert expected < profile.step_time(160, 0)
    finally:
        await e.stop()


async def test_time_scale_slows_wall_time_uniformly():
    async def wall_time(scale: float) -> tuple[float, float]:
        e = SimEngine(EngineConfig(profile=PROFILE, time_scale=scale), output_token_pool=POOL)
        e.start()
        loop = asyncio.get_running_loop()
        t = loop.time()
        r = e.new_request(list(range(1, 50)), 10)
        await run(e, [r])
        wall = loop.time() - t
        await e.stop()
        return wall, r.finished_at - r.arrival

    wall1, sim1 = await wall_time(0.5)
    wall2, sim2 = await wall_time(1.5)
    assert sim1 == pytest.approx(sim2, rel=0.05)  # same simulated duration
    assert wall2 > 1.5 * wall1  # three times slower on the wall clock (loose bound for a busy machine)


async def test_abort_frees_blocks_and_sleep_clears_cache(engine):
    r = engine.new_request(list(range(1, 100)), 500)
    engine.submit(r)
    await asyncio.sleep(0.02)
    assert engine.cache.used_blocks > 0
    engine.abort(r)
    await asyncio.sleep(0.02)
    assert r.finish_reason == "abort"
    assert engine.cache.used_blocks == 0
    engine.sleep(1)
    assert engine.cache.cached == {}
    queued = engine.new_request(list(range(1, 40)), 2)
    engine.submit(queued)
    await asyncio.sleep(0.02)
    assert not queued.finished  # sleeping engines accept but do not schedule
    engine.wake_up()
    await run(engine, [queued])


async def test_output_is_deterministic_for_the_same_prompt(engine):
    a = engine.new_request(list(range(1, 30)), 8)
    b = engine.new_request(list(range(1, 30)), 8)
    await run(engine, [a, b])
    assert a.output == b.output and len(set(a.output)) > 1
    assert all(t in POOL for t in a.output)


async def test_set_speed_changes_the_step_time_mid_run(engine):
    prompt = list(range(1, 161))
    r1 = engine.new_request(prompt, 1)
    await run(engine, [r1])
    engine.set_speed(2.0)  # the replica slows down (a throttled GPU)
    r2 = engine.new_request(list(range(300, 460)), 1)
    await run(engine, [r2])
    assert ttft(r2) == pytest.approx(2 * ttft(r1))
    engine.set_speed(1.0)
    assert engine.profile == PROFILE
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError):
            engine.set_speed(bad)
