"""The official OpenAI and Anthropic SDKs against `epp sim fleet`, through real Envoy and the picker.

The fleet is the `epp sim fleet` command (two replicas, prompt-token details and the scale-out
routes on); the picker runs GIE's default config (approximate prefix routing). Every API the
simulator serves is called the way a client calls it, and what comes back is the simulator's
(its replica header, usage, cache fields) after the picker routed it.
"""

from __future__ import annotations

import asyncio
import json
import sys

import aiohttp
import anthropic
import openai
import pytest
import pytest_asyncio

from epp.datalayer.registry import parse_endpoint_list
from epp.envoy import EnvoyProcess, render_config
from epp.server.runner import EppServer, ServeOptions
from tests.support.ports import free_port

pytestmark = [pytest.mark.envoy, pytest.mark.timeout(180), pytest.mark.asyncio(loop_scope="module")]

SYSTEM = "You are the support assistant of a shop that sells garden tools and seeds. " * 6
SUBSET = "x-gateway-destination-endpoint-subset"


class Stack:
    def __init__(self, replicas: dict[str, str], epp: EppServer, envoy: EnvoyProcess, port: int) -> None:
        self.replicas, self.epp, self.envoy, self.port = replicas, epp, envoy, port  # replica name -> ip:port

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def openai(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0)

    def anthropic(self) -> anthropic.AsyncAnthropic:
        return anthropic.AsyncAnthropic(base_url=self.url, api_key="unused", max_retries=0)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def stack():
    fleet = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "epp.cli", "sim", "fleet", "--replicas", "2", "--no-kv-events",
        "--enable-prompt-tokens-details", "--enable-scale-out",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    epp = envoy = None
    try:
        endpoints = (await asyncio.wait_for(fleet.stdout.readline(), 60)).decode().strip()
        assert endpoints, await fleet.stderr.read()
        replicas = {}
        for _ in range(2):
            info = json.loads(await asyncio.wait_for(fleet.stderr.readline(), 10))
            replicas[info["name"]] = info["endpoint"]
        epp = EppServer(ServeOptions(grpc_port=0, grpc_health_port=0, metrics_port=0, bind_address="127.0.0.1",
                                     endpoints=parse_endpoint_list(endpoints), grace_period_s=1))
        await epp.start()
        listen, admin = free_port(), free_port()
        envoy = EnvoyProcess(render_config(listen_port=listen, admin_port=admin, epp_port=epp.grpc_port), admin)
        await envoy.start()
        yield Stack(replicas, epp, envoy, listen)
    finally:
        if envoy is not None:
            await envoy.stop()
        if epp is not None:
            await epp.stop(0)
        fleet.terminate()
        await asyncio.wait_for(fleet.wait(), 30)


async def test_openai_chat_twice_lands_where_the_prefix_is_and_reports_its_cached_tokens(stack):
    client = stack.openai()
    seen = []
    for question in ("Which seeds grow in shade?", "Which seeds grow in sand?"):
        raw = await client.chat.completions.with_raw_response.create(
            model="sim-model", max_tokens=8,
            messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}])
        completion = raw.parse()
        assert completion.choices[0].message.content and completion.usage.completion_tokens == 8
        seen.append((raw.headers["x-sim-replica"], completion.usage.prompt_tokens_details.cached_tokens))
    (first, cold), (second, warm) = seen
    assert second == first and cold == 0 and warm >= 64


async def test_openai_streams_completions_with_usage(stack):
    client = stack.openai()
    stream = await client.chat.completions.create(
        model="sim-model", max_tokens=5, stream=True, stream_options={"include_usage": True},
        messages=[{"role": "user", "content": "Name a tool."}])
    text, usage = "", None
    async for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        if chunk.usage is not None:
            usage = chunk.usage
    assert text.strip() and usage.completion_tokens == 5
    completion = await client.completions.create(model="sim-model", prompt="Seeds:", max_tokens=3)
    assert completion.choices[0].finish_reason == "length" and completion.usage.completion_tokens == 3


async def test_openai_responses_and_a_follow_up_on_the_replica_that_holds_it(stack):
    client = stack.openai()
    raw = await client.responses.with_raw_response.create(model="sim-model", instructions=SYSTEM,
                                                          input="Do you sell rakes?", max_output_tokens=6)
    first = raw.parse()
    holder = raw.headers["x-sim-replica"]
    assert first.status == "incomplete" and first.output_text.strip() and first.usage.output_tokens == 6
    # The picker learned which replica stored the response: the follow-up goes there, no header needed.
    raw_follow_up = await client.responses.with_raw_response.create(
        model="sim-model", input="And hoes?", previous_response_id=first.id, max_output_tokens=4)
    follow_up = raw_follow_up.parse()
    assert raw_follow_up.headers["x-sim-replica"] == holder
    assert follow_up.previous_response_id == first.id
    assert follow_up.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens // 16 * 16 > 0
    # A subset hint that leaves that replica out cannot be honoured: the picker says so.
    other = next(name for name in stack.replicas if name != holder)
    with pytest.raises(openai.InternalServerError, match=f"held only by replica {stack.replicas[holder]}"):
        await client.responses.create(model="sim-model", input="And hoes?", previous_response_id=first.id,
                                      extra_headers={SUBSET: stack.replicas[other]})
    # An id the picker never saw goes anywhere; a replica that does not hold it answers vLLM's 404.
    with pytest.raises(openai.NotFoundError, match="Response with id 'resp_never_stored' not found"):
        await client.responses.create(model="sim-model", input="And hoes?", previous_response_id="resp_never_stored")
    events = []
    async with client.responses.stream(model="sim-model", input="Stream it.", max_output_tokens=3) as stream:
        async for event in stream:
            events.append(event.type)
        final = await stream.get_final_response()
    assert events[0] == "response.created" and events.count("response.output_text.delta") == 3
    assert final.output_text and final.usage.output_tokens == 3


async def test_openai_embeddings_decoded_from_base64_by_the_sdk(stack):
    client = stack.openai()
    result = await client.embeddings.create(model="sim-model", input=["rake", "hoe", "rake"])
    vectors = [d.embedding for d in result.data]
    assert len(vectors) == 3 and len(vectors[0]) == 128 and vectors[0] == vectors[2] != vectors[1]
    assert result.usage.prompt_tokens > 0


async def test_anthropic_messages_stream_and_count_tokens(stack):
    client = stack.anthropic()
    system = "The watering desk. " + SYSTEM  # a prefix no earlier test left in a cache
    request = dict(model="sim-model", max_tokens=6, system=system,
                   messages=[{"role": "user", "content": "Do you sell watering cans?"}])
    first = await client.messages.create(**request)
    second = await client.messages.create(**request)
    assert first.stop_reason == "max_tokens" and first.content[0].text.strip()
    assert first.usage.cache_read_input_tokens == 0 and first.usage.output_tokens == 6
    assert second.usage.cache_read_input_tokens == first.usage.cache_creation_input_tokens > 0
    async with client.messages.stream(**request) as stream:
        text = "".join([piece async for piece in stream.text_stream])
        final = await stream.get_final_message()
    assert text == final.content[0].text and final.usage.output_tokens == 6
    count = await client.messages.count_tokens(model="sim-model", system=system,
                                               messages=[{"role": "user", "content": "Do you sell watering cans?"}])
    assert count.input_tokens == first.usage.input_tokens + first.usage.cache_read_input_tokens
    with pytest.raises(anthropic.NotFoundError, match="does not exist"):
        await client.messages.create(**{**request, "model": "no-such-model"})


async def test_token_in_token_out_apis_through_the_picker(stack):
    async with aiohttp.ClientSession() as http:
        async with http.post(stack.url + "/inference/v1/generate", json={
                "model": "sim-model", "token_ids": list(range(20, 90)), "sampling_params": {"max_tokens": 4}}) as r:
            assert r.status == 200, await r.text()
            body = await r.json()
        assert len(body["choices"][0]["token_ids"]) == 4 and body["usage"]["prompt_tokens"] == 70
        async with http.post(stack.url + "/generate", json={"text": SYSTEM,
                                                            "sampling_params": {"max_new_tokens": 3}}) as r:
            assert r.status == 200, await r.text()
            body = await r.json()
        assert len(body["output_ids"]) == 3 and body["meta_info"]["finish_reason"]["type"] == "length"
