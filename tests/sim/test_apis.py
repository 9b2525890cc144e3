"""Every API the picker parses, served by a simulated replica over real loopback HTTP.

OpenAI Responses (with `previous_response_id` kept per replica), embeddings; Anthropic messages
and count_tokens; vLLM's `/inference/v1/generate` and SGLang's `/generate`. Each runs its prompt
through the same engine, so a prompt one API left in the prefix cache is found by another.
"""

from __future__ import annotations

import base64
import json
import struct

import aiohttp
import pytest

from epp.engine.sim import FleetConfig, SimFleet
from epp.engine.sim.hashing import block_hashes, external_hash, none_hash

SYSTEM = "You answer questions about the customer table, politely and in full sentences. " * 4
QUESTION = "How many customers ordered twice?"


@pytest.fixture
async def fleet(tokenizer_dir):
    async with SimFleet(FleetConfig(replicas=2, tokenizer_dir=tokenizer_dir, kv_events=False,
                                    lora_modules={"sql-lora": "/adapters/sql"},
                                    enable_prompt_tokens_details=True, enable_scale_out=True)) as f:
        yield f


@pytest.fixture
async def http():
    async with aiohttp.ClientSession() as s:
        yield s


def url(fleet, path, i=0):
    return f"http://{fleet.endpoints[i]}{path}"


async def post(http, fleet, path, body, i=0):
    async with http.post(url(fleet, path, i), json=body) as r:
        return r.status, r.headers, await r.json()


async def sse(http, fleet, path, body, i=0) -> list[tuple[str | None, object]]:
    """(event name or None, data) of each SSE event of a streamed answer."""
    async with http.post(url(fleet, path, i), json=body) as r:
        assert r.status == 200 and r.headers["content-type"].startswith("text/event-stream")
        text = await r.text()
    events = []
    for block in text.strip().split("\n\n"):
        name = None
        data = None
        for line in block.split("\n"):
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                raw = line[len("data: "):]
                data = raw if raw == "[DONE]" else json.loads(raw)
        events.append((name, data))
    return events


# -- OpenAI Responses ------------------------------------------------------------------------------

async def test_responses_json_usage_and_output(fleet, http):
    status, headers, body = await post(http, fleet, "/v1/responses", {
        "model": "sim-model", "instructions": SYSTEM, "input": QUESTION, "max_output_tokens": 6})
    assert status == 200 and headers["x-sim-replica"] == "sim-0"
    assert body["id"].startswith("resp_") and body["object"] == "response"
    assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}
    [item] = body["output"]
    assert item["type"] == "message" and item["role"] == "assistant"
    [part] = item["content"]
    assert part["type"] == "output_text" and part["text"].strip()
    usage = body["usage"]
    assert usage["output_tokens"] == 6 and usage["total_tokens"] == usage["input_tokens"] + 6
    assert usage["input_tokens_details"] == {"cached_tokens": 0}
    assert usage["output_tokens_details"] == {"reasoning_tokens": 0}


async def test_a_follow_up_extends_the_previous_prompt_and_hits_its_cache_on_the_same_replica(fleet, http):
    _, _, first = await post(http, fleet, "/v1/responses", {"model": "sim-model", "instructions": SYSTEM,
                                                            "input": QUESTION, "max_output_tokens": 8})
    _, _, second = await post(http, fleet, "/v1/responses", {
        "model": "sim-model", "input": [{"role": "user", "content": [{"type": "input_text", "text": "And thrice?"}]}],
        "previous_response_id": first["id"], "max_output_tokens": 4})
    assert second["previous_response_id"] == first["id"]
    # The follow-up's prompt is the first one, its answer and the new input: the first's full blocks are cached.
    assert second["usage"]["input_tokens"] > first["usage"]["input_tokens"] + first["usage"]["output_tokens"]
    assert second["usage"]["input_tokens_details"]["cached_tokens"] >= first["usage"]["input_tokens"] // 16 * 16 > 0
    # The other replica never produced it: vLLM's 404, so a follow-up routed elsewhere is visible.
    status, headers, error = await post(http, fleet, "/v1/responses", {
        "model": "sim-model", "input": "And thrice?", "previous_response_id": first["id"]}, i=1)
    assert (status, headers["x-sim-replica"]) == (404, "sim-1")
    assert error == {"error": {"message": f"Response with id '{first['id']}' not found.",
                               "type": "invalid_request_error", "param": "response_id", "code": 404}}
    async with http.get(url(fleet, f"/v1/responses/{first['id']}")) as r:
        assert r.status == 200 and (await r.json())["id"] == first["id"]
    async with http.get(url(fleet, "/sim/state", 1)) as r:
        assert (await r.json())["responses"]["not_found"] == 1


async def test_a_response_not_stored_cannot_be_continued(fleet, http):
    _, _, first = await post(http, fleet, "/v1/responses", {"model": "sim-model", "input": QUESTION,
                                                            "store": False, "max_output_tokens": 2})
    status, _, _ = await post(http, fleet, "/v1/responses", {"model": "sim-model", "input": "more",
                                                              "previous_response_id": first["id"]})
    assert status == 404


async def test_the_response_store_is_bounded_least_recently_used_first(tokenizer_dir, http):
    config = FleetConfig(replicas=1, tokenizer_dir=tokenizer_dir, kv_events=False, max_stored_responses=2)
    async with SimFleet(config) as fleet:
        ids = []
        for i in range(3):
            _, _, body = await post(http, fleet, "/v1/responses", {"model": "sim-model", "input": f"q{i}",
                                                                   "max_output_tokens": 1})
            ids.append(body["id"])
        statuses = []
        for response_id in ids:
            async with http.get(url(fleet, f"/v1/responses/{response_id}")) as r:
                statuses.append(r.status)
        assert statuses == [404, 200, 200]
        async with http.get(url(fleet, "/sim/state")) as r:
            assert (await r.json())["responses"] == {"stored": 2, "capacity": 2, "evicted": 1, "not_found": 1}


async def test_responses_stream_sends_the_responses_events_in_order(fleet, http):
    events = await sse(http, fleet, "/v1/responses", {"model": "sim-model", "input": QUESTION, "stream": True,
                                                      "max_output_tokens": 3})
    names = [name for name, _ in events]
    assert names == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * 3,
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.completed"]
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    assert all(data["type"] == name for name, data in events)
    text = "".join(data["delta"] for name, data in events if name == "response.output_text.delta")
    final = events[-1][1]["response"]
    assert final["status"] == "incomplete"
    assert final["output"][0]["content"][0]["text"] == text == events[7][1]["text"]
    assert final["usage"]["output_tokens"] == 3
    # Stored once streamed: a follow-up finds it.
    status, _, _ = await post(http, fleet, "/v1/responses", {"model": "sim-model", "input": "go on",
                                                              "previous_response_id": final["id"],
                                                              "max_output_tokens": 1})
    assert status == 200


@pytest.mark.parametrize("body, fragment", [
    ({"model": "sim-model"}, "'input' must be a string or a non-empty list"),
    ({"model": "sim-model", "input": [3]}, "'input[0]' must be an object"),
    ({"model": "sim-model", "input": [{"type": "message"}]}, "without a 'role'"),
    ({"model": "sim-model", "input": "x", "previous_response_id": 5}, "'previous_response_id' must be"),
    ({"model": "nope", "input": "x"}, "The model `nope` does not exist."),
])
async def test_bad_responses_requests_get_vllm_errors(fleet, http, body, fragment):
    status, _, error = await post(http, fleet, "/v1/responses", body)
    assert status in (400, 404) and fragment in error["error"]["message"]


# -- embeddings -------------------------------------------------------------------------------------

async def test_embeddings_of_texts_and_token_ids(fleet, http):
    status, _, body = await post(http, fleet, "/v1/embeddings", {"model": "sim-model",
                                                                 "input": ["the same words", "the same words", "other"]})
    assert status == 200 and body["object"] == "list" and body["id"].startswith("embd-")
    vectors = [d["embedding"] for d in body["data"]]
    assert [d["index"] for d in body["data"]] == [0, 1, 2] and {d["object"] for d in body["data"]} == {"embedding"}
    assert vectors[0] == vectors[1] != vectors[2]
    assert len(vectors[0]) == 128 and sum(v * v for v in vectors[0]) == pytest.approx(1.0)
    usage = body["usage"]
    assert usage["prompt_tokens"] == usage["total_tokens"] > 0 and usage["completion_tokens"] == 0
    _, _, encoded = await post(http, fleet, "/v1/embeddings", {"input": "the same words", "encoding_format": "base64"})
    raw = base64.b64decode(encoded["data"][0]["embedding"])
    assert list(struct.unpack(f"<{len(raw) // 4}f", raw)) == pytest.approx(vectors[0])
    _, _, ids = await post(http, fleet, "/v1/embeddings", {"input": [[5, 6, 7], [8, 9]]})
    assert len(ids["data"]) == 2 and ids["usage"]["prompt_tokens"] == 5


@pytest.mark.parametrize("body, fragment", [
    ({"input": []}, "'input' must be"),
    ({"input": [1, "a"]}, "'input' must be"),
    ({"input": "x", "dimensions": 8}, "matryoshka"),
    ({"input": "x", "encoding_format": "int8"}, "'encoding_format'"),
])
async def test_bad_embeddings_requests(fleet, http, body, fragment):
    status, _, error = await post(http, fleet, "/v1/embeddings", body)
    assert status == 400 and fragment in error["error"]["message"]


# -- Anthropic --------------------------------------------------------------------------------------

def messages_body(**extra) -> dict:
    return {"model": "sim-model", "max_tokens": 5, "system": [{"type": "text", "text": SYSTEM}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": QUESTION}]}], **extra}


async def test_anthropic_messages_json_and_cache_fields(fleet, http):
    answers = []
    for _ in range(2):
        status, headers, body = await post(http, fleet, "/v1/messages", messages_body())
        assert status == 200 and headers["x-sim-replica"] == "sim-0"
        answers.append(body)
    first, second = answers
    assert first["type"] == "message" and first["role"] == "assistant" and first["id"].startswith("msg_")
    assert first["stop_reason"] == "max_tokens" and first["stop_sequence"] is None
    assert first["content"][0]["type"] == "text" and first["content"][0]["text"].strip()
    u1, u2 = first["usage"], second["usage"]
    assert u1["cache_read_input_tokens"] == 0 and u1["cache_creation_input_tokens"] > 0
    # The second finds the first's full blocks: Anthropic's split of the same prompt.
    assert u2["cache_read_input_tokens"] == u1["cache_creation_input_tokens"]
    assert u2["input_tokens"] + u2["cache_read_input_tokens"] == u1["input_tokens"]
    assert u1["output_tokens"] == u2["output_tokens"] == 5


async def test_anthropic_usage_is_vllms_without_prompt_token_details(tokenizer_dir, http):
    async with SimFleet(FleetConfig(replicas=1, tokenizer_dir=tokenizer_dir, kv_events=False,
                                    enable_prompt_tokens_details=False)) as fleet:
        _, _, body = await post(http, fleet, "/v1/messages", messages_body())
        _, _, count = await post(http, fleet, "/v1/messages/count_tokens",
                                 {k: v for k, v in messages_body().items() if k != "max_tokens"})
    assert body["usage"] == {"input_tokens": count["input_tokens"], "output_tokens": 5}


async def test_anthropic_stream_events(fleet, http):
    events = await sse(http, fleet, "/v1/messages", messages_body(stream=True))
    names = [name for name, _ in events]
    assert names == ["message_start", "content_block_start", *["content_block_delta"] * 5, "content_block_stop",
                     "message_delta", "message_stop"]
    assert all(data["type"] == name for name, data in events)
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["output_tokens"] == 0
    assert events[1][1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    assert {d["delta"]["type"] for n, d in events if n == "content_block_delta"} == {"text_delta"}
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == 5


async def test_count_tokens_is_the_rendered_prompt_and_generates_nothing(fleet, http):
    body = {k: v for k, v in messages_body().items() if k != "max_tokens"}
    status, _, count = await post(http, fleet, "/v1/messages/count_tokens", body)
    assert status == 200 and count["input_tokens"] > 10
    assert count["context_management"] == {"original_input_tokens": count["input_tokens"]}
    _, _, answer = await post(http, fleet, "/v1/messages", messages_body())
    u = answer["usage"]
    assert u["input_tokens"] + u["cache_read_input_tokens"] == count["input_tokens"]
    async with http.get(url(fleet, "/sim/state")) as r:
        assert (await r.json())["steps"] > 0


@pytest.mark.parametrize("body, status, kind, fragment", [
    ({"model": "sim-model", "messages": [{"role": "user", "content": "x"}]}, 400, "invalid_request_error",
     "max_tokens"),
    ({"model": "sim-model", "max_tokens": 3, "messages": []}, 400, "invalid_request_error", "messages"),
    ({"model": "sim-model", "max_tokens": 3, "messages": [{"role": "robot", "content": "x"}]}, 400,
     "invalid_request_error", "role"),
    ({"model": "other", "max_tokens": 3, "messages": [{"role": "user", "content": "x"}]}, 404, "not_found_error",
     "does not exist"),
])
async def test_bad_anthropic_requests_get_anthropic_errors(fleet, http, body, status, kind, fragment):
    got, _, error = await post(http, fleet, "/v1/messages", body)
    assert got == status and error["type"] == "error"
    assert error["error"]["type"] == kind and fragment in error["error"]["message"]


# -- token in, token out ------------------------------------------------------------------------------

async def test_vllm_generate_takes_and_returns_token_ids_and_shares_the_cache_with_chat(fleet, http):
    chat = {"model": "sim-model", "messages": [{"role": "system", "content": SYSTEM},
                                               {"role": "user", "content": QUESTION}], "max_tokens": 2}
    _, _, tokens = await post(http, fleet, "/tokenize", {k: v for k, v in chat.items() if k != "max_tokens"})
    await post(http, fleet, "/v1/chat/completions", chat)
    status, _, body = await post(http, fleet, "/inference/v1/generate", {
        "token_ids": tokens["tokens"], "sampling_params": {"max_tokens": 4}, "model": "sim-model"})
    assert status == 200 and body["request_id"].startswith("generate-tokens-")
    [choice] = body["choices"]
    assert choice["finish_reason"] == "length" and len(choice["token_ids"]) == 4
    assert all(isinstance(t, int) for t in choice["token_ids"])
    usage = body["usage"]
    assert usage["prompt_tokens"] == tokens["count"] and usage["completion_tokens"] == 4
    # The chat request left the very same prompt's blocks: token ids in hit them.
    assert usage["prompt_tokens_details"]["cached_tokens"] == tokens["count"] // 16 * 16


async def test_vllm_generate_stream(fleet, http):
    events = await sse(http, fleet, "/inference/v1/generate", {
        "token_ids": list(range(10, 60)), "sampling_params": {"max_tokens": 3}, "stream": True,
        "stream_options": {"include_usage": True}, "request_id": "abc"})
    chunks = [data for _, data in events]
    assert chunks[-1] == "[DONE]"
    usage = chunks[-2]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 3
    token_chunks = chunks[:-2]
    assert sum(len(c["choices"][0]["token_ids"]) for c in token_chunks) == 3
    assert token_chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert {c["request_id"] for c in chunks[:-1]} == {"generate-tokens-abc"}


@pytest.mark.parametrize("body, fragment", [
    ({"sampling_params": {}}, "'token_ids'"),
    ({"token_ids": [1, 2]}, "'sampling_params' must be an object"),
    ({"token_ids": [1, 2], "sampling_params": {"n": 2}}, "'sampling_params.n' must be 1"),
    ({"token_ids": [1, "x"], "sampling_params": {}}, "'token_ids'"),
])
async def test_bad_vllm_generate_requests(fleet, http, body, fragment):
    status, _, error = await post(http, fleet, "/inference/v1/generate", body)
    assert status == 400 and fragment in error["error"]["message"]


async def test_sglang_generate_text_and_ids(fleet, http, tokenizer):
    status, _, body = await post(http, fleet, "/generate", {"text": SYSTEM, "sampling_params": {"max_new_tokens": 4}})
    assert status == 200
    assert body["text"].strip() and len(body["output_ids"]) == 4
    meta = body["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 4}
    assert meta["prompt_tokens"] == len(tokenizer.encode(SYSTEM)) and meta["completion_tokens"] == 4
    assert meta["cached_tokens"] == 0 and meta["e2e_latency"] > 0
    _, _, again = await post(http, fleet, "/generate", {"input_ids": tokenizer.encode(SYSTEM),
                                                        "sampling_params": {"max_new_tokens": 2}})
    assert again["meta_info"]["cached_tokens"] == meta["prompt_tokens"] // 16 * 16
    _, _, natural = await post(http, fleet, "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 500}})
    assert natural["meta_info"]["finish_reason"] == {"type": "stop", "matched": tokenizer.eos_token_id}


async def test_sglang_generate_stream_sends_the_text_so_far(fleet, http):
    events = await sse(http, fleet, "/generate", {"text": "hello", "sampling_params": {"max_new_tokens": 3},
                                                  "stream": True})
    chunks = [data for _, data in events]
    assert chunks[-1] == "[DONE]"
    texts = [c["text"] for c in chunks[:-1]]
    assert all(later.startswith(earlier) for earlier, later in zip(texts, texts[1:]))
    assert len(chunks[-2]["output_ids"]) == 3 and chunks[-2]["meta_info"]["finish_reason"]["type"] == "length"
    status, _, error = await post(http, fleet, "/generate", {"text": ["a", "b"]})
    assert status == 400 and "batches are not served" in error["error"]["message"]


async def test_new_apis_publish_the_kv_events_of_their_prompt(tokenizer_dir, http, subscriber_factory):
    async with SimFleet(FleetConfig(replicas=1, tokenizer_dir=tokenizer_dir, enable_scale_out=True)) as fleet:
        info = fleet.info[0]
        sub = subscriber_factory(info["kv_events_endpoint"])
        await sub.ready()
        ids = list(range(100, 164))  # four full blocks of 16
        status, _, _ = await post(http, fleet, "/inference/v1/generate", {"token_ids": ids,
                                                                          "sampling_params": {"max_tokens": 1}})
        assert status == 200
        await sub.drain()
    stored = [h for ev in sub.events() if ev["type"] == "BlockStored" for h in ev["block_hashes"]]
    expected = [external_hash(d) for d in block_hashes(ids, 16, root=none_hash())]
    assert stored[:4] == expected
