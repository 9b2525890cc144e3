"""The approximate prefix producer (GIE §4): hashing, matching, recording, bounds, purge and metrics."""

import struct

import pytest
import xxhash
from prometheus_client import CollectorRegistry

from epp.datalayer.registry import EndpointRegistry, EndpointSpec
from epp.framework import ConfigError, CycleState, PluginContext, ProfileRunResult, SchedulingResult
from epp.framework.datakeys import PREFIX_CACHE_FREE_BLOCKS, PREFIX_MATCH_INFO
from epp.scorers.prefix_index import PrefixIndex
from epp.scorers.prompt_text import user_input_bytes
from tests.support.scheduling import endpoint, make_plugin, request


def reference_chain(data: bytes, block: int, model: str, salt: str = "") -> list[int]:
    """The chain as §4.2 states it, written independently of the producer."""
    prev = xxhash.xxh64((model + salt).encode()).intdigest()
    out = []
    for start in range(0, len(data), block):
        prev = xxhash.xxh64(data[start:start + block] + struct.pack("<Q", prev)).intdigest()
        out.append(prev)
    return out


def result_for(*targets, prefill=None):
    profiles = {"default": ProfileRunResult(tuple(targets))}
    if prefill is not None:
        profiles["prefill"] = ProfileRunResult((prefill,))
    return SchedulingResult(profiles, "default")


async def prepare(producer, req, endpoints):
    state = CycleState()
    await producer.prepare(state, req, endpoints)
    return state, {name: (i.matched_blocks, i.total_blocks) for name, i in
                   state.all_endpoint_data(PREFIX_MATCH_INFO).items()}


async def test_hash_chain_matches_the_reference_formula():
    producer = make_plugin("approx-prefix-cache-producer", {"blockSizeTokens": 1, "autoTune": False})
    assert producer.hash_request(request("aaaabbbb"), 1) == reference_chain(b"aaaabbbb", 4, "my-model")
    # The trailing partial block is hashed too; the salt seeds the chain after the target model.
    salted = request("aaaabbbbcc", target="rewritten", cache_salt="s1")
    assert producer.hash_request(salted, 1) == reference_chain(b"aaaabbbbcc", 4, "rewritten", "s1")
    assert producer.hash_request(request("aaa"), 1) == []  # shorter than one block


async def test_prompt_sharing_a_block_matches_one_of_two():
    producer = make_plugin("approx-prefix-cache-producer", {"blockSizeTokens": 1, "autoTune": False})
    eps = [endpoint(0), endpoint(1)]
    state, matches = await prepare(producer, request("aaaabbbb"), eps)
    assert matches == {eps[0].name: (0, 2), eps[1].name: (0, 2)}
    producer.pre_request(state, request("aaaabbbb"), result_for(eps[0]))
    _, matches = await prepare(producer, request("aaaacccc"), eps)
    assert matches == {eps[0].name: (1, 2), eps[1].name: (0, 2)}


async def test_different_model_or_salt_does_not_match():
    producer = make_plugin("approx-prefix-cache-producer", {"blockSizeTokens": 1, "autoTune": False})
    eps = [endpoint(0)]
    state, _ = await prepare(producer, request("aaaabbbb"), eps)
    producer.pre_request(state, request("aaaabbbb"), result_for(eps[0]))
    assert (await prepare(producer, request("aaaabbbb", target="other"), eps))[1][eps[0].name] == (0, 2)
    assert (await prepare(producer, request("aaaabbbb", cache_salt="x"), eps))[1][eps[0].name] == (0, 2)
    assert (await prepare(producer, request("aaaabbbb"), eps))[1][eps[0].name] == (2, 2)


async def test_auto_tune_takes_the_block_size_from_the_endpoints():
    producer = make_plugin("approx-prefix-cache-producer")
    eps = [endpoint(0, block_size=16)]
    _, matches = await prepare(producer, request("a" * 128), eps)
    assert matches[eps[0].name] == (0, 2)  # 16 tokens x 4 characters = 64-character blocks
    _, matches = await prepare(producer, request("a" * 128), [endpoint(0, block_size=32)])
    assert matches["192.168.1.1:8000"] == (0, 1)
    fixed = make_plugin("approx-prefix-cache-producer", {"autoTune": False, "blockSizeTokens": 8})
    assert (await prepare(fixed, request("a" * 128), eps))[1][eps[0].name] == (0, 4)


@pytest.mark.parametrize("params, prompt_len, blocks", [
    ({"maxPrefixBlocksToMatch": 3}, 1000, 3),
    ({"maxPrefixTokensToMatch": 64}, 1000, 4),   # 64 tokens / 16 per block
    ({}, 64 * 300, 256),                         # default cap
    ({}, 65, 2),                                 # one full block and a 1-byte tail
])
async def test_block_caps(params, prompt_len, blocks):
    producer = make_plugin("approx-prefix-cache-producer", {"autoTune": False, **params})
    assert len(producer.hash_request(request("x" * prompt_len), 16)) == blocks


async def test_pick_records_primary_and_prefill_targets():
    producer = make_plugin("approx-prefix-cache-producer", {"autoTune": False})
    eps = [endpoint(0), endpoint(1), endpoint(2)]
    prompt = "p" * 640
    state, _ = await prepare(producer, request(prompt), eps)
    producer.pre_request(state, request(prompt), result_for(eps[0], eps[2], prefill=eps[1]))
    _, matches = await prepare(producer, request(prompt), eps)
    # Fallback endpoints (eps[2]) are not recorded; the prefill profile's pick is.
    assert matches == {eps[0].name: (10, 10), eps[1].name: (10, 10), eps[2].name: (0, 10)}


def test_index_evicts_least_recently_used_per_endpoint():
    index = PrefixIndex()
    index.add([1, 2, 3], "a", capacity=3)
    index.add([1], "a", capacity=3)          # 1 becomes most recent
    index.add([4], "a", capacity=3)          # evicts 2
    index.add([2], "b", capacity=3)
    assert index.size == 4
    assert index.match_longest_prefix([1]) == {"a": 1}
    assert index.match_longest_prefix([2]) == {"b": 1}
    assert index.match_longest_prefix([1, 3, 4]) == {"a": 3}
    assert index.match_longest_prefix([5, 1]) == {}   # the walk stops at the first unknown hash
    index.remove_endpoint("a")
    assert index.size == 1 and index.match_longest_prefix([1]) == {}


async def test_lru_capacity_auto_tunes_from_cache_num_blocks():
    producer = make_plugin("approx-prefix-cache-producer", {"blockSizeTokens": 1})
    small = endpoint(0, num_blocks=3)
    state, _ = await prepare(producer, request("a" * 40), [small])
    producer.pre_request(state, request("a" * 40), result_for(small))
    assert producer.index.size == 3 and producer.index.capacity(small.name) == 3
    fixed = make_plugin("approx-prefix-cache-producer", {"blockSizeTokens": 1, "autoTune": False,
                                                         "lruCapacityPerServer": 5})
    state, _ = await prepare(fixed, request("a" * 40), [small])
    fixed.pre_request(state, request("a" * 40), result_for(small))
    assert fixed.index.size == 5


async def test_each_endpoints_free_cache_is_its_capacity_less_what_the_index_holds():
    producer = make_plugin("approx-prefix-cache-producer", {"blockSizeTokens": 1, "autoTune": False,
                                                            "lruCapacityPerServer": 20})
    eps = [endpoint(0), endpoint(1)]
    state, _ = await prepare(producer, request("a" * 24), eps)  # 6 blocks of 4 characters
    assert state.all_endpoint_data(PREFIX_CACHE_FREE_BLOCKS) == {eps[0].name: 20, eps[1].name: 20}
    producer.pre_request(state, request("a" * 24), result_for(eps[0]))
    state, _ = await prepare(producer, request("b" * 100), eps)  # 25 blocks: more than the capacity
    assert state.all_endpoint_data(PREFIX_CACHE_FREE_BLOCKS) == {eps[0].name: 14, eps[1].name: 20}
    producer.pre_request(state, request("b" * 100), result_for(eps[0]))
    state, _ = await prepare(producer, request("c" * 8), eps)
    assert state.endpoint_data(PREFIX_CACHE_FREE_BLOCKS, eps[0].name) == 0  # full: never below 0


async def test_removed_endpoints_are_purged_and_metrics_reported():
    metrics = CollectorRegistry()
    registry = EndpointRegistry()
    registry.set_endpoints([EndpointSpec("192.168.1.1", 8000), EndpointSpec("192.168.1.2", 8000)])
    producer = make_plugin("approx-prefix-cache-producer", {"autoTune": False},
                           context=PluginContext(metrics_registry=metrics, endpoints=registry))
    eps = list(registry.snapshot())
    prompt = "q" * 256
    for target in (eps[0], eps[0], eps[1]):  # a miss, a full hit, a miss
        state, _ = await prepare(producer, request(prompt), eps)
        producer.pre_request(state, request(prompt), result_for(target))
    assert metrics.get_sample_value("inference_extension_prefix_indexer_size") == 8
    assert metrics.get_sample_value("inference_extension_prefix_indexer_hit_ratio_count") == 3
    assert metrics.get_sample_value("inference_extension_prefix_indexer_hit_ratio_sum") == 1.0
    assert metrics.get_sample_value("inference_extension_prefix_indexer_hit_bytes_sum") == 256
    registry.set_endpoints([EndpointSpec("192.168.1.2", 8000)])
    assert producer.index.endpoints() == ["192.168.1.2:8000"]
    assert metrics.get_sample_value("inference_extension_prefix_indexer_size") == 4


@pytest.mark.parametrize("params, message", [
    ({"blockSize": 64}, "'blockSize' \\(characters\\) is deprecated; set 'blockSizeTokens' instead"),
    ({"blockSizeTokens": 0}, "'blockSizeTokens' must be >= 1, got 0"),
    ({"maxPrefixBlocksToMatch": 0}, "'maxPrefixBlocksToMatch' must be >= 1"),
    ({"autoTune": "yes"}, "'autoTune' must be true or false"),
])
def test_producer_parameters_are_validated(params, message):
    with pytest.raises(ConfigError, match=message):
        make_plugin("approx-prefix-cache-producer", params)


@pytest.mark.parametrize("api, body, expected", [
    ("completions", {"prompt": "hi there"}, b"hi there"),
    ("completions", {"prompt": ["a", "b"]}, b"a b"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hé"}]},
     '[{"role":"user","content":"hé"}]'.encode()),
    ("responses", {"input": "x", "instructions": "be brief"},
     b'[{"instructions":"be brief"},{"tools":null},{"input":"x"}]'),
    ("conversations", {"items": [{"type": "message"}]}, b'[{"type":"message"}]'),
    ("embeddings", {"input": ["a", "b"]}, b'["a","b"]'),
    ("messages", {"system": "be brief", "messages": [{"role": "user", "content": "hi"}]},
     b'[{"system":"be brief"},{"tools":null},{"role":"user","content":"hi"}]'),
    ("rerank", {"query": "q", "documents": ["a", "b"]}, b'[{"query":"q"},{"documents":["a","b"]}]'),
    ("passthrough", {}, b""),
])
def test_user_input_bytes_per_api(api, body, expected):
    assert user_input_bytes(request(api=api, body={"model": "m", **body})) == expected


@pytest.mark.parametrize("api, body", [
    ("chat/completions", {"messages": [{"role": "user", "content": "m" * 1000} for _ in range(300)]}),
    ("chat/completions", {"messages": [{"role": "system", "content": "é\"\n" * 50000, "name": "x"},
                                             {"role": "user", "content": [{"type": "text", "text": "t" * 9000}]}]}),
    ("embeddings", {"input": ["a" * 7000, "b" * 7000]}),
    ("completions", {"prompt": "ü" * 9000}),
    ("messages", {"system": [{"type": "text", "text": "s" * 6000}], "messages": [
        {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "data": "A" * 9000}},
                                     {"type": "text", "text": "é" * 4000}]}] * 40}),
])
def test_user_input_bytes_with_a_limit_is_the_prefix_of_the_full_input(api, body):
    req = request(api=api, body={"model": "m", **body})
    full = user_input_bytes(req)
    for limit in (10, 1000, 5000, 16384, len(full) + 10):
        assert user_input_bytes(req, limit=limit) == full[:limit]
