"""Each limit of epp/limits.py reached gives its defined answer (docs/operations.md#limits)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

import pytest

from epp.limits import Limits
from epp.server.runner import EppServer
from tests.support.extproc import (
    ExtProcClient,
    drop_reason_of,
    error_of,
    no_reply_within,
    options,
    request_body,
    request_headers,
    serving,
    simple_pipeline,
)

BODY = b'{"model":"m","prompt":"hello"}'


@contextlib.asynccontextmanager
async def with_limits(**limits) -> AsyncIterator[tuple[EppServer, ExtProcClient]]:
    """A started picker with these limits and a gRPC client of it."""
    server = EppServer(options(limits=Limits(**limits)), pipeline=simple_pipeline())
    async with serving(server) as client:
        yield server, client


def immediate(reply) -> tuple[int, str]:
    status, message = error_of(reply)
    return status, message.decode()


async def test_a_stream_over_the_concurrency_limit_gets_429_and_the_slot_comes_back():
    async with with_limits(max_concurrent_streams=2) as (server, client):
        held = [await client.open() for _ in range(2)]
        for call in held:
            await call.write(request_headers())
        await asyncio.sleep(0.2)
        replies = await client.exchange([request_headers(), request_body(BODY)], expect=1)
        assert immediate(replies[0]) == (429, "inference error: ResourceExhausted - too many concurrent requests "
                                              "(limit 2)")
        assert drop_reason_of(replies[0]) == "rejected-saturated"
        for call in held:
            await call.write(request_body(BODY))
            assert (await asyncio.wait_for(call.read(), 5)).HasField("request_headers")
            await call.read()
            await call.done_writing()
            await call.code()
        replies = await client.exchange([request_headers(), request_body(BODY)], expect=2)
        assert replies[0].HasField("request_headers")
        assert server.metrics.stream_errors.labels("over_capacity")._value.get() == 1


async def test_an_unanswered_request_idle_past_the_timeout_gets_408():
    async with with_limits(stream_idle_timeout_s=0.5) as (server, client):
        call = await client.open()
        await call.write(request_headers())
        await call.write(request_body(BODY[:10], end_of_stream=False))
        pending = await no_reply_within(call, 0.3)
        reply = await asyncio.wait_for(pending, 5)
        assert immediate(reply) == (408, "inference error: RequestTimeout - no request data for 0.5 s")
        assert server.metrics.streams_active._value.get() == 0
        assert server.metrics.stream_errors.labels("idle")._value.get() == 1


async def test_the_idle_timeout_does_not_cut_an_answered_request():
    async with with_limits(stream_idle_timeout_s=0.3) as (server, client):
        call = await client.open()
        await call.write(request_headers())
        await call.write(request_body(BODY))
        assert (await asyncio.wait_for(call.read(), 5)).HasField("request_headers")
        await call.read()
        await asyncio.sleep(0.8)  # a model server thinking: the stream stays open
        assert server.metrics.streams_active._value.get() == 1
        await call.done_writing()
        await call.code()


@pytest.mark.parametrize("extra,message", [
    ([(f"x-h{i}", "v") for i in range(20)], "more than 10 request headers"),
    ([("x-big", "v" * 2000)], "request headers exceed 1024 bytes"),
], ids=["count", "size"])
async def test_too_many_or_too_large_request_headers_get_431(extra, message):
    async with with_limits(max_request_headers=10, max_request_header_bytes=1024) as (server, client):
        replies = await client.exchange([request_headers(extra=extra), request_body(BODY)], expect=1)
        assert immediate(replies[0]) == (431, f"inference error: RequestHeaderFieldsTooLarge - {message}")
        ok = await client.exchange([request_headers(extra=[("x-h", "v")]), request_body(BODY)], expect=2)
        assert ok[0].HasField("request_headers")


async def test_json_depth_limit_is_configurable():
    async with with_limits(max_json_depth=4) as (server, client):
        ok = json.dumps({"model": "m", "prompt": [[1, 2]], "x": {"y": [1]}}).encode()
        assert (await client.exchange([request_headers(), request_body(ok)], expect=2))[0].HasField("request_headers")
        deep = json.dumps({"model": "m", "prompt": "x", "x": {"y": [[[1]]]}}).encode()
        replies = await client.exchange([request_headers(), request_body(deep)], expect=1)
        assert immediate(replies[0]) == (400, "inference error: BadRequest - request body nests objects/arrays "
                                              "deeper than 4 levels")


async def test_a_prompt_past_the_character_limit_gets_413_naming_the_limit():
    async with with_limits(max_prompt_chars=1000) as (server, client):
        chat = {"model": "m", "messages": [{"role": "user", "content": "x" * 996}]}  # 4 ("user") + 996
        replies = await client.exchange([request_headers("/v1/chat/completions"),
                                         request_body(json.dumps(chat).encode())], expect=2)
        assert replies[0].HasField("request_headers")
        chat["messages"].append({"role": "user", "content": "one more"})
        replies = await client.exchange([request_headers("/v1/chat/completions"),
                                         request_body(json.dumps(chat).encode())], expect=1)
        assert immediate(replies[0]) == (413, "inference error: PayloadTooLarge - prompt exceeds the limit of "
                                              "1000 characters (epp serve --max-prompt-chars)")


async def test_label_value_length_limit_cuts_model_labels():
    async with with_limits(max_label_value_length=16) as (server, client):
        body = json.dumps({"model": "a-rather-long-model-name-indeed", "prompt": "x"}).encode()
        await client.exchange([request_headers(), request_body(body)], expect=2)
        names = {s.labels["model_name"] for s in server.metrics.requests.collect()[0].samples}
        assert names == {"a-rather-long-m…"}


def test_limits_reject_nonsense_values():
    with pytest.raises(ValueError, match="max_json_depth"):
        Limits(max_json_depth=0)
    with pytest.raises(ValueError, match="max_json_depth must be <= 512"):
        Limits(max_json_depth=513)  # the parser would recurse too close to the interpreter's limit
    with pytest.raises(ValueError, match="stream_idle_timeout_s"):
        Limits(stream_idle_timeout_s=0)
    with pytest.raises(ValueError, match="max_prompt_chars"):
        Limits(max_prompt_chars=0)


@pytest.mark.parametrize("flag,value,name", [("--max-json-depth", "0", "max_json_depth"),
                                             ("--stream-idle-timeout", "-1", "stream_idle_timeout_s"),
                                             ("--max-concurrent-streams", "0", "max_concurrent_streams"),
                                             ("--max-prompt-chars", "0", "max_prompt_chars")])
def test_serve_refuses_nonsense_limits_with_exit_2(capsys, flag, value, name):
    from epp.cli import main

    assert main(["serve", flag, value]) == 2
    assert name in capsys.readouterr().err
