"""Prompts never reach the log at the default level (issue #18 item 8).

The original input: a lone surrogate in chat content made `approx-prefix-cache-producer` fail,
and the WARNING quoted the exception, whose message holds the whole chat. Here every failure
path a request can take is driven with a prompt carrying a marker, and the log (messages and
tracebacks, at WARNING, the level `epp serve` runs at) must not contain it.
"""

from __future__ import annotations

import asyncio
import json
import logging

import pytest

from epp.config import LoadedConfig
from epp.framework.plugin import DataProducer, PreRequestHook, ResponseCompleteHook, ResponseHeadersHook
from epp.server.runner import EppServer
from tests.support.configs import PREFIX_CONFIG
from tests.support.extproc import (
    options,
    pipeline_of,
    request_body,
    request_headers,
    response_body,
    response_headers,
    serving,
)

SECRET = "TOP-SECRET-PROMPT-7f3a"


def _prompt_of(request) -> str:
    return json.dumps(request.body)


class LeakyPlugin(DataProducer, PreRequestHook, ResponseHeadersHook, ResponseCompleteHook):
    """A plugin whose every failure quotes the prompt in its exception message."""

    type_name = "leaky"

    def produces(self):
        return frozenset()

    async def prepare(self, state, request, candidates):
        raise ValueError(f"cannot hash {_prompt_of(request)}")

    def pre_request(self, state, request, result):
        raise KeyError(_prompt_of(request))

    def on_response_headers(self, state, request, response, target):
        raise RuntimeError(f"no headers for {_prompt_of(request)}")

    def on_response_complete(self, state, request, response, target):
        raise UnicodeEncodeError("utf-8", _prompt_of(request), 0, 1, "surrogates not allowed")


def leaky_pipeline() -> LoadedConfig:
    return pipeline_of([LeakyPlugin("leaky")])


async def run_request(client, path: str, body: dict | bytes, response: bytes | None = None) -> None:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    call = await client.open()
    await call.write(request_headers(path))
    await call.write(request_body(data))
    first = await asyncio.wait_for(call.read(), 10)
    if response is not None and first.HasField("request_headers"):
        await call.read()
        await call.write(response_headers([(":status", "200"), ("content-type", "application/json")]))
        await call.read()
        await call.write(response_body(response, end_of_stream=True))
        await asyncio.wait_for(call.read(), 10)
    await call.done_writing()
    await call.code()


@pytest.mark.parametrize("level", [logging.WARNING, logging.DEBUG])
async def test_failing_plugins_never_log_the_prompt_at_the_default_level(caplog, level):
    caplog.set_level(level)
    async with serving(EppServer(options(), pipeline=leaky_pipeline())) as client:
        chat = {"model": "m", "messages": [{"role": "user", "content": SECRET}]}
        await run_request(client, "/v1/chat/completions", chat, response=b'{"usage":{"prompt_tokens":3}}')
    failures = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    for plugin_call in ("data producer leaky failed", "pre-request hook leaky failed",
                        "response-headers hook leaky failed", "response-complete hook leaky failed"):
        assert any(line.startswith(plugin_call) for line in failures), failures
    if level == logging.WARNING:
        assert SECRET not in caplog.text
    else:  # the detail is there for whoever asks for it
        assert SECRET in caplog.text


async def test_the_original_surrogate_chat_input_logs_no_prompt(caplog):
    caplog.set_level(logging.WARNING)
    async with serving(EppServer(options(config_text=PREFIX_CONFIG))) as client:
        hostile = ('{"model":"m","messages":[{"role":"user","content":"' + SECRET + r' \ud800"}]}').encode()
        await run_request(client, "/v1/chat/completions", hostile)
        deep = ('{"note":"' + SECRET + '","usage":' + "[" * 5000 + "]" * 5000 + "}").encode()
        await run_request(client, "/v1/completions", {"model": "m", "prompt": SECRET}, response=deep)
        await run_request(client, "/v1/completions", b'{"model":"m","prompt":"' + SECRET.encode() + b'" garbage')
    assert SECRET not in caplog.text
