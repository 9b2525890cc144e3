"""Each built-in parser: what it reads of a body, the normalised views it gives, its responses and error shape."""

from __future__ import annotations

import json
from array import array

import pytest

from epp.framework import ErrorCode, InferenceError, MediaItem, UnreadableResponse, media_digest
from epp.framework.plugin import PluginContext
from epp.framework.registry import default_registry
from epp.request.parsing import RequestParser

CHAIN = RequestParser(parsers=[default_registry().build(t, t, None, PluginContext()) for t in (
    "openai-parser", "anthropic-parser", "vllmhttp-parser", "sglanghttp-parser", "passthrough-parser")])
CAT = "https://example.invalid/cat.png"
DOG = "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk"


def parse(path: str, body: dict | bytes, **headers: str):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return CHAIN.parse(request_id="r", headers={":path": path, **headers}, body=data, subset_hint=None)[0]


def refused(path: str, body: dict) -> InferenceError:
    with pytest.raises(InferenceError) as caught:
        parse(path, body)
    return caught.value


def chat(*parts, model="m", **extra):
    return {"model": model, "messages": [{"role": "system", "content": "be brief"},
                                         {"role": "user", "content": list(parts)}], **extra}


# -- OpenAI ---------------------------------------------------------------------------------------------

def test_a_chat_request_is_read_into_its_normalised_views():
    request = parse("/v1/chat/completions", chat({"type": "text", "text": "what is it?"},
                                                 {"type": "image_url", "image_url": {"url": CAT}},
                                                 stream=True, cache_salt="s", prompt_cache_key="conv-7", user="u"))
    assert (request.format.type_name, request.api, request.stream, request.cache_salt, request.body_session) == \
        ("openai-parser", "chat/completions", True, "s", "conv-7")
    assert request.prompt_text() == "be brief\nwhat is it?"
    assert len(request.prompt_items()) == 2
    assert request.media() == (MediaItem("image", media_digest({"image_url": {"url": CAT}}), 1),)
    assert request.token_ids() is None and request.generates and request.previous_response is None
    fmt = request.format
    assert fmt.chat_body(request) is request.body and fmt.completion_text(request) is None
    assert fmt.render_request(request).path == "/v1/chat/completions/render"
    assert fmt.operation(request) == "chat"


def test_a_media_part_stands_as_its_digest_at_its_place_in_the_prefix_bytes():
    text = {"type": "text", "text": "describe"}
    same = parse("/v1/chat/completions", chat({"type": "image_url", "image_url": {"url": CAT}}, text)).prompt_bytes()
    again = parse("/v1/chat/completions", chat({"type": "image_url", "image_url": {"url": CAT}}, text)).prompt_bytes()
    other = parse("/v1/chat/completions", chat({"type": "image_url", "image_url": {"url": DOG}}, text)).prompt_bytes()
    assert same == again != other
    assert CAT.encode() not in same and media_digest({"image_url": {"url": CAT}}).encode() in same
    # The bytes agree up to the image, then differ: credit is shared before it, not after.
    common = next(i for i, (a, b) in enumerate(zip(same, other)) if a != b)
    assert same[:common] == other[:common] and b"be brief" in same[:common]
    # A text-only chat's bytes are the messages' JSON, as before parsers.
    plain = parse("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hé"}]})
    assert plain.prompt_bytes() == '[{"role":"user","content":"hé"}]'.encode()


@pytest.mark.parametrize("part, modality", [
    ({"type": "input_audio", "input_audio": {"data": "UklGR", "format": "wav"}}, "audio"),
    ({"type": "video_url", "video_url": {"url": "https://example.invalid/v.mp4"}}, "video"),
    ({"type": "audio_url", "audio_url": {"url": "https://example.invalid/a.mp3"}}, "audio"),
    ({"type": "file", "file": {"file_id": "file-1"}}, "file"),
])
def test_every_media_part_type_is_a_media_item(part, modality):
    (item,) = parse("/v1/chat/completions", chat(part)).media()
    assert item.modality == modality and item.item == 1


def test_a_completions_prompt_of_token_ids_is_read_as_ids_and_a_batch_by_its_first():
    assert parse("/v1/completions", {"model": "m", "prompt": [5, 6, 7]}).token_ids() == [5, 6, 7]
    batch = parse("/v1/completions", {"model": "m", "prompt": [[1, 2], [3]]})
    assert batch.token_ids() == [1, 2]
    text = parse("/v1/completions", {"model": "m", "prompt": ["first", "second"], "add_special_tokens": False})
    assert text.format.completion_text(text) == ("first", False)
    assert text.prompt_text() == "first second" and text.format.operation(text) == "text_completion"


def test_responses_input_instructions_media_and_previous_response():
    body = {"model": "m", "instructions": "be brief", "previous_response_id": "resp_1", "store": True,
            "input": [{"role": "user", "content": [{"type": "input_text", "text": "and this?"},
                                                   {"type": "input_image", "image_url": CAT}]}]}
    request = parse("/v1/responses", body)
    assert request.previous_response == "resp_1"
    assert request.prompt_text() == "be brief\nand this?"
    assert [m.modality for m in request.media()] == ["image"]
    assert request.format.render_request(request).path == "/v1/responses/render"
    assert CAT.encode() not in request.prompt_bytes()
    assert refused("/v1/responses", {**body, "previous_response_id": 7}).param == "previous_response_id"
    assert parse("/v1/responses", {"model": "m", "input": "hi"}).prompt_text() == "hi"


def test_embeddings_and_rerank_keep_their_prefix_bytes():
    assert parse("/v1/embeddings", {"model": "m", "input": ["a", "b"]}).prompt_bytes() == b'["a","b"]'
    rerank = parse("/v1/rerank", {"model": "m", "query": "q", "documents": ["a", "b"]})
    assert rerank.prompt_bytes() == b'[{"query":"q"},{"documents":["a","b"]}]'
    assert rerank.format.operation(rerank) is None


def test_openai_usage_first_token_and_response_ids_from_real_looking_chunks():
    request = parse("/v1/chat/completions", chat({"type": "text", "text": "hi"}, stream=True))
    fmt = request.format
    role = b'data: {"id":"c","choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
    token = b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"Hi"}}]}\n\n'
    usage = b'data: {"id":"c","choices":[],"usage":{"prompt_tokens":9,"completion_tokens":2}}\n\ndata: [DONE]\n\n'
    assert (fmt.carries_token(request, role), fmt.carries_token(request, token)) == (False, True)
    assert fmt.usage(request, token, streamed=True) is None
    assert fmt.usage(request, usage, streamed=True) == {"prompt_tokens": 9, "completion_tokens": 2}
    assert fmt.response_id(request, usage, streamed=True) is None  # chat completions store nothing
    responses = parse("/v1/responses", {"model": "m", "input": "hi", "stream": True})
    created = (b'event: response.created\ndata: {"type":"response.created","sequence_number":0,"response":'
               b'{"id":"resp_abc","object":"response","status":"in_progress"}}\n\n')
    completed = (b'event: response.completed\ndata: {"type":"response.completed","response":{"id":"resp_abc",'
                 b'"object":"response","usage":{"input_tokens":4,"output_tokens":2,"total_tokens":6}}}\n\n')
    assert responses.format.response_id(responses, created, streamed=True) == "resp_abc"
    # In OpenAI's names, as RequestFormat.usage promises (the Responses API's own names kept beside them).
    assert responses.format.usage(responses, completed, streamed=True) == {
        "input_tokens": 4, "output_tokens": 2, "total_tokens": 6, "prompt_tokens": 4, "completion_tokens": 2}
    whole = b'{"id":"resp_x","object":"response","usage":{"input_tokens":1,"output_tokens":1}}'
    assert responses.format.response_id(responses, whole, streamed=False) == "resp_x"
    assert responses.format.response_id(responses, b'{"error":{"message":"x"}}', streamed=False) is None
    with pytest.raises(UnreadableResponse):
        fmt.usage(request, b"[" * 200 + b"]" * 200, streamed=False)


# -- Anthropic ------------------------------------------------------------------------------------------

MESSAGES = {"model": "claude-ish", "max_tokens": 16, "metadata": {"user_id": "agent-1"},
            "system": "be brief", "messages": [{"role": "user", "content": [
                {"type": "image", "source": {"type": "url", "url": CAT}},
                {"type": "text", "text": "what is it?"}]}]}


def test_a_messages_request_is_read_with_its_session_media_and_chat_body():
    request = parse("/v1/messages", MESSAGES)
    assert (request.format.type_name, request.api, request.body_session) == ("anthropic-parser", "messages",
                                                                             "agent-1")
    assert request.prompt_text() == "be brief\nwhat is it?"
    assert request.media() == (MediaItem("image", media_digest({"type": "url", "url": CAT}), 1),)
    assert request.generates
    body = request.format.chat_body(request)
    assert body["messages"][0] == {"role": "system", "content": "be brief"}
    assert request.format.render_request(request, prefill_only=True).body["max_tokens"] == 1


def test_count_tokens_is_routed_as_messages_but_generates_nothing():
    request = parse("/v1/messages/count_tokens", {k: v for k, v in MESSAGES.items() if k != "max_tokens"})
    assert (request.api, request.generates) == ("messages/count_tokens", False)
    assert request.prompt_bytes() == parse("/v1/messages", MESSAGES).prompt_bytes()
    assert request.format.render_request(request) is None
    assert refused("/v1/messages/count_tokens", {"model": "m"}).message == \
        "invalid count_tokens request: must have valid messages field"
    fmt = request.format
    assert fmt.usage(request, b'{"input_tokens":42}', streamed=False) is None  # not a generation's usage


def test_anthropic_usage_first_token_and_error_shape():
    request = parse("/v1/messages", {**MESSAGES, "stream": True})
    fmt = request.format
    start = (b'event: message_start\ndata: {"type":"message_start","message":{"usage":{"input_tokens":10,'
             b'"output_tokens":1}}}\n\nevent: content_block_start\ndata: {"type":"content_block_start"}\n\n')
    delta = b'event: content_block_delta\ndata: {"type":"content_block_delta","delta":{"text":"A cat"}}\n\n'
    end = (b'event: message_delta\ndata: {"type":"message_delta","usage":{"input_tokens":10,"output_tokens":5,'
           b'"cache_read_input_tokens":8}}\n\n')
    assert (fmt.carries_token(request, start), fmt.carries_token(request, delta)) == (False, True)
    assert fmt.usage(request, start, streamed=True) is None  # message_start counts before the output
    assert fmt.usage(request, end, streamed=True)["prompt_tokens"] == 18
    whole = b'{"type":"message","usage":{"input_tokens":3,"output_tokens":2}}'
    assert fmt.usage(request, whole, streamed=False)["completion_tokens"] == 2
    body = json.loads(fmt.error_body(InferenceError(ErrorCode.SERVICE_UNAVAILABLE, "busy")))
    assert body == {"type": "error", "error": {"type": "overloaded_error",
                                               "message": "inference error: ServiceUnavailable - busy"}}


# -- vLLM /inference/v1/generate ------------------------------------------------------------------------

def generate(ids=range(40), **extra):
    return {"token_ids": list(ids), "sampling_params": {"max_tokens": 4}, **extra}


def features(*items):
    """vLLM's features for (hash, offset, length) image items."""
    return {"mm_hashes": {"image": [h for h, _, _ in items]},
            "mm_placeholders": {"image": [{"offset": o, "length": n} for _, o, n in items]}}


def test_a_generate_request_is_token_ids_hashed_directly():
    request = parse("/inference/v1/generate", generate(cache_salt="t", stream=True, model="llama"))
    assert (request.format.type_name, request.api, request.model, request.cache_salt, request.stream) == \
        ("vllmhttp-parser", "generate", "llama", "t", True)
    assert request.token_ids() == list(range(40))
    assert request.prompt_bytes() == array("I", range(40)).tobytes()
    assert request.prompt_chars == 160 and request.prompt_text() == ""
    assert request.format.render_request(request) is None  # nothing to render: the ids are the prompt
    assert parse("/inference/v1/generate", generate()).model == ""


def test_generate_features_place_each_media_item_in_the_token_ids():
    request = parse("/inference/v1/generate", generate(features=features(("hash-cat", 8, 16))))
    (item,) = request.media()
    assert (item.engine_hash, item.token_offset, item.token_length) == ("hash-cat", 8, 16)
    same = parse("/inference/v1/generate", generate(features=features(("hash-cat", 8, 16)))).prompt_bytes()
    other = parse("/inference/v1/generate", generate(features=features(("hash-dog", 8, 16)))).prompt_bytes()
    assert request.prompt_bytes() == same != other
    assert same[:32] == other[:32] == array("I", range(8)).tobytes()  # the 8 tokens before the image are shared


@pytest.mark.parametrize("body, param", [
    ({"token_ids": []}, "token_ids"),
    ({"token_ids": [1, -2]}, "token_ids"),
    ({"token_ids": [1, True]}, "token_ids"),
    ({"token_ids": [1, 2], "features": {"mm_hashes": {"image": ["h"]}, "mm_placeholders": {}}}, "features"),
    ({"token_ids": [1, 2], "features": features(("h", 1, 5))}, "features"),  # runs past the ids
    ({"token_ids": [1, 2], "cache_salt": 3}, "cache_salt"),
])
def test_a_bad_generate_body_is_refused_naming_the_field(body, param):
    err = refused("/inference/v1/generate", body)
    assert err.code is ErrorCode.BAD_REQUEST and err.param == param


# -- SGLang /generate -----------------------------------------------------------------------------------

SGLANG = RequestParser(parsers=[default_registry().build("sglanghttp-parser", "s", None, PluginContext())])


def sglang(body: dict):
    return SGLANG.parse(request_id="r", headers={":path": "/generate"}, body=json.dumps(body).encode(),
                        subset_hint=None)[0]


def test_sglang_reads_ids_or_text_its_extra_key_and_images():
    ids = sglang({"input_ids": [[3, 4, 5], [6]], "extra_key": "tenant", "stream": True})
    assert (ids.api, ids.token_ids(), ids.cache_salt, ids.stream, ids.model) == ("generate", [3, 4, 5], "tenant",
                                                                                True, "")
    text = sglang({"text": "hello", "image_data": [CAT]})
    assert text.prompt_text() == "hello" and [m.modality for m in text.media()] == ["image"]
    assert text.prompt_bytes().endswith(b"hello")
    assert sglang({"text": "hello", "image_data": DOG}).prompt_bytes() != text.prompt_bytes()
    with pytest.raises(InferenceError, match="must have input_ids"):
        sglang({"sampling_params": {}})


def test_sglang_usage_is_read_from_meta_info_of_the_finished_chunk():
    request = sglang({"input_ids": [1, 2], "stream": True})
    fmt = request.format
    running = b'data: {"text":"a","meta_info":{"prompt_tokens":2,"completion_tokens":1,"finish_reason":null}}\n\n'
    done = (b'data: {"text":"ab","meta_info":{"prompt_tokens":2,"completion_tokens":2,"cached_tokens":1,'
            b'"finish_reason":{"type":"length"}}}\n\n')
    assert fmt.usage(request, running, streamed=True) is None
    assert fmt.usage(request, done, streamed=True) == {"prompt_tokens": 2, "completion_tokens": 2,
                                                       "prompt_tokens_details": {"cached_tokens": 1}}
    whole = b'{"text":"ab","meta_info":{"prompt_tokens":2,"completion_tokens":2}}'
    assert fmt.usage(request, whole, streamed=False) == {"prompt_tokens": 2, "completion_tokens": 2}


# -- passthrough ----------------------------------------------------------------------------------------

def test_a_passthrough_request_has_no_prompt_but_its_responses_usage_is_read():
    request = parse("/v1/audio/transcriptions", {"model": "whisper"})
    assert (request.format.type_name, request.model, request.prompt_bytes(), request.media()) == \
        ("passthrough-parser", "whisper", b"", ())
    assert request.format.usage(request, b'{"usage":{"prompt_tokens":3}}', streamed=False) == {"prompt_tokens": 3}
