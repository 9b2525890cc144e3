"""The request parser reads bodies with msgspec first and json.loads for what msgspec refuses: the same answers as before."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from epp.framework.errors import InferenceError
from epp.framework.load import body_prompt_characters, prompt_characters
from epp.request.parsing import RequestParser

CHAT = {":path": "/v1/chat/completions"}


def parse(body: bytes, headers: dict[str, str] | None = None, parser: RequestParser | None = None):
    return (parser or RequestParser()).parse(request_id="r", headers=headers or CHAT, body=body, subset_hint=None)[0]


def _random_json(rng: random.Random, depth: int) -> Any:
    """Values of every JSON kind, with escapes, non-ASCII text, big and negative numbers and floats."""
    if depth == 0 or rng.random() < 0.3:
        return rng.choice(["plain", "tab\there", 'quote"d', "back\\slash", "\u00e9t\u00e9 \U0001f600",
                           "", 0, -7, 2**70, -2**65, 1.5, -0.0, 1e300, 3.141592653589793, 1e-320, True, False, None])
    if rng.random() < 0.5:
        return [_random_json(rng, depth - 1) for _ in range(rng.randint(0, 4))]
    return {f"k{i}\u00e9": _random_json(rng, depth - 1) for i in range(rng.randint(0, 4))}


def test_parsed_bodies_equal_what_json_loads_gives():
    rng = random.Random(34)
    for _ in range(500):
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "extra": _random_json(rng, 5)}
        raw = json.dumps(body, ensure_ascii=rng.random() < 0.5).encode()
        parsed = parse(raw).body
        assert parsed == json.loads(raw)
        assert json.dumps(parsed) == json.dumps(json.loads(raw))  # float and int types alike, key order kept


@pytest.mark.parametrize("raw", [
    b'{"model":"m","messages":[{"role":"user","content":"hi"}],"temperature":NaN}',
    b'{"model":"m","messages":[{"role":"user","content":"hi"}],"top_p":1e400}',
    b'\xef\xbb\xbf{"model":"m","messages":[{"role":"user","content":"hi"}]}',
    json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode("utf-16"),
])
def test_what_msgspec_refuses_is_read_as_json_loads_reads_it(raw):
    assert parse(raw).body == json.loads(raw) or "NaN" in raw.decode("latin-1")  # NaN != NaN
    assert parse(raw).body["model"] == "m"


@pytest.mark.parametrize("raw", [b'{"model":"m","messages":[{"role":"user","content":"\\ud800"}]}',
                                 b'{"model":"m","messages":[{"role":"user","content":"a\\udc00"}]}',
                                 # Raw surrogate bytes: json.loads decodes them (surrogatepass), no escape needed.
                                 b'{"model":"m\xed\xa0\x80","messages":[{"role":"user","content":"hi"}]}',
                                 '{"model":"m","prompt":"\ud800"}'.encode("utf-16-le", "surrogatepass")])
def test_lone_surrogates_are_still_refused_with_their_own_message(raw):
    with pytest.raises(InferenceError, match="lone UTF-16 surrogate"):
        parse(raw)


def test_malformed_json_is_still_a_bad_request():
    with pytest.raises(InferenceError, match="error unmarshaling request bodyMap"):
        parse(b'{"model":"m",')


def test_the_prompt_is_counted_once_and_every_reader_gets_the_walks_count():
    rng = random.Random(7)
    for _ in range(200):
        messages = [{"role": rng.choice(["user", "assistant"]),
                     "content": rng.choice(["x" * rng.randint(0, 50), [{"type": "text", "text": "abc"}], None,
                                                  [{"type": "ids", "ids": [1, 2, True]}]])}
                    for _ in range(rng.randint(1, 6))]
        body = {"model": "m", "messages": messages}
        request = parse(json.dumps(body).encode())
        assert request.prompt_chars == body_prompt_characters(body)
        for limit in (1, 10, 100, 1 << 22):
            assert prompt_characters(request, limit) == body_prompt_characters(body, limit)


def test_token_id_prompts_count_four_characters_a_token():
    request = parse(b'{"model":"m","prompt":[1,2,3]}', headers={":path": "/v1/completions"})
    assert request.prompt_chars == 12


def test_a_prompt_at_the_limit_passes_and_one_past_it_is_413():
    parser = RequestParser(max_prompt_chars=10)
    assert parse(b'{"model":"m","prompt":"0123456789"}', {":path": "/v1/completions"}, parser).prompt_chars == 10
    with pytest.raises(InferenceError) as err:
        parse(b'{"model":"m","prompt":"0123456789a"}', {":path": "/v1/completions"}, parser)
    assert err.value.code.http_status == 413
    assert "prompt exceeds the limit of 10 characters" in str(err.value)


def _reference_text_length(value, budget: int, depth: int = 0) -> int:
    """The prompt count as first written (one call per value): what the faster walk must equal."""
    if isinstance(value, str):
        return min(len(value), budget)
    if depth >= 8:
        return 0
    total = 0
    items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
    for item in items:
        if total >= budget:
            break
        if isinstance(item, int) and not isinstance(item, bool):
            total += 4
        else:
            total += _reference_text_length(item, budget - total, depth + 1)
    return total


def test_the_prompt_count_equals_the_one_call_per_value_walk_at_any_depth_and_budget():
    rng = random.Random(21)
    for _ in range(3000):
        value = _random_json(rng, rng.randint(1, 12))
        body = {"messages": [value, {"role": "user", "content": "abc", "n": [1, True, 2.5, None]}]}
        for budget in (0, 1, 5, 40, 1 << 22):
            parts = [body["messages"]]
            assert body_prompt_characters(body, budget) == _reference_text_length(parts, budget)


@pytest.mark.parametrize(("path", "body", "session"), [
    ("/v1/chat/completions", {"prompt_cache_key": "conv-7", "user": "alice"}, "conv-7"),
    ("/v1/chat/completions", {"user": "alice"}, "alice"),
    ("/v1/responses", {"input": "hi", "prompt_cache_key": "agent-1"}, "agent-1"),
    ("/v1/messages", {"max_tokens": 8, "metadata": {"user_id": "user_abc_session_9"}}, "user_abc_session_9"),
    ("/v1/messages", {"max_tokens": 8, "metadata": "not an object"}, None),
    ("/v1/chat/completions", {"user": 7}, None),
    ("/v1/chat/completions", {"user": "x" * 1000}, "x" * 256),
])
def test_the_session_a_body_names_is_read_as_its_api_spells_it(path, body, session):
    fields = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **body}
    assert parse(json.dumps(fields).encode(), {":path": path}).body_session == session
