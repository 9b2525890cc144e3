"""The reuse caches of a long conversation's pick: hits, byte budgets, eviction, metrics, and equality with no cache."""

from __future__ import annotations

import random
from array import array

import pytest
from prometheus_client import CollectorRegistry

from epp.engine.tinymodel import _WORDS, write_tiny_model
from epp.framework.types import InferenceRequest
from epp.kvevents.keys import BlockKeyCache, BlockKeyer
from epp.tokenization.pool import TokenizerPool
from epp.tokenization.prefix_store import PrefixStore, PrefixStoreMetrics, common_prefix
from tests.support.requests import format_of


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n))


# ---- the prefix store --------------------------------------------------------------------------

def test_common_prefix_is_the_length_both_strings_agree_on():
    rng = random.Random(1)
    for _ in range(300):
        a = bytes(rng.randrange(3) for _ in range(rng.randint(0, 400)))
        b = a[:rng.randint(0, len(a))] + bytes(rng.randrange(3) for _ in range(rng.randint(0, 50)))
        expected = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        assert common_prefix(a, b) == expected


def test_the_store_finds_the_entry_sharing_the_longest_head_and_counts_it():
    registry = CollectorRegistry()
    metrics = PrefixStoreMetrics(registry, "t")
    store: PrefixStore[str] = PrefixStore(1 << 20, min_bytes=16, metrics=metrics)
    system = b"s" * 100
    store.put(system + b"A" * 900, "a", 0)
    store.put(system + b"B" * 900, "b", 0)
    entry, shared = store.find(system + b"B" * 900 + b"next turn")
    assert (entry.value, shared) == ("b", 1000)
    entry, shared = store.find(system + b"A" * 800 + b"edited")  # the end differs: the head still counts
    assert (entry.value, shared) == ("a", 900)
    assert store.find(b"x" * 1000) is None  # nothing shares its head
    assert store.find(system) is None  # shares less than half of every entry
    assert registry.get_sample_value("t_lookups_total", {"outcome": "hit"}) == 2
    assert registry.get_sample_value("t_lookups_total", {"outcome": "miss"}) == 2
    assert registry.get_sample_value("t_reused_bytes_total") == 1900


def test_many_conversations_sharing_a_system_prompt_keep_their_own_entries():
    store: PrefixStore[int] = PrefixStore(1 << 24, min_bytes=64, bucket_size=4)
    system = b"a long shared system prompt " * 40  # 1,120 bytes
    for i in range(200):
        store.put(system + f"conversation {i} ".encode() * 100, i, 0)
    for i in range(200):
        entry, _ = store.find(system + f"conversation {i} ".encode() * 100 + b"and its next turn")
        assert entry.value == i


def test_the_byte_budget_holds_and_the_least_recently_used_goes_first():
    registry = CollectorRegistry()
    metrics = PrefixStoreMetrics(registry, "t")
    store: PrefixStore[int] = PrefixStore(10_000, min_bytes=16, metrics=metrics)
    metrics.bind(lambda: store.bytes, lambda: len(store))
    for i in range(5):
        store.put(bytes([i]) * 1000, i, 1000)  # 2,000 bytes each
    store.find(bytes([0]) * 1000)  # entry 0 is used again
    store.put(bytes([9]) * 1000, 9, 1000)
    assert store.bytes <= 10_000
    assert store.find(bytes([1]) * 1000) is None  # the least recently used went
    assert store.find(bytes([0]) * 1000) is not None
    assert registry.get_sample_value("t_evictions_total", {"reason": "capacity"}) == 1
    assert registry.get_sample_value("t_bytes") == store.bytes == 10_000
    assert store.put(b"z" * 6000, 0, 5000) is None  # bigger than the budget: not held


def test_a_turn_replaces_the_turn_it_extends():
    registry = CollectorRegistry()
    store: PrefixStore[int] = PrefixStore(1 << 20, min_bytes=16, metrics=PrefixStoreMetrics(registry, "t"))
    text = b"turn " * 100
    previous = store.put(text, 0, 0)
    for turn in range(1, 20):
        text += b"more " * 20
        entry, _ = store.find(text)
        assert entry is previous
        previous = store.put(text, turn, 0, supersedes=entry)
    assert len(store) == 1
    assert registry.get_sample_value("t_evictions_total", {"reason": "superseded"}) == 19


# ---- block keys --------------------------------------------------------------------------------

def test_cached_block_keys_equal_the_keyer_for_growing_edited_and_foreign_prompts():
    keyer = BlockKeyer(16)
    registry = CollectorRegistry()
    cache = BlockKeyCache(keyer, 1 << 20, metrics=PrefixStoreMetrics(registry, "k"))
    rng = random.Random(5)
    tokens = [rng.randrange(2000) for _ in range(3000)]
    for step in range(60):
        action = rng.random()
        if action < 0.6:
            tokens = tokens + [rng.randrange(2000) for _ in range(rng.randint(1, 300))]  # the next turn
        elif action < 0.8:
            tokens = tokens[:len(tokens) - rng.randint(1, 40)] + [rng.randrange(2000)]  # the end changed
        else:
            tokens = [rng.randrange(2000) for _ in range(rng.randint(0, 3000))]  # another conversation
        model, salt = rng.choice([("m", None), ("m", "salt"), ("lora", None)])
        as_array = array("I", tokens) if rng.random() < 0.5 else list(tokens)
        assert list(cache.request_keys(as_array, model, salt)) == keyer.request_keys(tokens, model, salt), step
    assert registry.get_sample_value("k_lookups_total", {"outcome": "hit"}) > 20
    assert registry.get_sample_value("k_bytes") == cache.store.bytes <= 1 << 20


def test_a_next_turn_hashes_only_its_new_blocks():
    keyer = BlockKeyer(16)
    cache = BlockKeyCache(keyer, 1 << 20)
    tokens = array("I", range(16 * 1000))
    cache.request_keys(tokens, "m")
    tokens.extend(range(16 * 10))
    work = cache.start(tokens, "m")
    assert work.to_hash == 10
    assert list(cache.finish(work)) == keyer.request_keys(list(tokens), "m")


def test_keys_of_another_model_or_salt_are_never_reused():
    keyer = BlockKeyer(16)
    cache = BlockKeyCache(keyer, 1 << 20)
    tokens = array("I", range(16 * 100))
    cache.request_keys(tokens, "m")
    assert cache.start(tokens, "other").to_hash == 100
    assert cache.start(tokens, "m", "salt").to_hash == 100


# ---- tokenization ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0, weights=False)


def chat(messages):
    return InferenceRequest("r", "chat/completions", "tiny", "tiny", {"messages": messages},
                            path="/v1/chat/completions", format=format_of("chat/completions"))


async def test_interleaved_chats_sharing_a_system_prompt_each_hit_their_previous_turn(model_dir):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    registry = CollectorRegistry()
    pool = TokenizerPool({"tiny": str(model_dir)}, cache_min_chars=256, offload_chars=1 << 30, registry=registry)
    try:
        template = pool.load("tiny").chat_template
        rng = random.Random(11)
        system = {"role": "system", "content": words(rng, 400)}  # ~2 KB shared by all 60
        chats = [[system] for _ in range(60)]
        for _turn in range(4):
            for messages in chats:  # every conversation's turn before any conversation's next
                messages.append({"role": "user", "content": words(rng, rng.randint(5, 60))})
                ids = await pool.tokenize(chat(messages))
                assert list(ids) == tok.encode(template.render(messages), add_special_tokens=False).ids
                messages.append({"role": "assistant", "content": words(rng, rng.randint(5, 60))})
        value = registry.get_sample_value
        assert value("epp_tokenization_cache_lookups_total", {"outcome": "prefix_hit"}) == 60 * 3
        assert value("epp_tokenization_cache_store_entries") == 60  # one entry per conversation
        assert value("epp_tokenization_cache_store_evictions_total", {"reason": "superseded"}) == 60 * 3
        assert value("epp_tokenization_cache_store_bytes") > 0
    finally:
        pool.close()


def test_the_tokenization_budget_holds_under_many_conversations(model_dir):
    registry = CollectorRegistry()
    pool = TokenizerPool({"tiny": str(model_dir)}, cache_tokens=20_000, cache_min_chars=256, registry=registry)
    try:
        tokenizer = pool.load("tiny")
        rng = random.Random(3)
        for _ in range(40):
            tokenizer.encode_text(words(rng, 600), False)  # ~1,300 tokens, ~3 KB each
        cache = tokenizer.cache
        assert cache.bytes <= 20_000 * 16
        assert cache.tokens < 20_000
        assert registry.get_sample_value("epp_tokenization_cache_store_evictions_total", {"reason": "capacity"}) > 0
    finally:
        pool.close()
