"""Tokenization like vLLM: chat templates, special tokens, the prefix cache, off-loop work."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from epp.engine.tinymodel import _WORDS, write_tiny_model
from epp.framework.types import InferenceRequest
from epp.tokenization.chat_template import ChatTemplate, detect_content_format
from epp.tokenization.pool import TokenizerPool
from epp.tokenization.prefix_cache import TokenizationCache
from tests.support.requests import format_of

CAPTURE = Path(__file__).parents[1] / "fixtures" / "vllm_capture"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0, weights=False)


@pytest.fixture
def pool(model_dir):
    registry = CollectorRegistry()
    pool = TokenizerPool({"tiny": str(model_dir)}, cache_min_chars=256, offload_chars=2000, registry=registry)
    pool.registry = registry
    yield pool
    pool.close()


def completion(prompt, **body):
    return InferenceRequest("r", "completions", "tiny", "tiny", {"prompt": prompt, **body}, format=format_of("completions"))


def chat(messages, **body):
    return InferenceRequest("r", "chat/completions", "tiny", "tiny", {"messages": messages, **body},
                            path="/v1/chat/completions", format=format_of("chat/completions"))


def test_content_format_detection_follows_the_template():
    assert detect_content_format("{% for m in messages %}{{ m['content'] }}{% endfor %}") == "string"
    assert detect_content_format("{% for p in message['content'] %}{{ p.text }}{% endfor %}") == "openai"


def test_chat_template_renders_specials_parts_and_generation_prompt():
    template = ChatTemplate(
        "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{{ eos_token }}{% endfor %}"
        "{% if add_generation_prompt %}[assistant]{% endif %}", {"bos_token": "<s>", "eos_token": "</s>"})
    msgs = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert template.render(msgs) == "<s>[user]a\nb</s>[assistant]"
    assert template.render(msgs, add_generation_prompt=False) == "<s>[user]a\nb</s>"
    cont = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello wor"}]
    assert template.render(cont, continue_final_message=True) == "<s>[user]hi</s>[assistant]Hello wor"


async def test_completions_add_bos_and_token_prompts_pass_through(pool, model_dir):
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    ids = await pool.tokenize(completion("the cache block token"))
    assert list(ids) == tok.encode("the cache block token", add_special_tokens=True).ids
    assert ids[0] == tok.token_to_id("<s>")
    assert await pool.tokenize(completion([5, 6, 7])) == [5, 6, 7]
    unknown = InferenceRequest("r", "completions", "nope", "nope", {"prompt": "x"}, format=format_of("completions"))
    assert await pool.tokenize(unknown) is None


@pytest.mark.skipif(not (CAPTURE / "requests.json").exists(), reason="no vLLM capture recorded")
async def test_token_ids_equal_what_vllm_tokenized_in_the_capture(pool):
    requests = json.loads((CAPTURE / "requests.json").read_text())
    assert requests
    for req in requests:
        body = dict(req["body"])
        if req["kind"] == "chat":
            ours = await pool.tokenize(chat(body.pop("messages"), **body))
        else:
            ours = await pool.tokenize(completion(body.pop("prompt"), **body))
        assert list(ours) == req["prompt_token_ids"], req["name"]


def _random_text(rng: random.Random, words: int) -> str:
    pieces = []
    for _ in range(words):
        r = rng.random()
        if r < 0.05:
            pieces.append(rng.choice(["  ", "\n", "\n\n", "\t", "é", "日本", "🙂", "!!", "..."]))
        elif r < 0.1:
            pieces.append(str(rng.randint(0, 10**6)))
        else:
            pieces.append(rng.choice(_WORDS))
    return " ".join(pieces)


def _counting_encoders(tok):
    """A raw encoder (ids and offsets) and an ids-only one over `tok`, counting the characters each is given."""
    given = {"raw": 0, "ids": 0}

    def raw(text):
        given["raw"] += len(text)
        enc = tok.encode(text, add_special_tokens=False)
        return enc.ids, [o[0] for o in enc.offsets], [o[1] for o in enc.offsets]

    def ids_only(text):
        given["ids"] += len(text)
        return tok.encode_batch_fast([text], add_special_tokens=False)[0].ids

    return raw, ids_only, given


def _grow_conversations(cache, tok, rng, encoders, conversations, turns, start_words, turn_words):
    """Conversations of `start_words` words, each turn adding `turn_words` more joined at an arbitrary
    character (mid-word, mid-space-run, after a multibyte char): every turn equals full tokenization."""
    for _ in range(conversations):
        text = _random_text(rng, rng.randint(*start_words))
        for _turn in range(turns):
            text = text + _random_text(rng, rng.randint(*turn_words))[rng.randint(0, 3):]
            assert list(cache.encode(text, *encoders)) == tok.encode(text, add_special_tokens=False).ids


def test_cached_extensions_equal_full_tokenization_for_random_texts(model_dir):
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    raw, _, _ = _counting_encoders(tok)
    cache = TokenizationCache(200_000, min_chars=256)
    _grow_conversations(cache, tok, random.Random(7), (raw,), 60, 5, (80, 400), (1, 60))
    assert cache.stats.prefix_hits > 150  # the cache really did the work
    assert cache.stats.reused_tokens > 0


def test_long_turns_are_tokenized_without_offsets_and_equal_full_tokenization(model_dir):
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    raw, ids_only, given = _counting_encoders(tok)
    cache = TokenizationCache(2_000_000, min_chars=256)
    # a turn's reply and tool result: thousands of characters
    _grow_conversations(cache, tok, random.Random(11), (raw, ids_only), 8, 6, (800, 2000), (300, 1200))
    assert cache.stats.prefix_hits >= 40 and cache.stats.fallbacks <= 8
    # Offsets were computed for the ends and around the cuts only; the bulk went without them.
    assert given["raw"] < given["ids"] / 3


def test_a_prompt_that_departs_before_the_kept_offsets_is_tokenized_whole(model_dir):
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    raw, ids_only, _ = _counting_encoders(tok)
    cache = TokenizationCache(2_000_000, min_chars=256, tail_chars=512)
    rng = random.Random(5)
    head = _random_text(rng, 2000)
    first = head + _random_text(rng, 200)
    cache.encode(first, raw, ids_only)
    # shares more than half of the cached text, but departs long before its last 512 characters
    edited = first[: len(head)] + " rewritten " + _random_text(rng, 600)
    assert list(cache.encode(edited, raw, ids_only)) == tok.encode(edited, add_special_tokens=False).ids
    assert cache.stats.fallbacks == 1 and cache.stats.prefix_hits == 0


async def test_multi_turn_chat_equals_full_tokenization_and_hits_the_cache(pool, model_dir):
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    template = pool.load("tiny").chat_template
    rng = random.Random(3)
    messages = [{"role": "system", "content": _random_text(rng, 300)}]
    for _turn in range(8):
        messages.append({"role": "user", "content": _random_text(rng, rng.randint(5, 80))})
        ids = await pool.tokenize(chat(list(messages)))
        assert list(ids) == tok.encode(template.render(messages), add_special_tokens=False).ids
        messages.append({"role": "assistant", "content": _random_text(rng, rng.randint(5, 80))})
    hits = pool.registry.get_sample_value("epp_tokenization_cache_lookups_total", {"outcome": "prefix_hit"})
    assert hits and hits >= 6


async def test_long_prompts_tokenize_in_a_thread_while_the_loop_keeps_running(pool):
    await pool.preload()
    prompt = _random_text(random.Random(1), 40_000)  # ~200 KB
    ticks = 0

    async def ticker():
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0.001)

    task = asyncio.ensure_future(ticker())
    await asyncio.sleep(0)
    ids = await pool.tokenize(completion(prompt))
    task.cancel()
    assert len(ids) > 10_000
    assert pool.registry.get_sample_value("epp_tokenization_requests_total", {"where": "thread"}) >= 1
    assert ticks > 1  # the loop ran while the tokenizer worked
