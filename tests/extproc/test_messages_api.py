"""Anthropic's Messages API through the ext_proc stream: routing, its stream's first token and usage, its errors.

Also the paths no parser reads: their bodies, JSON or not, are routed and passed on unchanged.
"""

from __future__ import annotations

import json

import pytest

from epp.config.compose import endpoint_picker_config, plugin
from epp.server.runner import EppServer
from tests.support.configs import PREFIX_CONFIG
from tests.support.extproc import (
    ExtProcClient,
    drop_reason_of,
    headers_of,
    options,
    request_body,
    request_headers,
    response_body,
    response_headers,
    route,
    serving,
    started,
    subset_metadata,
)

MESSAGES = json.dumps({
    "model": "claude-ish", "max_tokens": 64, "stream": True,
    "system": [{"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}}],
    "messages": [{"role": "user", "content": [{"type": "text", "text": "Name a colour."}]}]}).encode()


def sse(*events: tuple[str, dict]) -> bytes:
    """Anthropic's stream framing: an `event:` line, then the event as JSON on a `data:` line."""
    return b"".join(f"event: {name}\ndata: {json.dumps(data)}\n\n".encode() for name, data in events)


START = sse(("message_start", {"type": "message_start", "message": {
    "id": "msg_1", "type": "message", "role": "assistant", "content": [], "model": "claude-ish",
    "usage": {"input_tokens": 12, "output_tokens": 0}}}),
    ("content_block_start", {"type": "content_block_start", "index": 0,
                             "content_block": {"type": "text", "text": ""}}),
    ("ping", {"type": "ping"}))
DELTA = sse(("content_block_delta", {"type": "content_block_delta", "index": 0,
                                     "delta": {"type": "text_delta", "text": "Teal"}}))
END = sse(("content_block_stop", {"type": "content_block_stop", "index": 0}),
          ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn"},
                             "usage": {"input_tokens": 12, "output_tokens": 2, "cache_read_input_tokens": 32}}),
          ("message_stop", {"type": "message_stop"}))


@pytest.fixture
async def picker():
    server = await started()
    client = ExtProcClient(server.grpc_port)
    yield server, client
    await client.close()
    await server.stop(0)


def token_sample(server, name: str, suffix: str) -> float | None:
    return server.metrics.registry.get_sample_value(
        f"inference_objective_{name}_{suffix}", {"model_name": "claude-ish", "target_model_name": "claude-ish"})


async def test_a_messages_stream_is_routed_timed_at_its_first_delta_and_its_usage_counted(picker):
    server, client = picker
    ledger = server.director.ledger
    target = server.endpoints.snapshot()[0]
    call = await client.open()
    await call.write(request_headers("/v1/messages"))
    await call.write(request_body(MESSAGES))
    routed, forwarded = await call.read(), await call.read()
    assert headers_of(routed.request_headers.response.header_mutation)["x-gateway-destination-endpoint"] == \
        target.hostport
    assert forwarded.request_body.response.body_mutation.streamed_response.body == MESSAGES
    await call.write(response_headers([(":status", "200"), ("content-type", "text/event-stream")]))
    await call.read()
    await call.write(response_body(START))  # message_start, content_block_start, ping: no output yet
    assert (await call.read()).response_body.response.body_mutation.streamed_response.body == START
    assert ledger.load(target).prefilling_requests == 1
    await call.write(response_body(DELTA))
    await call.read()
    assert ledger.load(target).prefilling_requests == 0
    await call.write(response_body(END, end_of_stream=True))
    await call.read()
    call.cancel()
    # message_start's usage is taken before the output; message_delta's is the final one, and the
    # prompt tokens include those read from cache (Anthropic's input_tokens leave them out).
    assert token_sample(server, "input_tokens", "sum") == 44
    assert token_sample(server, "output_tokens", "sum") == 2
    assert token_sample(server, "prompt_cached_tokens", "sum") == 32


async def test_a_messages_json_response_has_its_usage_counted(picker):
    server, client = picker
    answer = json.dumps({"id": "msg_2", "type": "message", "role": "assistant", "model": "claude-ish",
                         "content": [{"type": "text", "text": "Teal"}], "stop_reason": "end_turn",
                         "usage": {"input_tokens": 7, "output_tokens": 3, "cache_creation_input_tokens": 5}}).encode()
    body = MESSAGES.replace(b'"stream": true', b'"stream": false')
    replies = await client.exchange([request_headers("/v1/messages"), request_body(body),
                                     response_headers([(":status", "200"), ("content-type", "application/json")]),
                                     response_body(answer, end_of_stream=True)], expect=4)
    assert replies[3].response_body.response.body_mutation.streamed_response.body == answer
    assert (token_sample(server, "input_tokens", "sum"), token_sample(server, "output_tokens", "sum")) == (12, 3)


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages?beta=true"])
async def test_errors_on_the_messages_api_have_anthropics_shape(picker, path):
    _, client = picker
    [reply] = await client.exchange([request_headers(path), request_body(b'{"model":"m","messages":"hi"}')],
                                    expect=1)
    answer = reply.immediate_response
    assert answer.status.code == 400
    assert headers_of(answer.headers)["content-type"] == "application/json"
    assert json.loads(answer.body) == {"type": "error", "error": {
        "type": "invalid_request_error",
        "message": "inference error: BadRequest - invalid messages request: must have valid messages field"}}
    assert drop_reason_of(reply) is None


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
async def test_a_dropped_messages_request_says_why_in_anthropics_shape(picker, path):
    _, client = picker
    nowhere = subset_metadata(["192.0.2.1:8000"])
    [reply] = await client.exchange([request_headers(path, metadata=nowhere),
                                     request_body(MESSAGES, metadata=nowhere)], expect=1)
    assert reply.immediate_response.status.code == 503
    assert json.loads(reply.immediate_response.body) == {"type": "error", "error": {
        "type": "overloaded_error",
        "message": "inference error: ServiceUnavailable - failed to find endpoint candidates for serving the request"}}
    assert drop_reason_of(reply) == "rejected-no-endpoints"


@pytest.mark.parametrize("path, body", [
    ("/v1/audio/transcriptions",
     b'--xyz\r\nContent-Disposition: form-data; name="model"\r\n\r\nwhisper\r\n--xyz--\r\n'),
    ("/v1/score", b'{"model":"m","text_1":"a","text_2":"b"}'),
    ("/inference/v1/generate", b'{"token_ids":[1,2,3]}'),
])
async def test_bodies_on_paths_no_parser_reads_are_routed_unchanged(picker, path, body):
    _, client = picker
    replies = await client.exchange([request_headers(path), request_body(body)], expect=2)
    headers = headers_of(replies[0].request_headers.response.header_mutation)
    assert headers["x-gateway-destination-endpoint"].startswith("10.0.0.")
    assert replies[1].request_body.response.body_mutation.streamed_response.body == body


def messages_body(system: str, question: str) -> bytes:
    return json.dumps({"model": "claude-ish", "max_tokens": 16, "system": [{"type": "text", "text": system}],
                       "messages": [{"role": "user", "content": [{"type": "text", "text": question}]}]}).encode()


async def test_messages_sharing_a_long_system_prompt_go_where_it_is_cached():
    server = EppServer(options(config_text=PREFIX_CONFIG))
    async with serving(server) as client:
        homes = set()
        for i in range(3):
            system = f"agent {i}: you review pull requests for the parser team. " * 40
            first = (await route(client, messages_body(system, "first question"), path="/v1/messages"))[0]
            again = (await route(client, messages_body(system, "another question"), path="/v1/messages"))[0]
            assert again == first
            homes.add(first)
        assert len(homes) > 1  # different prompts are not all sent to one endpoint


async def test_filters_that_leave_no_endpoint_answer_429_rejected_no_endpoints():
    config = endpoint_picker_config(
        [plugin("label-selector-filter", matchLabels={"pool": "nowhere"}), "random-picker"],
        ["label-selector-filter", "random-picker"])
    server = EppServer(options(config_text=config))
    async with serving(server) as client:
        [reply] = await client.exchange([request_headers("/v1/messages"), request_body(MESSAGES)], expect=1)
    assert reply.immediate_response.status.code == 429
    assert json.loads(reply.immediate_response.body)["error"] == {
        "type": "rate_limit_error", "message": "inference error: ResourceExhausted - failed to find target endpoint: "
                                               "no endpoints available for the given request"}
    assert drop_reason_of(reply) == "rejected-no-endpoints"
