"""Which parser and API a path names, what each API's body must hold, and paths no parser reads (passed through)."""

from __future__ import annotations

import json

import pytest

from epp.framework import ErrorCode, InferenceError
from epp.request.parsing import RequestParser


@pytest.mark.parametrize("path, parser, kind", [
    ("/v1/completions", "openai-parser", "completions"),
    ("/v1/chat/completions?x=1", "openai-parser", "chat/completions"),
    ("/v1/responses", "openai-parser", "responses"),
    ("/v1/conversations", "openai-parser", "conversations"),
    ("/v1/embeddings/", "openai-parser", "embeddings"),
    ("/v1/messages", "anthropic-parser", "messages"),
    ("/v1/messages?beta=true", "anthropic-parser", "messages"),
    ("/v1/messages/count_tokens", "anthropic-parser", "messages/count_tokens"),
    ("/rerank", "openai-parser", "rerank"), ("/v1/rerank", "openai-parser", "rerank"),
    ("/v2/rerank", "openai-parser", "rerank"),
    ("/inference/v1/generate", "vllmhttp-parser", "generate"),
    ("/generate", "passthrough-parser", "passthrough"),  # SGLang's: not in llm-d's default chain
    ("/v1/score", "passthrough-parser", "passthrough"), ("/tokenize", "passthrough-parser", "passthrough"),
    ("/v1/models", "passthrough-parser", "passthrough"),
])
def test_the_path_names_the_parser_and_api_in_the_default_chain(path, parser, kind):
    found, api = RequestParser().parser_for(path)
    assert (found.type_name, api) == (parser, kind)


def parse(path: str, body: bytes | dict, **headers: str):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return RequestParser().parse(request_id="r", headers={":path": path, **headers}, body=data, subset_hint=None)


def refusal(path: str, body: dict) -> str:
    with pytest.raises(InferenceError) as caught:
        parse(path, body)
    assert caught.value.code is ErrorCode.BAD_REQUEST and caught.value.drop_reason is None
    return caught.value.message


def test_a_messages_body_is_read_for_its_model_stream_and_salt():
    body = {"model": "claude-ish", "max_tokens": 16, "stream": True, "cache_salt": "s1", "metadata": {"user_id": "u"},
            "system": [{"type": "text", "text": "terse"}],
            "messages": [{"role": "user", "content": [
                {"type": "image", "source": {"type": "url", "url": "https://example.invalid/cat.png"}},
                {"type": "text", "text": "what is it?"}]},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "look", "input": {}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "a cat"}]}]}
    request, forwarded = parse("/v1/messages", body)
    assert (request.api, request.model, request.stream, request.cache_salt) == ("messages", "claude-ish", True,
                                                                              "s1")
    assert forwarded == json.dumps(body).encode()


def test_a_messages_model_rewrite_rewrites_the_body():
    request, forwarded = parse("/v1/messages", {"model": "a", "messages": [{"role": "user", "content": "hi"}]},
                               **{"x-llm-d-model-name-rewrite": "b"})
    assert (request.model, request.target_model, json.loads(forwarded)["model"]) == ("a", "b", "b")


@pytest.mark.parametrize("body, message", [
    ({"messages": [{"role": "user", "content": "hi"}]}, "model not found in request body"),
    ({"model": "m"}, "invalid messages request: must have valid messages field"),
    ({"model": "m", "messages": []}, "invalid messages request: must have valid messages field"),
    ({"model": "m", "messages": ["hi"]},
     "invalid messages request: must have valid messages field: messages[0] is not an object"),
    ({"model": "m", "messages": [{"role": "tool", "content": "x"}]},
     "invalid messages request: must have valid messages field: messages[0].role must be one of user, assistant, "
     "system"),
    ({"model": "m", "messages": [{"role": "user"}]},
     "invalid messages request: must have valid messages field: messages[0].content must be a string or a list of "
     "content blocks"),
    ({"model": "m", "messages": [{"role": "user", "content": [{"text": "no type"}]}]},
     "invalid messages request: must have valid messages field: messages[0].content[0] is not a content block (an "
     "object with a string type)"),
    ({"model": "m", "system": 3, "messages": [{"role": "user", "content": "hi"}]},
     "invalid messages request: must have valid system field: a string or a list of text blocks"),
    ({"model": "m", "system": ["be brief"], "messages": [{"role": "user", "content": "hi"}]},
     "invalid messages request: must have valid system field: system[0] is not a content block (an object with a "
     "string type)"),
])
def test_a_bad_messages_body_is_refused_like_the_openai_paths(body, message):
    assert refusal("/v1/messages", body) == message


def test_a_rerank_body_needs_its_query_and_documents():
    request, _ = parse("/v2/rerank", {"model": "m", "query": "q", "documents": ["a"]})
    assert request.api == "rerank"
    assert refusal("/v1/rerank", {"model": "m", "query": "q"}) == \
        "invalid rerank request: must have query and documents fields"
    assert refusal("/rerank", {"query": "q", "documents": ["a"]}) == "model not found in request body"


@pytest.mark.parametrize("body, model", [
    (b'{"model":"m","text_1":"a","text_2":"b"}', "m"),
    (b'  {"input":"no model"}', ""),
    (b"--xyz\r\nContent-Disposition: form-data; name=\"file\"\r\n\r\n\x00\x01\r\n--xyz--", ""),
    (b"[" * 10_000, ""),  # nested past the limit: not parsed at all
    (b'{"model": 7}', ""),
    (b'{"model":"m\\ud800"}', ""),  # a lone surrogate is no model name (nothing could hash it)
])
def test_a_body_on_a_path_no_parser_reads_is_passed_on_unchecked(body, model):
    request, forwarded = parse("/v1/score", body)
    assert (request.api, request.model, request.target_model, forwarded) == ("passthrough", model, model, body)
    assert request.body == {}


def test_a_passed_through_request_still_has_its_control_headers_read():
    request, _ = parse("/tokenize", b"{}", **{"x-llm-d-inference-fairness-id": "tenant-a",
                                              "x-llm-d-slo-ttft-ms": "250"})
    assert (request.fairness_id, request.slo_ttft_ms) == ("tenant-a", 250.0)
    with pytest.raises(InferenceError, match="is not a latency objective"):
        parse("/tokenize", b"{}", **{"x-llm-d-slo-ttft-ms": "soon"})


def test_a_request_without_a_path_is_read_as_completions():
    request, _ = RequestParser().parse(request_id="r", headers={}, body=b'{"model":"m","prompt":"p"}',
                                       subset_hint=None)
    assert request.api == "completions"
