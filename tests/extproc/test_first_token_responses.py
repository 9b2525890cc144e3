"""`--responses first-token`: Envoy holds each response chunk (STREAMED) and the picker stops reading when it can.

Driven over real gRPC with the exact message sequences Envoy sends in that mode (the same
sequences through a real Envoy: tests/integration/test_first_token_envoy.py).
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from epp.framework.plugin import FirstTokenHook
from epp.server.extproc import STREAMED_HOLD_LIMIT
from tests.support.extproc import (
    ExtProcClient,
    no_reply_within,
    request_body,
    request_headers,
    response_body,
    response_headers,
    simple_pipeline,
    started,
)
from tests.support.wait import wait_until

BODY = b'{"max_tokens":100,"model":"my-model","prompt":"test1","stream":true}'
REWRITE = [("x-gateway-model-name-rewrite", "sql-lora-1fdg2")]
REWRITTEN_BODY = b'{"model":"sql-lora","prompt":"test2","max_tokens":100}'
SSE = "text/event-stream"


def held(req: pb.ProcessingRequest) -> pb.ProcessingRequest:
    """`req` as Envoy's first message under `epp envoy-config --responses first-token`."""
    req.protocol_config.request_body_mode = ProcessingMode.FULL_DUPLEX_STREAMED
    req.protocol_config.response_body_mode = ProcessingMode.STREAMED
    return req


class FirstTokens(FirstTokenHook):
    type_name = "first-tokens"

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def on_first_token(self, state, request, target) -> None:
        self.seen.append(target.hostport)


@pytest.fixture
async def picker():
    hook = FirstTokens()
    server = await started(simple_pipeline(hooks=[hook]))
    client = ExtProcClient(server.grpc_port)
    yield server, client, hook
    await client.close()
    await server.stop(0)


async def routed(client: ExtProcClient, extra=(), body: bytes = BODY):
    call = await client.open()
    await call.write(held(request_headers(extra=extra)))
    await call.write(request_body(body))
    await call.read(), await call.read()
    return call


def unchanged(reply: pb.ProcessingResponse) -> bool:
    return reply.HasField("response_body") and not reply.response_body.response.HasField("body_mutation")


def sent_on(reply: pb.ProcessingResponse, chunk: bytes) -> bytes:
    """What Envoy sends on for `chunk` after the picker's reply to it."""
    mutation = reply.response_body.response.body_mutation
    return b"" if mutation.clear_body else mutation.body if mutation.HasField("body") else chunk


def value(server, name: str, **labels) -> float | None:
    return server.metrics.registry.get_sample_value(name, labels)


async def test_a_streamed_answer_is_read_up_to_its_first_token_then_released(picker):
    server, client, hook = picker
    ledger = server.director.ledger
    target = server.endpoints.snapshot()[0]
    call = await routed(client)
    assert ledger.load(target).prefilling_requests == 1
    await call.write(response_headers([(":status", "200"), ("content-type", SSE)]))
    assert (await call.read()).HasField("response_headers")
    # vLLM's first chat chunk names the role with empty content: no token yet, the picker keeps reading.
    await call.write(response_body(b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}\n\n'))
    assert unchanged(await call.read())
    assert hook.seen == [] and ledger.load(target).inflight_requests == 1
    await call.write(response_body(b'data: {"choices":[{"text":"a"}]}\n\n'))
    assert unchanged(await call.read())  # Envoy sends the chunk on as it came
    # ... and the picker closes the stream cleanly: Envoy sends the rest of the answer on without it.
    assert await asyncio.wait_for(call.read(), 5) is grpc.aio.EOF
    assert await call.code() == grpc.StatusCode.OK
    assert hook.seen == ["10.0.0.1:8000"]
    # The request ends for the picker at its first token: in flight no more, its duration not observed.
    load = ledger.load(target)
    assert (load.prefilling_requests, load.inflight_requests) == (0, 0)
    labels = {"model_name": "my-model", "target_model_name": "my-model"}
    assert value(server, "inference_objective_running_requests", model_name="my-model") == 0
    assert value(server, "inference_objective_request_duration_seconds_count", **labels) == 0
    assert value(server, "epp_extproc_stream_errors_total", reason="cancelled") is None


async def test_a_json_answer_is_answered_chunk_by_chunk_and_read_whole(picker):
    server, client, _ = picker
    call = await routed(client, body=b'{"model":"my-model","prompt":"x"}')
    await call.write(response_headers([(":status", "200"), ("content-type", "application/json")]))
    reply = (await call.read()).response_headers.response
    assert list(reply.header_mutation.remove_headers) == []  # nothing is rewritten: the length stays
    answer = b'{"id":"x","model":"my-model","usage":{"prompt_tokens":7,"completion_tokens":3}}'
    await call.write(response_body(answer[:20]))
    assert unchanged(await call.read())  # answered at once: no rewrite needs the whole
    await call.write(response_body(answer[20:]))
    assert unchanged(await call.read())
    await call.write(response_body(b"", end_of_stream=True))
    assert unchanged(await call.read())
    await call.done_writing()
    assert await call.read() is grpc.aio.EOF
    labels = {"model_name": "my-model", "target_model_name": "my-model"}
    await wait_until(lambda: value(server, "inference_objective_input_tokens_sum", **labels), "the usage read")
    assert value(server, "inference_objective_input_tokens_sum", **labels) == 7  # the usage is read
    assert value(server, "inference_objective_request_duration_seconds_count", **labels) == 1


async def test_a_rewritten_json_answer_is_held_and_replaced_whole(picker):
    _, client, _ = picker
    call = await routed(client, REWRITE, REWRITTEN_BODY)
    await call.write(response_headers([(":status", "200"), ("content-type", "application/json"),
                                       ("content-length", "80")]))
    reply = (await call.read()).response_headers.response
    assert list(reply.header_mutation.remove_headers) == ["content-length"]
    answer = b'{"id":"x","model":"sql-lora-1fdg2","usage":{"prompt_tokens":7}}'
    await call.write(response_body(answer[:16]))  # the model name is cut in two across the chunks
    pending = await no_reply_within(call, 0.3)  # held until the answer ends
    await call.write(response_body(answer[16:], end_of_stream=True))
    first = await pending
    second = await asyncio.wait_for(call.read(), 5)
    assert first.response_body.response.body_mutation.clear_body
    assert second.response_body.response.body_mutation.body == answer.replace(b"sql-lora-1fdg2", b"sql-lora")
    await call.done_writing()


async def test_a_rewritten_json_answer_past_the_hold_limit_is_rewritten_chunk_by_chunk(picker):
    _, client, _ = picker
    call = await routed(client, REWRITE, REWRITTEN_BODY)
    await call.write(response_headers([(":status", "200"), ("content-type", "application/json")]))
    await call.read()
    head = b'{"id":"x","model":"sql-lora-1fdg2","text":"'
    filler = b"a" * STREAMED_HOLD_LIMIT
    await call.write(response_body(head))
    await call.write(response_body(filler))
    replies = [await asyncio.wait_for(call.read(), 5) for _ in range(2)]
    assert [sent_on(r, c) for r, c in zip(replies, (head, filler))] == [
        head.replace(b"sql-lora-1fdg2", b"sql-lora"), filler]
    await call.write(response_body(b'"}', end_of_stream=True))
    assert unchanged(await asyncio.wait_for(call.read(), 5))
    await call.done_writing()


async def test_a_rewritten_streamed_answer_is_followed_to_its_end(picker):
    server, client, hook = picker
    call = await routed(client, REWRITE, REWRITTEN_BODY[:-1] + b',"stream":true}')
    await call.write(response_headers([(":status", "200"), ("content-type", SSE)]))
    await call.read()
    events = [b'data: {"model":"sql-lora-1fdg2","choices":[{"text":"a"}]}\n\n',
              b'data: {"model":"sql-lora-1fdg2","choices":[{"text":"b"}]}\n\n',
              b'data: {"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":2}}\n\ndata: [DONE]\n\n']
    for i, event in enumerate(events):
        await call.write(response_body(event, end_of_stream=i == len(events) - 1))
        reply = await asyncio.wait_for(call.read(), 5)
        if b"sql-lora-1fdg2" in event:
            assert reply.response_body.response.body_mutation.body == event.replace(b"sql-lora-1fdg2", b"sql-lora")
        else:
            assert unchanged(reply)
    assert hook.seen == ["10.0.0.1:8000"]
    await call.done_writing()
    assert await call.read() is grpc.aio.EOF
    labels = {"model_name": "sql-lora", "target_model_name": "sql-lora-1fdg2"}
    await wait_until(lambda: value(server, "inference_objective_input_tokens_sum", **labels), "the usage read")
    assert value(server, "inference_objective_input_tokens_sum", **labels) == 7


async def test_an_error_answer_is_read_whole(picker):
    server, client, hook = picker
    call = await routed(client)
    await call.write(response_headers([(":status", "429"), ("content-type", "application/json")]))
    await call.read()
    await call.write(response_body(b'{"error":{"message":"busy"}}', end_of_stream=True))
    assert unchanged(await call.read())
    await call.done_writing()
    assert await call.read() is grpc.aio.EOF
    assert hook.seen == []  # no first token was timed
    assert server.director.ledger.load(server.endpoints.snapshot()[0]).inflight_requests == 0
