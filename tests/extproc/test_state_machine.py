"""The ext_proc stream state machine, driven over real gRPC with exact ProcessingRequest sequences."""

from __future__ import annotations

import asyncio
import json
import urllib.request

import grpc
import pytest
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from grpc_health.v1 import health_pb2, health_pb2_grpc

from epp.framework.plugin import ResponseCompleteHook, ResponseHeadersHook
from tests.support.extproc import (
    ExtProcClient,
    drop_reason_of,
    error_of,
    headers_of,
    no_reply_within,
    request_body,
    request_headers,
    response_body,
    response_headers,
    simple_pipeline,
    started,
    subset_metadata,
)

BODY = b'{"max_tokens":100,"model":"my-model","prompt":"test1","temperature":0}'


@pytest.fixture
async def picker():
    server = await started()
    client = ExtProcClient(server.grpc_port)
    yield server, client
    await client.close()
    await server.stop(0)


def assert_routed(resp, destination: str, body: bytes) -> None:
    common = resp.request_headers.response
    assert common.clear_route_cache is True
    assert headers_of(common.header_mutation) == {
        "x-gateway-destination-endpoint": destination,
        "x-request-id": "test-request-id",
        "Content-Length": str(len(body)),
    }
    lb = resp.dynamic_metadata.fields["envoy.lb"].struct_value.fields
    assert lb["x-gateway-destination-endpoint"].string_value == destination


async def test_one_chunk_body_gets_headers_then_body(picker):
    _, client = picker
    replies = await client.exchange([request_headers(), request_body(BODY)], expect=2)
    assert_routed(replies[0], "10.0.0.1:8000", BODY)
    streamed = replies[1].request_body.response.body_mutation.streamed_response
    assert (streamed.body, streamed.end_of_stream) == (BODY, True)


async def test_split_body_is_held_until_end_of_stream(picker):
    _, client = picker
    call = await client.open()
    await call.write(request_headers())
    await call.write(request_body(BODY[:20], end_of_stream=False))
    await no_reply_within(call, 0.3)  # nothing is answered before the body ends
    call.cancel()
    replies = await client.exchange(
        [request_headers(), request_body(BODY[:20], False), request_body(BODY[20:50], False),
         request_body(BODY[50:], True)], expect=2)
    assert_routed(replies[0], "10.0.0.1:8000", BODY)
    assert replies[1].request_body.response.body_mutation.streamed_response.body == BODY


async def test_header_only_request_is_answered_at_once(picker):
    _, client = picker
    [reply] = await client.exchange([request_headers(end_of_stream=True)], expect=1)
    headers = headers_of(reply.request_headers.response.header_mutation)
    assert headers["x-gateway-destination-endpoint"] in {"10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"}
    assert headers["x-request-id"] == "test-request-id"


async def test_large_body_is_reemitted_in_62000_byte_pieces(picker):
    _, client = picker
    prompt = "x" * 200_000
    body = json.dumps({"model": "m", "prompt": prompt}).encode()
    pieces = [body[i:i + 16384] for i in range(0, len(body), 16384)]
    reqs = [request_headers()] + [request_body(p, i == len(pieces) - 1) for i, p in enumerate(pieces)]
    replies = await client.exchange(reqs, expect=5)
    assert_routed(replies[0], "10.0.0.1:8000", body)
    chunks = [r.request_body.response.body_mutation.streamed_response for r in replies[1:]]
    assert [len(c.body) for c in chunks] == [62000, 62000, 62000, len(body) - 186000]
    assert [c.end_of_stream for c in chunks] == [False, False, False, True]
    assert b"".join(c.body for c in chunks) == body


async def test_request_id_is_generated_when_absent(picker):
    _, client = picker
    req = request_headers()
    del req.request_headers.headers.headers[5]  # the x-request-id header
    replies = await client.exchange([req, request_body(BODY)], expect=2)
    generated = headers_of(replies[0].request_headers.response.header_mutation)["x-request-id"]
    assert len(generated) == 36 and generated.count("-") == 4


@pytest.mark.parametrize("body,path,message", [
    (b"no healthy upstream", "/v1/completions", "error unmarshaling request bodyMap: "),
    (b'{"prompt":"hello world"}', "/v1/completions", "model not found in request body"),
    (b'{"model":7,"prompt":"hi"}', "/v1/completions", "model not found in request body"),
    (b'{"model":"m","prompt":""}', "/v1/completions", "invalid completions request: must have valid prompt field"),
    (b'{"model":"m","messages":[]}', "/v1/chat/completions",
     "invalid chat completions request: must have valid messages field"),
    (b'{"model":"m"}', "/v1/responses", "invalid responses request: must have input field"),
    (b'{"model":"m"}', "/v1/embeddings", "invalid embeddings request: must have input field"),
    (b'[1,2]', "/v1/completions", "error unmarshaling request bodyMap: request body must be a JSON object"),
])
async def test_bad_bodies_get_400(picker, body, path, message):
    _, client = picker
    [reply] = await client.exchange([request_headers(path), request_body(body)], expect=1)
    status, text = error_of(reply)
    assert status == 400
    assert text.decode().startswith("inference error: BadRequest - " + message)
    assert drop_reason_of(reply) is None  # not a drop: the request itself is wrong


async def test_body_over_the_cap_gets_413_without_buffering_the_rest():
    server = await started(max_body_bytes=1000)
    client = ExtProcClient(server.grpc_port)
    try:
        call = await client.open()
        await call.write(request_headers())
        await call.write(request_body(b"x" * 600, False))
        await call.write(request_body(b"x" * 600, False))
        reply = await asyncio.wait_for(call.read(), 5)
        assert error_of(reply) == (
            413, b"inference error: PayloadTooLarge - request body exceeds the limit of 1000 bytes")
        await call.write(request_body(b"x" * 600, True))  # the rest is dropped, not answered
        await no_reply_within(call, 0.3)
        call.cancel()
    finally:
        await client.close()
        await server.stop(0)


async def test_subset_hint_list_string_and_empty(picker):
    _, client = picker
    hint = subset_metadata(["10.0.0.3:8000"])
    replies = await client.exchange([request_headers(metadata=hint), request_body(BODY, metadata=hint)], expect=2)
    assert_routed(replies[0], "10.0.0.3:8000", BODY)
    hint = subset_metadata("10.0.0.9:8000, 10.0.0.2")
    replies = await client.exchange([request_headers(metadata=hint), request_body(BODY)], expect=2)
    assert_routed(replies[0], "10.0.0.2:8000", BODY)
    for value in ([], ["192.168.1.99:8000"]):
        hint = subset_metadata(value)
        [reply] = await client.exchange([request_headers(metadata=hint), request_body(BODY)], expect=1)
        assert error_of(reply) == (
            503, b"inference error: ServiceUnavailable - failed to find endpoint candidates for serving the request")
        assert drop_reason_of(reply) == "rejected-no-endpoints"


async def test_no_endpoints_header_only_is_500():
    server = await started(endpoints="")
    client = ExtProcClient(server.grpc_port)
    try:
        [reply] = await client.exchange([request_headers(end_of_stream=True)], expect=1)
        assert error_of(reply) == (500, b"inference error: Internal - no pods available in datastore")
    finally:
        await client.close()
        await server.stop(0)


async def test_fallback_endpoints_are_comma_joined():
    server = await started(simple_pipeline(count=2))
    client = ExtProcClient(server.grpc_port)
    try:
        replies = await client.exchange([request_headers(), request_body(BODY)], expect=2)
        assert_routed(replies[0], "10.0.0.1:8000,10.0.0.2:8000", BODY)
    finally:
        await client.close()
        await server.stop(0)


async def test_model_rewrite_and_rewrite_back_in_json_response(picker):
    _, client = picker
    body = b'{"model":"sql-lora","prompt":"test2","max_tokens":100,"temperature":0}'
    upstream = b'{"max_tokens":100,"model":"sql-lora-1fdg2","prompt":"test2","temperature":0}'
    resp_json = b'{"id":"x","model":"sql-lora-1fdg2","usage":{"prompt_tokens":7,"completion_tokens":3}}'
    call = await client.open()
    await call.write(request_headers(extra=[("x-gateway-model-name-rewrite", "sql-lora-1fdg2")]))
    await call.write(request_body(body))
    routed, forwarded = await call.read(), await call.read()
    assert_routed(routed, "10.0.0.1:8000", upstream)
    assert forwarded.request_body.response.body_mutation.streamed_response.body == upstream
    await call.write(response_headers([(":status", "200"), ("content-type", "application/json"),
                                       ("content-length", str(len(resp_json)))]))
    hdr = await call.read()
    assert list(hdr.response_headers.response.header_mutation.remove_headers) == ["content-length"]
    await call.write(response_body(resp_json[:20]))
    pending = await no_reply_within(call, 0.3)  # JSON is buffered
    await call.write(response_body(resp_json[20:], end_of_stream=True))
    out = (await pending).response_body.response.body_mutation.streamed_response
    assert out.end_of_stream and out.body == resp_json.replace(b"sql-lora-1fdg2", b"sql-lora")
    await call.done_writing()


async def test_sse_response_streams_chunk_by_chunk(picker):
    server, client = picker
    call = await client.open()
    await call.write(request_headers())
    await call.write(request_body(BODY))
    await call.read(), await call.read()
    await call.write(response_headers([(":status", "200"), ("content-type", "text/event-stream")]))
    assert (await call.read()).HasField("response_headers")
    events = [b'data: {"choices":[{"text":"a"}]}\n\n', b'data: {"choices":[{"text":"b"}]}\n\n',
              b'data: {"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":2}}\n\ndata: [DONE]\n\n']
    for i, event in enumerate(events):
        await call.write(response_body(event, end_of_stream=i == len(events) - 1))
        echoed = (await asyncio.wait_for(call.read(), 5)).response_body.response.body_mutation.streamed_response
        assert echoed.body == event and echoed.end_of_stream == (i == len(events) - 1)
    await call.done_writing()
    text = await asyncio.to_thread(
        lambda: urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics").read().decode())
    assert 'inference_objective_input_tokens_sum{model_name="my-model",target_model_name="my-model"} 7.0' in text


async def test_response_trailers_are_answered(picker):
    _, client = picker
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
    replies = await client.exchange(
        [request_headers(), request_body(BODY), response_headers([(":status", "200")]),
         pb.ProcessingRequest(response_trailers=pb.HttpTrailers())], expect=4)
    assert replies[3].HasField("response_trailers")


def headers_only(req):
    """`req` as Envoy's first message when it sends the picker no response body (`--responses headers`)."""
    req.protocol_config.request_body_mode = ProcessingMode.FULL_DUPLEX_STREAMED
    req.protocol_config.response_body_mode = ProcessingMode.NONE
    return req


async def test_without_response_bodies_headers_end_the_prefill_and_the_close_ends_the_request(picker):
    server, client = picker
    ledger = server.director.ledger
    target = server.endpoints.snapshot()[0]
    running = server.metrics.running_requests.labels("sql-lora")
    call = await client.open()
    await call.write(headers_only(request_headers(extra=[("x-gateway-model-name-rewrite", "sql-lora-1fdg2")])))
    await call.write(request_body(b'{"model":"sql-lora","prompt":"test2","stream":true}'))
    await call.read(), await call.read()
    assert ledger.load(target).prefilling_requests == 1
    await call.write(response_headers([(":status", "200"), ("content-type", "text/event-stream"),
                                       ("content-length", "1234")]))
    reply = (await call.read()).response_headers.response
    # No body will be rewritten, so its length stays as the model server sent it.
    assert list(reply.header_mutation.remove_headers) == []
    # No first token will be shown: the prefill counts as over, the request still runs.
    load = ledger.load(target)
    assert (load.prefilling_requests, load.inflight_requests) == (0, 1)
    assert running._value.get() == 1
    await call.done_writing()  # Envoy closes the stream when the response has ended
    assert await call.read() is grpc.aio.EOF
    for _ in range(50):
        if running._value.get() == 0:
            break
        await asyncio.sleep(0.02)
    assert running._value.get() == 0
    assert ledger.load(target).inflight_requests == 0
    # A finished request, not an aborted one: its duration is observed.
    assert server.metrics.registry.get_sample_value(
        "inference_objective_request_duration_seconds_count",
        {"model_name": "sql-lora", "target_model_name": "sql-lora-1fdg2"}) == 1


class RecordingHooks(ResponseHeadersHook, ResponseCompleteHook):
    type_name = "recording-hooks"

    def __init__(self):
        super().__init__()
        self.completed: list[tuple[str, bool]] = []

    def on_response_headers(self, state, request, response, target):
        response.set_headers["x-served"] = response.served_endpoint or "missing"

    def on_response_complete(self, state, request, response, target):
        self.completed.append((target.hostport, response.end_of_stream))


async def test_hooks_see_served_endpoint_and_completion_even_on_abort():
    hooks = RecordingHooks()
    server = await started(simple_pipeline(hooks=[hooks]))
    client = ExtProcClient(server.grpc_port)
    try:
        replies = await client.exchange(
            [request_headers(), request_body(BODY),
             response_headers([(":status", "200")], served="10.0.0.1:8000"),
             response_body(b"{}", end_of_stream=True)], expect=4)
        assert headers_of(replies[2].response_headers.response.header_mutation) == {"x-served": "10.0.0.1:8000"}
        assert hooks.completed == [("10.0.0.1:8000", True)]
        call = await client.open()  # a client that goes away after the pick still releases its state
        await call.write(request_headers())
        await call.write(request_body(BODY))
        await call.read(), await call.read()
        call.cancel()
        for _ in range(50):
            if len(hooks.completed) == 2:
                break
            await asyncio.sleep(0.05)
        assert hooks.completed[1] == ("10.0.0.1:8000", True)
    finally:
        await client.close()
        await server.stop(0)


async def test_a_failing_plugin_ends_only_its_stream():
    pipeline = simple_pipeline()
    profile = pipeline.scheduler.profiles["default"]
    original = profile.picker.pick
    calls = {"n": 0}

    def flaky(state, request, scored):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("boom")
        return original(state, request, scored)

    profile.picker.pick = flaky
    server = await started(pipeline)
    client = ExtProcClient(server.grpc_port)
    try:
        [reply] = await client.exchange([request_headers(), request_body(BODY)], expect=1)
        assert error_of(reply) == (500, b"inference error: Internal - internal error while processing request")
        replies = await client.exchange([request_headers(), request_body(BODY)], expect=2)
        assert_routed(replies[0], "10.0.0.1:8000", BODY)
    finally:
        await client.close()
        await server.stop(0)


async def test_health_services():
    server = await started(endpoints="")
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.health_port}")
    stub = health_pb2_grpc.HealthStub(channel)
    try:
        async def status(name):
            return (await stub.Check(health_pb2.HealthCheckRequest(service=name))).status
        serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
        assert await status("liveness") == serving
        for name in ("readiness", "", "envoy.service.ext_proc.v3.ExternalProcessor"):
            assert await status(name) == not_serving  # no endpoints known yet
        from epp.datalayer.registry import parse_endpoint_list
        server.endpoints.set_endpoints(parse_endpoint_list("10.0.0.1:8000"))
        for name in ("readiness", "", "envoy.service.ext_proc.v3.ExternalProcessor"):
            assert await status(name) == serving
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await status("nope")
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        await channel.close()
        await server.stop(0)


async def test_shutdown_lets_in_flight_streams_finish():
    server = await started()
    client = ExtProcClient(server.grpc_port)
    try:
        call = await client.open()
        await call.write(request_headers())
        await asyncio.sleep(0.1)
        stopping = asyncio.create_task(server.stop(grace=5))
        await asyncio.sleep(0.2)
        assert not server.is_ready()
        await call.write(request_body(BODY))
        routed = await asyncio.wait_for(call.read(), 5)
        assert_routed(routed, "10.0.0.1:8000", BODY)
        await call.read()
        await call.done_writing()
        await asyncio.wait_for(stopping, 10)
    finally:
        await client.close()


async def test_model_label_values_are_capped():
    server = await started()
    server.metrics.max_model_labels = 3
    client = ExtProcClient(server.grpc_port)
    try:
        for i in range(6):
            body = json.dumps({"model": f"random-{i}", "prompt": "x"}).encode()
            await client.exchange([request_headers(), request_body(body)], expect=2)
        labels = {s.labels["model_name"] for s in server.metrics.requests.collect()[0].samples}
        assert labels == {"random-0", "random-1", "random-2", "__other__"}
    finally:
        await client.close()
        await server.stop(0)
