"""Hostile input over real gRPC (issue #18 items 1-5, 7): each test sends the input that broke the picker."""

from __future__ import annotations

import asyncio
import json
import logging
import urllib.request

import grpc
import pytest

from epp.server.runner import EppServer
from tests.support.configs import PREFIX_CONFIG
from tests.support.extproc import (
    error_of,
    headers_of,
    options,
    request_body,
    request_headers,
    response_body,
    response_headers,
    serving,
    simple_pipeline,
)


@pytest.fixture
async def picker():
    server = EppServer(options(config_text=PREFIX_CONFIG))
    async with serving(server) as client:
        yield server, client


def scrape(server) -> tuple[int, bytes]:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10) as r:
        return r.status, r.read()


def nested(depth: int, leaf: str = "1") -> str:
    return "[" * depth + leaf + "]" * depth


async def rejected(client, body: bytes, path: str = "/v1/completions", extra=()) -> tuple[int, str]:
    [reply] = await client.exchange([request_headers(path, extra), request_body(body)], expect=1)
    status, message = error_of(reply)
    return status, message.decode()


def streamed_bodies(replies) -> bytes:
    return b"".join(r.response_body.response.body_mutation.streamed_response.body for r in replies
                    if r.HasField("response_body"))


# -- item 1: the picker, too, never lets a client's routing header through ----------------------

async def test_forged_routing_headers_are_overwritten_and_removed_by_the_picker(picker):
    _, client = picker
    forged = [("x-gateway-destination-endpoint", "192.0.2.1:80"),
              ("x-gateway-destination-endpoint-served", "192.0.2.1:80")]
    body = b'{"model":"m","prompt":"hello"}'
    with_body = await client.exchange([request_headers(extra=forged), request_body(body)], expect=2)
    header_only = await client.exchange([request_headers("/v1/models", forged, end_of_stream=True)], expect=1)
    for reply in (with_body[0], header_only[0]):
        mutation = reply.request_headers.response.header_mutation
        assert headers_of(mutation)["x-gateway-destination-endpoint"].startswith("10.0.0.")
        assert all(h.append_action == h.OVERWRITE_IF_EXISTS_OR_ADD for h in mutation.set_headers)
        # The sidecar's routing headers (P/D, E/PD, P2P) are picker-owned too: removed when not set.
        assert list(mutation.remove_headers) == ["x-gateway-destination-endpoint-served", "x-prefiller-host-port",
                                                 "x-encoder-hosts-ports", "x-kv-cache-source-host-port",
                                                 "x-kv-cache-source-p2p-port"]


# -- item 2: a model server's response is never replaced because the picker cannot read it ------

async def test_deeply_nested_response_bodies_pass_through_and_are_counted(picker, caplog):
    server, client = picker
    caplog.set_level(logging.WARNING)
    deep_json = ('{"id":"x","usage":' + nested(5000) + "}").encode()
    deep_sse = ('data: {"choices":[],"usage":{"prompt_tokens":' + nested(5000) + "}}\n\ndata: [DONE]\n\n").encode()
    cases = [(deep_json, "application/json"), (nested(5000).encode(), "application/json"),
             (deep_sse, "text/event-stream")]
    for body, content_type in cases:
        call = await client.open()
        for req in (request_headers(), request_body(b'{"model":"m","prompt":"hello"}'),
                    response_headers([(":status", "200"), ("content-type", content_type)]),
                    response_body(body[:7000]), response_body(body[7000:], end_of_stream=True)):
            await call.write(req)
        # headers + body reply, response headers, then the body: buffered JSON once, SSE per chunk.
        expect = 4 if content_type == "application/json" else 5
        replies = [await asyncio.wait_for(call.read(), 10) for _ in range(expect)]
        await call.done_writing()
        assert not any(r.HasField("immediate_response") for r in replies)
        assert streamed_bodies(replies) == body
    counted = server.metrics.unreadable_responses.labels("too_deep")._value.get()
    assert counted == 3
    lines = [r for r in caplog.records if "could not be read" in r.getMessage()]
    assert len(lines) == 1


async def test_absurd_token_counts_in_usage_do_not_fail_the_response(picker):
    server, client = picker
    body = json.dumps({"usage": {"prompt_tokens": 10**400, "completion_tokens": -5,
                                 "prompt_tokens_details": {"cached_tokens": True}}}).encode()
    replies = await client.exchange(
        [request_headers(), request_body(b'{"model":"m","prompt":"hello"}'),
         response_headers([(":status", "200"), ("content-type", "application/json")]),
         response_body(body, end_of_stream=True)], expect=4)
    assert streamed_bodies(replies) == body
    assert scrape(server)[0] == 200


# -- item 3: bad request JSON is the client's error: 400 that says what is wrong ----------------

@pytest.mark.parametrize("path,body", [
    ("/v1/completions", '{"model":"m","prompt":' + nested(1200, '"x"') + "}"),
    ("/v1/completions", nested(100_000)),
    ("/v1/responses", '{"model":"m","input":' + nested(600, '"x"') + "}"),
    ("/v1/responses", '{"model":"m","input":' + nested(900, '{"a":"x"}') + "}"),
    ("/v1/chat/completions", '{"model":"m","messages":[{"role":"user","content":' + nested(300, '{"type":"text"}')
     + "}]}"),
], ids=["completions-1200", "bare-100k", "responses-600", "responses-900", "chat-300"])
async def test_deeply_nested_request_json_gets_400(picker, path, body):
    _, client = picker
    status, message = await rejected(client, body.encode(), path)
    assert status == 400
    assert message == "inference error: BadRequest - request body nests objects/arrays deeper than 128 levels"


async def test_json_depth_up_to_the_limit_is_routed(picker):
    _, client = picker
    body = '{"model":"m","input":' + nested(127, '"x"') + "}"
    replies = await client.exchange([request_headers("/v1/responses"), request_body(body.encode())], expect=2)
    assert replies[0].HasField("request_headers")


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", r'{"model":"m","messages":[{"role":"user","content":"hi \ud800 there"}]}'),
    ("/v1/completions", r'{"model":"m\ud800","prompt":"hello"}'),
    ("/v1/completions", r'{"model":"m","prompt":"hello \udfff"}'),
    ("/v1/responses", r'{"model":"m","input":[{"\udc00key":"v"}]}'),
], ids=["chat-content", "model-name", "prompt", "key"])
async def test_lone_surrogates_get_400_and_metrics_keep_answering(picker, path, body):
    server, client = picker
    status, message = await rejected(client, body.encode(), path,
                                     extra=[("x-gateway-model-name-rewrite", "other")])
    assert status == 400
    assert "lone UTF-16 surrogate" in message
    assert scrape(server)[0] == 200


async def test_escaped_surrogate_pairs_are_fine(picker):
    _, client = picker
    body = rb'{"model":"m","messages":[{"role":"user","content":"smile \ud83d\ude00"}]}'
    replies = await client.exchange([request_headers("/v1/chat/completions",
                                                     [("x-gateway-model-name-rewrite", "other")]),
                                     request_body(body)], expect=2)
    forwarded = replies[1].request_body.response.body_mutation.streamed_response.body
    assert json.loads(forwarded)["messages"][0]["content"] == "smile \U0001f600"


# -- items 4 and 5: what a client puts into a metric label is bounded -------------------------

async def test_huge_model_names_keep_metrics_small(picker):
    server, client = picker
    _, before = scrape(server)
    for i in range(3):
        body = json.dumps({"model": chr(97 + i) * (1 << 20), "prompt": "x"}).encode()
        replies = await client.exchange([request_headers(), request_body(body)], expect=2)
        assert replies[0].HasField("request_headers")
    status, after = scrape(server)
    assert status == 200
    assert len(after) < len(before) + 200_000  # was +104 MB
    names = {line.split(b'model_name="', 1)[1].split(b'"', 1)[0] for line in after.splitlines()
             if line.startswith(b"inference_objective_request_total{")}
    assert names == {b"a" * 127 + "…".encode(), b"b" * 127 + "…".encode(), b"c" * 127 + "…".encode()}


async def test_model_and_rewrite_pairs_are_capped_together():
    server = EppServer(options(), pipeline=simple_pipeline())
    server.metrics.max_model_labels = 5
    async with serving(server) as client:
        for i in range(6):
            for j in range(6):
                body = json.dumps({"model": f"m{i}", "prompt": "x"}).encode()
                await client.exchange([request_headers(extra=[("x-gateway-model-name-rewrite", f"t{j}")]),
                                       request_body(body)], expect=2)
        pairs = {(s.labels["model_name"], s.labels["target_model_name"])
                 for s in server.metrics.requests.collect()[0].samples if s.name.endswith("_total")}
        assert len(pairs) == 6 and ("__other__", "__other__") in pairs


# -- item 7: a garbage message is one log line, not a traceback ---------------------------------

async def test_garbage_protobuf_logs_one_line_without_traceback(picker, caplog):
    server, _ = picker
    caplog.set_level(logging.INFO)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.grpc_port}")
    try:
        for garbage in (b"\xff\xff\xff\xff garbage", b"\x0a\xff\xff\xff\xff\x0f"):
            call = channel.stream_stream("/envoy.service.ext_proc.v3.ExternalProcessor/Process")()
            await call.write(garbage)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await asyncio.wait_for(call.read(), 5)
            assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    finally:
        await channel.close()
    noisy = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(noisy) == 1 and noisy[0].exc_info is None
    assert "not a ProcessingRequest" in noisy[0].getMessage()
    assert server.metrics.stream_errors.labels("bad_message")._value.get() == 2


async def test_any_failure_in_a_response_phase_passes_the_bytes_through(picker, monkeypatch):
    server, client = picker
    from epp.scorers.parsers.openai import OpenAIParser

    def unreadable(self, request, body, *, streamed):
        raise LookupError("a bug in reading usage")

    monkeypatch.setattr(OpenAIParser, "usage", unreadable)
    chunks = [b'{"usage":{"prompt_tokens":', b"3}", b',"x":1}']
    replies = await client.exchange(
        [request_headers(), request_body(b'{"model":"m","prompt":"hello"}'),
         response_headers([(":status", "200"), ("content-type", "application/json")]),
         *[response_body(c, end_of_stream=i == len(chunks) - 1) for i, c in enumerate(chunks)]], expect=4)
    assert not any(r.HasField("immediate_response") for r in replies)
    assert streamed_bodies(replies) == b"".join(chunks)
    assert server.metrics.stream_errors.labels("response_internal")._value.get() == 1
