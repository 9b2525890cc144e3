"""Which API a path names, what each API's body must hold, and paths no parser reads (passed through)."""

from __future__ import annotations

import json

import pytest

from epp.framework import ApiKind, ErrorCode, InferenceError
from epp.request.parsing import RequestParser, api_kind_for_path


@pytest.mark.parametrize("path, kind", [
    ("/v1/completions", ApiKind.COMPLETIONS),
    ("/v1/chat/completions?x=1", ApiKind.CHAT_COMPLETIONS),
    ("/v1/responses", ApiKind.RESPONSES),
    ("/v1/conversations", ApiKind.CONVERSATIONS),
    ("/v1/embeddings/", ApiKind.EMBEDDINGS),
    ("/v1/messages", ApiKind.MESSAGES),
    ("/v1/messages?beta=true", ApiKind.MESSAGES),
    ("/rerank", ApiKind.RERANK), ("/v1/rerank", ApiKind.RERANK), ("/v2/rerank", ApiKind.RERANK),
    ("/v1/messages/count_tokens", ApiKind.PASSTHROUGH),
    ("/v1/score", ApiKind.PASSTHROUGH), ("/tokenize", ApiKind.PASSTHROUGH), ("/v1/models", ApiKind.PASSTHROUGH),
])
def test_the_path_names_the_api(path, kind):
    assert api_kind_for_path(path) is kind


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
    assert (request.api, request.model, request.stream, request.cache_salt) == (ApiKind.MESSAGES, "claude-ish", True,
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
    assert request.api is ApiKind.RERANK
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
    assert (request.api, request.model, request.target_model, forwarded) == (ApiKind.PASSTHROUGH, model, model, body)
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
    assert request.api is ApiKind.COMPLETIONS
