"""`epp envoy-config --responses first-token` through a real Envoy: answers arrive whole, the picker reads
each streamed one up to its first token only, and what it still needs (first token, JSON usage, the
model name rewritten back, the request's release) works."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
import pytest_asyncio

from epp.datalayer.registry import parse_endpoint_list
from epp.envoy import EnvoyProcess, render_config
from epp.framework.plugin import FirstTokenHook
from epp.server.runner import EppServer, ServeOptions
from tests.support.backends import EchoBackend
from tests.support.extproc import pipeline_of
from tests.support.ports import free_port

pytestmark = [pytest.mark.envoy, pytest.mark.asyncio(loop_scope="module")]


class FirstTokens(FirstTokenHook):
    type_name = "first-tokens"

    def __init__(self) -> None:
        super().__init__()
        self.seen = 0

    def on_first_token(self, state, request, target) -> None:
        self.seen += 1


class Stack:
    def __init__(self, backend, epp, envoy, port, hook):
        self.backend, self.epp, self.envoy, self.port, self.hook = backend, epp, envoy, port, hook

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1/completions"

    def phase(self, name: str) -> float:
        return self.epp.metrics.registry.get_sample_value("epp_extproc_messages_total", {"phase": name}) or 0.0

    def sample(self, name: str, **labels: str) -> float:
        return self.epp.metrics.registry.get_sample_value(name, labels) or 0.0


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def stack():
    backend = EchoBackend("b0")
    await backend.start()
    hook = FirstTokens()
    epp = EppServer(ServeOptions(
        grpc_port=0, grpc_health_port=0, metrics_port=0, bind_address="127.0.0.1",
        endpoints=parse_endpoint_list(backend.hostport), scrape_metrics=False, grace_period_s=1),
        pipeline=pipeline_of([hook]))
    await epp.start()
    listen, admin = free_port(), free_port()
    envoy = EnvoyProcess(render_config(listen_port=listen, admin_port=admin, epp_port=epp.grpc_port,
                                       responses="first-token"), admin)
    await envoy.start()
    yield Stack(backend, epp, envoy, listen, hook)
    await envoy.stop()
    await epp.stop(0)
    await backend.stop()


async def until(check, seconds: float = 3.0) -> None:
    for _ in range(int(seconds / 0.02)):
        if check():
            return
        await asyncio.sleep(0.02)
    assert check()


def events_of(body: bytes) -> list[dict]:
    return [json.loads(line[6:]) for line in body.split(b"\n") if line.startswith(b"data: {")]


async def test_a_long_streamed_answer_arrives_whole_while_the_picker_reads_its_first_token_only(stack):
    bodies_before, firsts = stack.phase("response_body"), stack.hook.seen
    errors_before = stack.sample("epp_extproc_stream_errors_total", reason="cancelled")
    async with aiohttp.ClientSession() as session:
        # 2,000 events back to back: Envoy holds the ones it sent the picker until answered, so the
        # picker's close loses none of them (under FULL_DUPLEX_STREAMED those in flight would be lost).
        async with session.post(stack.url, json={"model": "m", "prompt": "long", "stream": True, "events": 2000,
                                                 "delay": 0}) as r:
            assert r.status == 200
            body = await r.read()
    events = events_of(body)
    assert [e["choices"][0]["text"] for e in events[:-1]] == [f"t{i}" for i in range(2000)]
    assert events[-1]["usage"] == {"prompt_tokens": 5, "completion_tokens": 3}
    assert body.endswith(b"data: [DONE]\n\n")
    assert stack.hook.seen == firsts + 1  # the first token was timed
    assert stack.phase("response_body") - bodies_before <= 3  # not 2,001 chunks: the picker let go
    await until(lambda: stack.sample("inference_objective_running_requests", model_name="m") == 0)
    assert stack.sample("epp_extproc_stream_errors_total", reason="cancelled") == errors_before


async def test_the_request_is_released_at_its_first_token_while_the_answer_goes_on(stack):
    ledger = stack.epp.director.ledger
    [target] = stack.epp.endpoints.snapshot()
    async with aiohttp.ClientSession() as session:
        async with session.post(stack.url, json={"model": "m", "prompt": "slow", "stream": True, "events": 5,
                                                 "delay": 0.3}) as r:
            assert r.status == 200
            first = await r.content.readline()
            assert json.loads(first.removeprefix(b"data: "))["choices"][0]["text"] == "t0"
            # 1.2 s of answer to go, and the picker has let the request go (the replica's own
            # metrics show it from here on).
            await until(lambda: ledger.load(target).inflight_requests == 0, 1.0)
            assert stack.sample("inference_objective_running_requests", model_name="m") == 0
            rest = await r.read()
    assert [e["choices"][0]["text"] for e in events_of(first + rest)[:-1]] == ["t0", "t1", "t2", "t3", "t4"]


async def test_a_json_answer_is_read_whole_for_its_usage(stack):
    before = stack.sample("inference_objective_input_tokens_sum", model_name="m", target_model_name="m")
    async with aiohttp.ClientSession() as session:
        async with session.post(stack.url, json={"model": "m", "prompt": "whole"}) as r:
            assert r.status == 200
            answer = await r.json()
    assert answer["model"] == "m" and answer["usage"]["prompt_tokens"] == 5
    await until(lambda: stack.sample("inference_objective_input_tokens_sum", model_name="m",
                                     target_model_name="m") == before + 5)


@pytest.mark.parametrize("stream", [False, True])
async def test_a_model_name_rewritten_on_the_way_in_is_rewritten_back_in_every_chunk(stack, stream):
    async with aiohttp.ClientSession() as session:
        async with session.post(stack.url, json={"model": "sql-lora", "prompt": "r", "stream": stream,
                                                 "events": 40, "delay": 0},
                                headers={"x-gateway-model-name-rewrite": "sql-lora-1fdg2"}) as r:
            assert r.status == 200
            body = await r.read()
    assert stack.backend.received[-1]["size"] > 0
    assert b"sql-lora-1fdg2" not in body
    if stream:
        events = events_of(body)
        assert [e["model"] for e in events[:-1]] == ["sql-lora"] * 40
    else:
        assert json.loads(body)["model"] == "sql-lora"
