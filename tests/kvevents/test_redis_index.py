"""The Redis KV-index backend: the same lookups as the in-memory index for the same events (one
table of cases run against both), pickers sharing one Redis, eviction, and Redis dying mid-run."""

from __future__ import annotations

import asyncio
import itertools
import logging
from dataclasses import dataclass, field
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from bench.support.redis_server import RedisServer
from epp.kvevents.backend import InMemoryKVIndex, KVIndexBackend
from epp.kvevents.decoding import Tier, decode_batch
from epp.kvevents.metrics import KVIndexMetrics
from epp.kvevents.redis_index import RedisIndexMetrics, RedisKVIndex
from tests.kvevents import wire

pytestmark = pytest.mark.redis  # needs redis-server: skipped locally without it, a failure under CI

MODEL = "m"
A, B = "10.0.0.1:8000", "10.0.0.2:8000"
T = list(range(100, 132))  # 32 tokens: 8 index blocks of 4
G, C, D = Tier.GPU, Tier.CPU, Tier.DISK
_prefixes = itertools.count()


@pytest.fixture(scope="module")
def redis_server():
    with RedisServer() as server:
        yield server


def fresh_prefix() -> str:
    """A key prefix of its own per index, so the tests sharing one server never see each other."""
    return f"test{next(_prefixes)}:"


def redis_index(server: RedisServer, registry: CollectorRegistry | None = None, prefix: str | None = None,
                **kw: Any) -> RedisKVIndex:
    kw.setdefault("timeout_s", 1.0)
    return RedisKVIndex(server.url, 4, key_prefix=prefix or fresh_prefix(), health_interval_s=0.05,
                        poll_interval_s=0.05, metrics=KVIndexMetrics(registry),
                        redis_metrics=RedisIndexMetrics(registry), **kw)


def apply(index: KVIndexBackend, endpoint: str, *events: Any) -> Any:
    return index.apply_batch(endpoint, decode_batch(wire.encode_batch(list(events))), MODEL)


async def matched(index: KVIndexBackend, tokens: list[int], endpoints: list[str] | None,
                  model: str = MODEL, salt: str | None = None) -> dict[str, list[Tier]]:
    if isinstance(index, RedisKVIndex):
        await index.flush()
    return await index.lookup_async(index.keyer.request_keys(tokens, model, salt), endpoints)


@dataclass
class Case:
    """Events applied per endpoint in order, then lookups (tokens, candidates, model, salt) → expected."""

    name: str
    steps: list[tuple[str, list[Any]]]
    lookups: list[tuple[list[int], list[str] | None, dict[str, list[Tier]]]]
    model: str = MODEL
    salt: str | None = None
    options: dict[str, Any] = field(default_factory=dict)


CASES = [
    Case("chained events continue; other endpoints hold nothing",
         [(A, [wire.stored([1, 2], T[:8])]), (A, [wire.stored([3, 4], T[8:16], parent=2)])],
         [(T, [A, B], {A: [G] * 4}), (T, None, {A: [G] * 4})]),
    Case("an unknown parent is dropped", [(A, [wire.stored([9], T[4:8], parent=777)])], [(T, [A], {})]),
    Case("engine blocks smaller than index blocks, partial tails continued and removed",
         [(A, [wire.stored([1, 2, 3], T[:6], block_size=2)]), (A, [wire.stored([4], T[6:8], parent=3, block_size=2)])],
         [(T, [A], {A: [G, G]})]),
    Case("removing the engine block holding a key's first half removes the key",
         [(A, [wire.stored([1, 2, 3], T[:6], block_size=2)]), (A, [wire.stored([4], T[6:8], parent=3, block_size=2)]),
          (A, [wire.removed([3])])],
         [(T, [A], {A: [G]})]),
    Case("engine blocks larger than index blocks", [(A, [wire.stored([1], T[:8], block_size=8)])],
         [(T, [A], {A: [G, G]})]),
    Case("tiers: offload placeholders, GPU removal leaves CPU, then disk",
         [(A, [wire.stored([1, 2], T[:8]), wire.placeholder([1, 2], "CPU")]), (A, [wire.removed([1, 2])]),
          (A, [wire.placeholder([1], "DISK")]), (A, [wire.removed([1], "CPU")])],
         [(T, [A], {A: [D, C]})]),
    Case("GPU and CPU held: the best tier counts",
         [(A, [wire.stored([1, 2], T[:8]), wire.placeholder([2], "CPU")])], [(T, [A], {A: [G, G]})]),
    Case("CPU presence is reference counted per hash",
         [(A, [wire.stored([1], T[:4]), wire.placeholder([1], "CPU"), wire.placeholder([1], "CPU"),
               wire.removed([1])]), (A, [wire.removed([1], "CPU")])],
         [(T, [A], {A: [C]})]),
    Case("a placeholder for an unknown hash is dropped", [(A, [wire.placeholder([42], "CPU")])], [(T, [A], {})]),
    Case("AllBlocksCleared touches one endpoint only; a fresh chain follows",
         [(A, [wire.stored([1, 2], T[:8])]), (B, [wire.stored([1, 2], T[:8])]), (A, [wire.AllBlocksCleared()]),
          (A, [wire.stored([7], T[:4])])],
         [(T, [A, B], {A: [G], B: [G, G]})]),
    Case("LoRA name seeds the chain",
         [(A, [wire.stored([1, 2], T[:8], lora_name="sql-lora", extra_keys=[["sql-lora"], ["sql-lora"]])])],
         [(T, [A], {A: [G, G]})], model="sql-lora"),
    Case("cache salt seeds the chain", [(A, [wire.stored([5, 6], T[:8], extra_keys=[["tenant-a"], None])])],
         [(T, [A], {A: [G, G]})], salt="tenant-a"),
    Case("multimodal extra keys never match text", [(A, [wire.stored([1, 2], T[:8], extra_keys=[[["img", 0]], None])])],
         [(T, [A], {})]),
    Case("other KV-cache groups are not indexed",
         [(A, [wire.stored([1], T[:4], group_idx=1, kv_cache_spec_kind="sliding_window")])], [(T, [A], {})]),
    Case("the run stops at the first gap, per endpoint",
         [(A, [wire.stored([1, 2, 3, 4], T[:16])]), (A, [wire.removed([2])]), (B, [wire.stored([1, 2, 3], T[:12])])],
         [(T, [A, B], {A: [G], B: [G, G, G]}), (T, None, {A: [G], B: [G, G, G]})]),
    Case("the engine-hash map is bounded per endpoint", [(A, [wire.stored([1, 2, 3, 4], T[:16])])],
         [(T, [A], {})], options={"engine_capacity_per_endpoint": 3}),
    Case("an offloaded chunk announced by its last hash covers the chunk",
         [(A, [wire.stored([1, 2, 3, 4], T[:16]), wire.placeholder([2, 4], "CPU"), wire.removed([1, 2, 3, 4])])],
         [(T, [A], {A: [C] * 4})], options={"offload_chunk_blocks": 2}),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
async def test_both_backends_answer_the_same_lookups_for_the_same_events(case: Case, redis_server):
    memory = InMemoryKVIndex(4, 10_000, **case.options)
    remote = redis_index(redis_server, **case.options)
    await remote.start()
    try:
        for index in (memory, remote):
            for endpoint, events in case.steps:
                apply(index, endpoint, *events)
        for tokens, endpoints, expected in case.lookups:
            got_memory = await matched(memory, tokens, endpoints, case.model, case.salt)
            got_remote = await matched(remote, tokens, endpoints, case.model, case.salt)
            assert got_memory == expected
            assert got_remote == expected
    finally:
        await remote.stop()


async def test_speculative_claims_are_local_and_expire_the_same_way(redis_server):
    now = [100.0]
    memory = InMemoryKVIndex(4, 10_000, clock=lambda: now[0])
    remote = redis_index(redis_server, clock=lambda: now[0])
    await remote.start()
    keys = memory.keyer.request_keys(T[:8], MODEL)
    try:
        for index in (memory, remote):
            index.add_speculative(A, keys)
        assert await matched(memory, T[:8], [A, B]) == await matched(remote, T[:8], [A, B]) == {A: [G, G]}
        for index in (memory, remote):
            apply(index, A, wire.stored([1], T[:4], medium="CPU"))
        assert await matched(memory, T[:8], [A]) == await matched(remote, T[:8], [A]) == {A: [C, G]}
        now[0] += 2.5
        assert await matched(memory, T[:8], [A]) == await matched(remote, T[:8], [A]) == {A: [C]}
    finally:
        await remote.stop()


async def test_two_pickers_sharing_one_redis_see_each_others_endpoints(redis_server):
    prefix = fresh_prefix()
    first, second = redis_index(redis_server, prefix=prefix), redis_index(redis_server, prefix=prefix)
    await first.start()
    await second.start()
    try:
        apply(first, A, wire.stored([1, 2, 3], T[:12]))  # the first picker applies A's events
        apply(second, B, wire.stored([8, 9], T[:8]), wire.placeholder([9], "CPU"))  # the second B's
        await first.flush()
        for picker in (first, second):
            assert await matched(picker, T, [A, B]) == {A: [G, G, G], B: [G, G]}
        # a removal and a clear applied by one picker are what the other one reads next
        apply(second, B, wire.removed([9]))
        await second.flush()
        assert await matched(first, T, [A, B]) == {A: [G, G, G], B: [G, C]}
        apply(first, A, wire.AllBlocksCleared())
        await first.flush()
        assert await matched(second, T, None) == {B: [G, C]}
        # the same endpoint's events applied by both pickers (two writers) leave the same entries
        for picker in (first, second):
            apply(picker, A, wire.stored([1, 2], T[:8]), wire.removed([2]))
        await first.flush()
        await second.flush()
        assert await matched(second, T, [A]) == {A: [G]}
        assert second.endpoints() == [B, A] and first.endpoints() == [A]
    finally:
        await first.stop()
        await second.stop()


async def test_redis_evicts_least_recently_used_keys_under_maxmemory_and_the_metric_counts_them():
    registry = CollectorRegistry()
    # maxmemory-samples 10 (Redis's default 5 approximates LRU more loosely): what production should set too
    with RedisServer(maxmemory="3mb", extra_args=("--maxmemory-samples", "10")) as server:
        index = redis_index(server, registry)
        await index.start()
        try:
            # ~100 bytes an entry: 2 MB over what the server starts with evicts the oldest keys
            for p in range(300):
                tokens = [p * 1000 + i for i in range(4 * 200)]
                apply(index, A, wire.stored(list(range(p * 1000, p * 1000 + 200)), tokens))
                await index.flush()

            async def kept(p: int) -> int:
                """How many of prompt p's 200 keys Redis still holds."""
                keys = index.keyer.request_keys([p * 1000 + i for i in range(4 * 200)], MODEL)
                return await index._redis.exists(*[index._redis_key(k) for k in keys])

            # Redis's LRU is approximate (sampled): most of the newest, far less of the oldest (uniform
            # eviction would keep the same share of both, under half: fewer than half the keys remain)
            assert await kept(299) >= 150 and await kept(298) >= 150
            assert await kept(0) <= 70 and await kept(1) <= 70
            assert await index._redis.dbsize() < 300 * 200 / 2
            await asyncio.sleep(0.3)  # the poller reads INFO
            assert registry.get_sample_value("epp_kv_index_evictions_total") > 0
            assert registry.get_sample_value("epp_kv_redis_maxmemory_bytes") == 3 * 1024 * 1024
            assert 0 < registry.get_sample_value("epp_kv_redis_used_memory_bytes") <= 3.5 * 1024 * 1024
        finally:
            await index.stop()


async def test_redis_killed_mid_run_degrades_to_no_match_then_recovers(caplog):
    registry = CollectorRegistry()
    server = RedisServer().start()
    index = redis_index(server, registry, timeout_s=0.2)
    try:
        await index.start()
        apply(index, A, wire.stored([1, 2], T[:8]))
        assert await matched(index, T, [A]) == {A: [G, G]}
        server.stop()  # SIGKILL: connections reset, the data is gone
        with caplog.at_level(logging.WARNING, logger="epp.kvevents.redis_index"):
            for _ in range(5):
                assert await index.lookup_async(index.keyer.request_keys(T, MODEL), [A]) == {}
        assert not index.healthy
        assert registry.get_sample_value("epp_kv_redis_up") == 0
        assert registry.get_sample_value("epp_kv_redis_errors_total", {"op": "lookup"}) == 1  # then the circuit
        assert registry.get_sample_value("epp_kv_redis_degraded_lookups_total") == 5
        assert len([r for r in caplog.records if "unavailable" in r.getMessage()]) == 1
        apply(index, A, wire.stored([3], T[8:12], parent=2))  # events keep coming while Redis is away
        server.start()  # back on the same port, empty
        for _ in range(100):
            if index.healthy:
                break
            await asyncio.sleep(0.05)
        assert index.healthy and registry.get_sample_value("epp_kv_redis_up") == 1
        # the restarted (empty) Redis got this picker's whole engine map again, the queued block too
        assert await matched(index, T, [A]) == {A: [G, G, G]}
        assert registry.get_sample_value("epp_kv_redis_resyncs_total") == 1
    finally:
        await index.stop()
        server.stop()


async def test_a_lookup_slower_than_the_timeout_degrades():
    registry = CollectorRegistry()
    server = RedisServer(extra_args=("--enable-debug-command", "local")).start()
    index = redis_index(server, registry, timeout_s=0.05)
    blocker = redis_index(server, timeout_s=5.0)
    try:
        await index.start()
        apply(index, A, wire.stored([1], T[:4]))
        await index.flush()
        # DEBUG SLEEP holds the single-threaded server, as a stalled Redis would
        slow = asyncio.ensure_future(blocker._redis.execute_command("DEBUG", "SLEEP", "0.8"))
        await asyncio.sleep(0.3)  # the server is asleep by now (a loaded machine included)
        assert await index.lookup_async(index.keyer.request_keys(T, MODEL), [A]) == {}
        assert registry.get_sample_value("epp_kv_redis_errors_total", {"op": "lookup"}) == 1
        await slow
        for _ in range(100):
            if index.healthy:
                break
            await asyncio.sleep(0.05)
        assert await matched(index, T, [A]) == {A: [G]}
    finally:
        await index.stop()
        await blocker.stop()
        server.stop()


@pytest.mark.parametrize("sharded", [False, True], ids=["every-writer-every-replica", "one-shard-each"])
async def test_pickers_subscribed_to_the_same_replicas_keep_one_shared_index_through_a_restart(redis_server, sharded):
    """Real ZMQ publishers and subscribers: two writing pickers apply the replicas' events into one
    Redis (each every replica, or each its shard of them), a third picker only reads; a replica
    restart clears its entries for every picker."""
    from epp.datalayer.registry import EndpointRegistry, EndpointSpec
    from epp.kvevents.metrics import KVSubscriberMetrics
    from epp.kvevents.subscriber import KVEventSubscriber, SubscriberConfig
    from tests.kvevents.publisher import FakePublisher

    prefix = fresh_prefix()
    configs = [SubscriberConfig(mode="per-endpoint", replay_timeout_s=2.0, shard=i if sharded else 0,
                                shards=2 if sharded else 1)
               for i in range(2)]
    # two replicas, one in each shard
    ports = [next(p for p in range(9000, 9100) if configs[0].owns(f"127.0.0.1:{p}")),
             next(p for p in range(9000, 9100) if configs[1].owns(f"127.0.0.1:{p}") and not configs[0].owns(
                 f"127.0.0.1:{p}"))] if sharded else [9000, 9001]
    pubs = [FakePublisher(f"kv@127.0.0.1:{port}@{MODEL}") for port in ports]
    names = [f"127.0.0.1:{port}" for port in ports]
    endpoints = EndpointRegistry()
    endpoints.set_endpoints([EndpointSpec("127.0.0.1", port, {"kv-events-port": str(pub.port),
                                                              "kv-replay-port": str(pub.replay_port)})
                             for port, pub in zip(ports, pubs, strict=True)])
    writers = [redis_index(redis_server, prefix=prefix) for _ in range(2)]
    reader = redis_index(redis_server, prefix=prefix)
    subscribers = [KVEventSubscriber(w, config, endpoints, KVSubscriberMetrics(None))
                   for w, config in zip(writers, configs, strict=True)]
    for index in (*writers, reader):
        await index.start()
    for sub in subscribers:
        await sub.start()

    async def reader_sees(expected: dict[str, list[Tier]]) -> None:
        for _ in range(200):
            if await reader.lookup_async(reader.keyer.request_keys(T, MODEL), names) == expected:
                return
            await asyncio.sleep(0.02)
        raise AssertionError(f"reader never saw {expected}: {await reader.lookup_async(reader.keyer.request_keys(T, MODEL), names)}")

    try:
        def live(sub: KVEventSubscriber, name: str) -> bool:
            stream = sub._streams.get(name)
            return stream is not None and not stream.repairing and stream.last_seq is not None

        for i, (pub, name) in enumerate(zip(pubs, names, strict=True)):
            appliers = [subscribers[i]] if sharded else subscribers
            await pub.heartbeat_until(lambda name=name, appliers=appliers: all(live(sub, name) for sub in appliers))
        await pubs[0].publish([wire.stored([1, 2, 3], T[:12])])
        await pubs[1].publish([wire.stored([5, 6], T[:8]), wire.placeholder([6], "CPU")])
        await reader_sees({names[0]: [G, G, G], names[1]: [G, G]})
        assert [sorted(w.endpoints()) for w in writers] == ([[names[0]], [names[1]]] if sharded
                                                            else [sorted(names)] * 2)
        await pubs[1].publish([wire.removed([6])])
        await reader_sees({names[0]: [G, G, G], names[1]: [G, C]})
        pubs[0].restart()  # sequence back to 0: an engine that restarted holds nothing
        await pubs[0].publish([wire.stored([7], T[:4])])
        await reader_sees({names[0]: [G], names[1]: [G, C]})
    finally:
        for sub in subscribers:
            await sub.stop()
        for index in (*writers, reader):
            await index.stop()
        for pub in pubs:
            await pub.close()


async def test_writes_dropped_beyond_the_queue_bound_are_counted_and_the_engine_map_written_again(redis_server):
    registry = CollectorRegistry()
    index = redis_index(redis_server, registry, max_pending_writes=2)
    await index.start()
    try:
        apply(index, A, wire.stored([1, 2, 3, 4], T[:16]))  # 4 queued operations > 2: dropped
        assert registry.get_sample_value("epp_kv_redis_dropped_writes_total") == 4
        for _ in range(100):  # the poller sees the flag and writes the engine map again
            if registry.get_sample_value("epp_kv_redis_resyncs_total") == 1 and not index._ops:
                break
            await asyncio.sleep(0.05)
        assert await matched(index, T, [A]) == {A: [G] * 4}
    finally:
        await index.stop()
