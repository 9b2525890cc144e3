"""One engine map under both KV-index backends: the holder changes it makes, the one bound and trim
rule of its per-endpoint map, and random event streams leaving the same holders in memory and on Redis."""

from __future__ import annotations

import random
from typing import Any

import pytest
import xxhash
from prometheus_client import CollectorRegistry

from bench.support.redis_server import RedisServer
from epp.kvevents.backend import InMemoryKVIndex, KVIndexBackend
from epp.kvevents.decoding import Tier, decode_batch
from epp.kvevents.engine_map import EngineMap, trim_target
from epp.kvevents.keys import BlockKeyer
from epp.kvevents.metrics import KVIndexMetrics
from epp.kvevents.redis_index import RedisIndexMetrics, RedisKVIndex
from tests.kvevents import wire

MODEL = "m"
A, B, C = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"
T = list(range(100, 132))  # 32 tokens: 8 index blocks of 4
requires_redis = pytest.mark.redis  # skipped locally without redis-server, a failure under CI
BACKENDS = [pytest.param("memory", id="memory"), pytest.param("redis", id="redis", marks=requires_redis)]


@pytest.fixture(scope="module")
def redis_server():
    with RedisServer() as server:
        yield server


class Recorder:
    """The engine map's holder changes, in order (a `Holders` that only writes them down)."""

    def __init__(self) -> None:
        self.changes: list[tuple[Any, ...]] = []

    def hold(self, endpoint, keys, bits):
        self.changes.append(("hold", endpoint, list(keys), bits))

    def release(self, endpoint, keys, bits):
        self.changes.append(("release", endpoint, list(keys), bits))

    def release_endpoint(self, endpoint, keys):
        keys = list(keys)
        self.changes.append(("release_endpoint", endpoint, keys))
        return len(keys)


def test_events_become_holder_changes_of_request_keys_per_tier():
    keyer = BlockKeyer(4)
    recorder = Recorder()
    engine = EngineMap(keyer, recorder, capacity_per_endpoint=100, metrics=KVIndexMetrics(None))
    k0, k1 = keyer.request_keys(T[:8], MODEL)
    for events in ([wire.stored([1, 2], T[:8])], [wire.placeholder([2], "CPU")], [wire.removed([1, 2])],
                   [wire.removed([2], "CPU")], [wire.stored([5], T[:4])], [wire.AllBlocksCleared()]):
        engine.apply(A, decode_batch(wire.encode_batch(events)), MODEL)
    assert recorder.changes == [
        ("hold", A, [k0, k1], 1),  # stored on GPU: both keys, one call
        ("hold", A, [k1], 2),  # offloaded to CPU
        ("release", A, [k1], 1), ("release", A, [k0], 1),  # evicted from GPU (block 2 still on CPU)
        ("release", A, [k1], 2),  # and from CPU: engine hash 2 is forgotten
        ("hold", A, [k0], 1),
        ("release_endpoint", A, [k0]),  # a clear releases all the map knew
    ]
    assert engine.blocks(A) == 0 and engine.endpoints() == []


async def make_index(backend: str, request: pytest.FixtureRequest, registry: CollectorRegistry | None = None,
                     **kw: Any) -> KVIndexBackend:
    if backend == "memory":
        return InMemoryKVIndex(4, 1_000_000, metrics=KVIndexMetrics(registry), **kw)
    server = request.getfixturevalue("redis_server")
    index = RedisKVIndex(server.url, 4, key_prefix=f"backends{random.getrandbits(48)}:", timeout_s=1.0,
                         metrics=KVIndexMetrics(registry), redis_metrics=RedisIndexMetrics(registry), **kw)
    await index.start()
    return index


async def matched(index: KVIndexBackend, tokens: list[int], lora: str | None = None) -> dict[str, list[Tier]]:
    if isinstance(index, RedisKVIndex):
        await index.flush()
    return await index.lookup_async(index.keyer.request_keys(tokens, lora or MODEL))


def apply(index: KVIndexBackend, endpoint: str, *events: Any) -> Any:
    return index.apply_batch(endpoint, decode_batch(wire.encode_batch(list(events))), MODEL)


@pytest.mark.parametrize("backend", BACKENDS)
async def test_the_engine_map_bound_trims_the_oldest_blocks_a_batch_at_a_time_on_both_backends(backend, request):
    registry = CollectorRegistry()
    index = await make_index(backend, request, registry, engine_capacity_per_endpoint=512)
    try:
        def prompt(p: int) -> list[int]:
            return [p * 1000 + i for i in range(8)]

        for p in [*range(256), 999]:  # 2 engine blocks each: 514 > 512
            apply(index, A, wire.stored([p * 100, p * 100 + 1], prompt(p)))
        assert index.engine_blocks(A) == trim_target(512) == 510
        assert registry.get_sample_value("epp_kv_index_engine_key_evictions_total") == 4
        # The oldest blocks' holders are released with them; the newer ones stay.
        assert await matched(index, prompt(0)) == {} and await matched(index, prompt(1)) == {}
        assert await matched(index, prompt(2)) == await matched(index, prompt(999)) == {A: [Tier.GPU] * 2}
    finally:
        await index.stop()


@pytest.mark.parametrize("backend", BACKENDS)
async def test_speculative_claims_are_bounded_oldest_first_and_counted_on_both_backends(backend, request):
    registry = CollectorRegistry()
    index = await make_index(backend, request, registry, speculative_capacity=4)
    try:
        keys = index.keyer.request_keys(T[:24], MODEL)
        assert index.add_speculative(A, keys) == 6  # 6 claims > 4: the two oldest go
        assert index.speculative_entries() == 4
        assert registry.get_sample_value("epp_kv_index_speculative_entries") == 4
        assert registry.get_sample_value("epp_kv_index_speculative_evictions_total") == 2
        assert await matched(index, T[:24]) == {}  # the prompt's first blocks are no longer claimed
        assert await index.lookup_async(keys[2:]) == {A: [Tier.GPU] * 4}
    finally:
        await index.stop()


def random_stream(seed: int, n_batches: int = 150) -> tuple[dict[str, Any], list[tuple[str, list[Any]]], list]:
    """Index options and batches (endpoint, events) of vLLM-like events from three engines of
    different block sizes storing, offloading, evicting and clearing chains of a few shared
    documents (a block's engine hash follows its tokens from the start, as vLLM's does), some with
    a LoRA; some events name parents or hashes the engine never announced. Also the prompts."""
    rng = random.Random(seed)
    base = [rng.randrange(1000) for _ in range(16)]
    docs = [base + [rng.randrange(1000) for _ in range(48)] for _ in range(2)]
    docs += [[rng.randrange(1000) for _ in range(64)] for _ in range(2)]
    engine_block = {A: 4, B: 2, C: 8}
    known: dict[str, set[int]] = {ep: set() for ep in engine_block}  # hashes each engine announced

    def block_hash(doc: list[int], end: int, lora: str | None) -> int:
        return xxhash.xxh64_intdigest(repr((lora, doc[:end])).encode())

    batches = []
    for _ in range(n_batches):
        ep = rng.choice(list(engine_block))
        size = engine_block[ep]
        events: list[Any] = []
        for _ in range(rng.randint(1, 3)):
            roll = rng.random()
            held = sorted(known[ep])
            # 1-3 hashes the engine announced, now and then one it never did
            picked = rng.sample(held, min(len(held), rng.randint(1, 3)))
            picked += [rng.getrandbits(64)] if rng.random() < 0.1 else []
            if roll < 0.45:
                doc, lora = rng.choice(docs), rng.choice([None, None, None, "lora-x"])
                n_blocks = len(doc) // size
                start = rng.randrange(n_blocks)
                if rng.random() < 0.9:  # mostly a chain's start or the block after one the engine holds
                    start = rng.choice([0] + [j + 1 for j in range(n_blocks - 1)
                                              if block_hash(doc, (j + 1) * size, lora) in known[ep]])
                stop = min(n_blocks, start + rng.randint(1, 3))
                new = [block_hash(doc, (j + 1) * size, lora) for j in range(start, stop)]
                events.append(wire.stored(
                    new, doc[start * size:stop * size], block_hash(doc, start * size, lora) if start else None,
                    block_size=size, medium=rng.choice(["GPU"] * 6 + ["CPU"]), lora_name=lora,
                    extra_keys=[[lora]] * len(new) if lora else None))
                known[ep].update(new)
            elif roll < 0.65:
                events.append(wire.placeholder(picked, rng.choice(["CPU", "CPU", "STORAGE"])))
            elif roll < 0.97:
                events.append(wire.removed(picked, rng.choice(["GPU", "GPU", "CPU", "STORAGE"])))
            else:
                events.append(wire.AllBlocksCleared())
                known[ep].clear()
        batches.append((ep, events))
    options = {"engine_capacity_per_endpoint": rng.choice([12, 300]), "offload_chunk_blocks": rng.choice([1, 2])}
    prompts = [(doc, lora) for doc in docs for lora in (None, "lora-x")]
    return options, batches, prompts


@requires_redis
@pytest.mark.parametrize("seed", range(8))
async def test_the_same_event_stream_leaves_the_same_holders_on_both_backends(seed, request):
    options, batches, prompts = random_stream(seed)
    memory = await make_index("memory", request, **options)
    remote = await make_index("redis", request, **options)
    try:
        for i, (endpoint, events) in enumerate(batches):
            assert apply(memory, endpoint, *events) == apply(remote, endpoint, *events)
            if i % 10 == 9 or i == len(batches) - 1:
                await remote.flush()
                assert await remote.contents() == memory.contents(), f"after batch {i}"
                assert remote.endpoints() == memory.endpoints()
                assert [remote.engine_blocks(ep) for ep in (A, B, C)] == [memory.engine_blocks(ep) for ep in (A, B, C)]
        assert memory.contents(), "the stream left nothing to compare"
        for doc, lora in prompts:
            assert await matched(remote, doc, lora) == await matched(memory, doc, lora)
    finally:
        await remote.stop()
