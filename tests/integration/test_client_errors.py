"""The picker's own answers as the official OpenAI and Anthropic Python SDKs read them, through real Envoy.

Each SDK raises its status error with the picker's message in it (before JSON error bodies the
OpenAI SDK showed only "Error code: 400"), with the type and code the body carries; a dropped
request (429, 503) says why in `x-llm-d-request-dropped-reason`. Requests on other paths (no
parser reads them) are routed without being checked.
"""

from __future__ import annotations

import json

import aiohttp
import anthropic
import openai
import pytest
import pytest_asyncio

from epp.datalayer.registry import parse_endpoint_list
from epp.envoy import EnvoyProcess, render_config
from epp.limits import Limits
from epp.server.runner import EppServer, ServeOptions
from tests.support.backends import EchoBackend
from tests.support.configs import endpoint_picker_config
from tests.support.ports import free_port

pytestmark = [pytest.mark.envoy, pytest.mark.asyncio(loop_scope="module")]

DROP_REASON = "x-llm-d-request-dropped-reason"
NOWHERE = {"x-gateway-destination-endpoint-subset": "127.0.0.1:1"}  # a subset hint no endpoint matches


class Gateway:
    def __init__(self, backend: EchoBackend, epp: EppServer, envoy: EnvoyProcess, port: int) -> None:
        self.backend, self.epp, self.envoy, self.port = backend, epp, envoy, port

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def openai(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0)

    def anthropic(self) -> anthropic.AsyncAnthropic:
        return anthropic.AsyncAnthropic(base_url=self.url, api_key="unused", max_retries=0)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def gateway():
    backend = EchoBackend("b0")
    await backend.start()
    # One stream at a time: a second request while a response streams is refused (429).
    epp = EppServer(ServeOptions(
        grpc_port=0, grpc_health_port=0, metrics_port=0, bind_address="127.0.0.1",
        endpoints=parse_endpoint_list(backend.hostport), limits=Limits(max_concurrent_streams=1),
        config_text=endpoint_picker_config(["random-picker"], ["random-picker"]), scrape_metrics=False,
        grace_period_s=1))
    await epp.start()
    listen, admin = free_port(), free_port()
    envoy = EnvoyProcess(render_config(listen_port=listen, admin_port=admin, epp_port=epp.grpc_port), admin)
    await envoy.start()
    yield Gateway(backend, epp, envoy, listen)
    await envoy.stop()
    await epp.stop(0)
    await backend.stop()


@pytest.mark.parametrize("call, message", [
    (lambda c: c.chat.completions.create(model="m", messages=[]),
     "inference error: BadRequest - invalid chat completions request: must have valid messages field"),
    (lambda c: c.completions.create(model="", prompt="hello"),
     "inference error: BadRequest - model not found in request body"),
    (lambda c: c.embeddings.create(model="m", input=""),
     "inference error: BadRequest - invalid embeddings request: must have input field"),
], ids=["chat", "completions", "embeddings"])
async def test_openai_sdk_shows_the_message_of_a_400(gateway, call, message):
    with pytest.raises(openai.BadRequestError) as caught:
        await call(gateway.openai())
    err = caught.value
    assert str(err) == f"Error code: 400 - {message}"
    assert (err.status_code, err.type, err.code) == (400, "invalid_request_error", "BadRequest")
    assert err.response.headers["content-type"] == "application/json"
    assert DROP_REASON not in err.response.headers


async def test_openai_sdk_reads_a_503_and_why_the_request_was_dropped(gateway):
    with pytest.raises(openai.InternalServerError) as caught:
        await gateway.openai().completions.create(model="m", prompt="hello", extra_headers=NOWHERE)
    err = caught.value
    assert str(err) == ("Error code: 503 - inference error: ServiceUnavailable - failed to find endpoint candidates "
                        "for serving the request")
    assert (err.type, err.code) == ("service_unavailable_error", "ServiceUnavailable")
    assert err.response.headers[DROP_REASON] == "rejected-no-endpoints"


async def test_openai_sdk_reads_a_429_and_why_the_request_was_dropped(gateway):
    client = gateway.openai()
    # A streaming response holds the picker's only stream until it ends.
    held = await client.completions.create(model="m", prompt="hold", stream=True,
                                           extra_body={"events": 6, "delay": 0.3})
    try:
        with pytest.raises(openai.RateLimitError) as caught:
            await client.completions.create(model="m", prompt="hello")
    finally:
        async for _ in held:
            pass
    err = caught.value
    assert str(err) == "Error code: 429 - inference error: ResourceExhausted - too many concurrent requests (limit 1)"
    assert (err.type, err.code) == ("rate_limit_error", "ResourceExhausted")
    assert err.response.headers[DROP_REASON] == "rejected-saturated"


async def test_anthropic_sdk_reads_anthropic_error_bodies(gateway):
    client = gateway.anthropic()
    with pytest.raises(anthropic.BadRequestError) as caught:
        await client.messages.create(model="m", max_tokens=8, messages=[])
    err = caught.value
    message = "inference error: BadRequest - invalid messages request: must have valid messages field"
    assert err.body == {"type": "error", "error": {"type": "invalid_request_error", "message": message}}
    assert str(err) == f"400 {message} (path: /v1/messages, type: invalid_request_error)"
    assert (err.status_code, err.type) == (400, "invalid_request_error")

    with pytest.raises(anthropic.BadRequestError) as caught:
        await client.messages.create(model="m", max_tokens=8, messages=[{"role": "robot", "content": "hi"}])
    assert caught.value.body["error"]["message"] == (
        "inference error: BadRequest - invalid messages request: must have valid messages field: messages[0].role "
        "must be one of user, assistant, system")

    with pytest.raises(anthropic.ServiceUnavailableError) as caught:
        await client.messages.create(model="m", max_tokens=8, messages=[{"role": "user", "content": "hi"}],
                                     extra_headers=NOWHERE)
    err = caught.value
    assert err.body["error"]["type"] == "overloaded_error"
    assert "failed to find endpoint candidates" in str(err) and err.status_code == 503
    assert err.response.headers[DROP_REASON] == "rejected-no-endpoints"


async def test_messages_reach_the_backend_with_their_body_unchanged(gateway):
    body = {"model": "m", "max_tokens": 8, "system": [{"type": "text", "text": "be brief"}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    async with aiohttp.ClientSession() as session:
        async with session.post(gateway.url + "/v1/messages", json=body) as r:
            assert r.status == 200
            echoed = await r.json()
    assert echoed["size"] == len(json.dumps(body).encode())
    assert gateway.backend.received[-1]["path"] == "/v1/messages"


@pytest.mark.parametrize("path, body", [
    ("/v1/rerank", {"model": "m", "query": "q", "documents": ["a", "b"]}),
    ("/v2/rerank", {"model": "m", "query": "q", "documents": ["a"]}),
    ("/v1/score", {"model": "m", "text_1": "a", "text_2": "b"}),  # no parser reads /v1/score: passed through
    ("/pooling", {"input": "no model here"}),
])
async def test_other_apis_and_unknown_paths_are_routed(gateway, path, body):
    async with aiohttp.ClientSession() as session:
        async with session.post(gateway.url + path, json=body) as r:
            assert r.status == 200, await r.text()
            assert r.headers["x-backend"] == "b0"
    assert gateway.backend.received[-1]["path"] == path
