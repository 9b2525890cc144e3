"""Responses API follow-ups (`previous_response_id`) reach the replica that stored the response, through real Envoy.

Three replicas behind Envoy and the picker (a random picker: without affinity a follow-up lands on
any of them). Each replica is a small Responses server that keeps its responses in its own memory,
as vLLM does, and answers 404 for an id it does not hold. The picker learns id -> replica from the
responses it passes back (a JSON body's `id`, a stream's `response.created`), pins a follow-up to
that replica, answers 404 itself in OpenAI's error shape when that replica has left the pool, and
routes an id it does not know (never seen, `store: false`) like any request.
"""

from __future__ import annotations

import asyncio
import json
import uuid

import aiohttp
import openai
import pytest
import pytest_asyncio
from aiohttp import web

from epp.datalayer.registry import parse_endpoint_list
from epp.envoy import EnvoyProcess, render_config
from epp.server.runner import EppServer, ServeOptions
from tests.support.configs import endpoint_picker_config
from tests.support.ports import free_port

pytestmark = [pytest.mark.envoy, pytest.mark.asyncio(loop_scope="module")]

FOLLOW_UPS = 6  # by chance a random picker sends all of them to one of 3 replicas 1 time in 243


class ResponsesReplica:
    """A Responses server holding its responses in memory (vLLM's `--enable-store` behaviour, in small)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.port = free_port()
        self.stored: dict[str, dict] = {}
        self.received: list[dict] = []
        self._runner: web.AppRunner | None = None

    @property
    def hostport(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/responses", self.create)
        app.router.add_get("/v1/responses/{id}", self.retrieve)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def retrieve(self, request: web.Request) -> web.Response:
        found = self.stored.get(request.match_info["id"])
        if found is None:
            return web.json_response({"error": {"message": "not found"}}, status=404, headers={"x-backend": self.name})
        return web.json_response(found, headers={"x-backend": self.name})

    async def create(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.received.append(body)
        previous = body.get("previous_response_id")
        headers = {"x-backend": self.name}
        if previous is not None and previous not in self.stored:
            return web.json_response({"error": {"message": f"Response with id '{previous}' not found.",
                                                "type": "invalid_request_error", "param": "previous_response_id",
                                                "code": "previous_response_not_found"}}, status=404, headers=headers)
        turns = (self.stored[previous]["turns"] if previous else 0) + 1
        response = {"id": f"resp_{uuid.uuid4().hex}", "object": "response", "created_at": 0, "model": body["model"],
                    "status": "completed", "turns": turns,
                    "output": [{"type": "message", "role": "assistant",
                                "content": [{"type": "output_text", "text": f"turn {turns}"}]}],
                    "usage": {"input_tokens": 5 * turns, "output_tokens": 2, "total_tokens": 5 * turns + 2}}
        if body.get("store", True):
            self.stored[response["id"]] = response
        if not body.get("stream"):
            return web.json_response(response, headers=headers)
        stream = web.StreamResponse(headers={"content-type": "text/event-stream", **headers})
        await stream.prepare(request)
        events = [("response.created", {"response": {**response, "status": "in_progress", "usage": None}}),
                  ("response.output_text.delta", {"delta": f"turn {turns}"}),
                  ("response.completed", {"response": response})]
        for i, (kind, data) in enumerate(events):
            event = {"type": kind, "sequence_number": i, **data}
            await stream.write(f"event: {kind}\ndata: {json.dumps(event)}\n\n".encode())
            await asyncio.sleep(0.01)
        await stream.write_eof()
        return stream


class Stack:
    def __init__(self, replicas, epp, envoy, port):
        self.replicas, self.epp, self.envoy, self.port = replicas, epp, envoy, port

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1/responses"

    def replica(self, name: str) -> ResponsesReplica:
        return next(r for r in self.replicas if r.name == name)

    def lookups(self, outcome: str) -> float:
        value = self.epp.metrics.registry.get_sample_value(
            "epp_response_affinity_lookups_total", {"parser": "openai-parser", "outcome": outcome})
        return value or 0.0


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def stack():
    replicas = [ResponsesReplica(f"r{i}") for i in range(3)]
    for r in replicas:
        await r.start()
    epp = EppServer(ServeOptions(
        grpc_port=0, grpc_health_port=0, metrics_port=0, bind_address="127.0.0.1",
        endpoints=parse_endpoint_list(",".join(r.hostport for r in replicas)),
        config_text=endpoint_picker_config(["random-picker"], ["random-picker"]), scrape_metrics=False,
        grace_period_s=1))
    await epp.start()
    listen, admin = free_port(), free_port()
    envoy = EnvoyProcess(render_config(listen_port=listen, admin_port=admin, epp_port=epp.grpc_port), admin)
    await envoy.start()
    yield Stack(replicas, epp, envoy, listen)
    await envoy.stop()
    await epp.stop(0)
    for r in replicas:
        await r.stop()


async def post(url: str, body: dict) -> tuple[int, dict, bytes]:
    async with aiohttp.ClientSession() as session:
        async with session.post(url, json=body) as r:
            return r.status, dict(r.headers), await r.read()


async def stream_id(url: str, body: dict) -> tuple[str, str]:
    """The response id a streamed response announces in `response.created`, and the replica that sent it."""
    async with aiohttp.ClientSession() as session:
        async with session.post(url, json={**body, "stream": True}) as r:
            assert r.status == 200
            found = None
            async for line in r.content:
                if line.startswith(b"data: ") and found is None:
                    event = json.loads(line[6:])
                    if event["type"] == "response.created":
                        found = event["response"]["id"]
            return found, r.headers["x-backend"]


async def test_follow_ups_reach_the_replica_that_stored_the_previous_response(stack):
    status, headers, body = await post(stack.url, {"model": "m", "input": "hello"})
    assert status == 200
    home, previous = headers["x-backend"], json.loads(body)["id"]
    pinned = stack.lookups("pinned")
    for turn in range(2, FOLLOW_UPS + 2):
        status, headers, body = await post(stack.url, {"model": "m", "input": "and then?",
                                                       "previous_response_id": previous})
        assert (status, headers["x-backend"]) == (200, home), body
        answer = json.loads(body)
        assert answer["turns"] == turn  # the replica continued its own stored conversation
        previous = answer["id"]
    assert stack.lookups("pinned") - pinned == FOLLOW_UPS


async def test_retrieving_a_stored_response_goes_to_the_replica_that_holds_it(stack):
    status, headers, body = await post(stack.url, {"model": "m", "input": "hello"})
    home, stored = headers["x-backend"], json.loads(body)["id"]
    async with aiohttp.ClientSession() as session:
        for _ in range(FOLLOW_UPS):  # a GET has no body: without the path's affinity it goes anywhere
            async with session.get(f"{stack.url}/{stored}") as r:
                assert (r.status, r.headers["x-backend"]) == (200, home)
                assert (await r.json())["id"] == stored


async def test_a_streamed_response_is_learned_from_its_response_created_event(stack):
    previous, home = await stream_id(stack.url, {"model": "m", "input": "hello"})
    assert previous is not None
    for _ in range(FOLLOW_UPS):
        previous, backend = await stream_id(stack.url, {"model": "m", "input": "more", "previous_response_id": previous})
        assert backend == home


async def test_the_openai_sdk_continues_a_conversation(stack):
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{stack.port}/v1", api_key="unused", max_retries=0)
    first = await client.responses.create(model="m", input="hello")
    second = await client.responses.create(model="m", input="and?", previous_response_id=first.id)
    third = await client.responses.create(model="m", input="so?", previous_response_id=second.id)
    assert third.output[0].content[0].text == "turn 3"


async def test_an_unknown_id_is_routed_like_any_request_and_the_replica_answers(stack):
    unknown = stack.lookups("unknown")
    status, headers, body = await post(stack.url, {"model": "m", "input": "x", "previous_response_id": "resp_never"})
    # The picker does not know it: any replica gets it and answers as vLLM does for an id it lacks.
    assert status == 404 and json.loads(body)["error"]["code"] == "previous_response_not_found"
    assert headers["x-backend"] in {r.name for r in stack.replicas}
    assert stack.lookups("unknown") - unknown == 1


async def test_a_response_not_stored_teaches_nothing(stack):
    status, _, body = await post(stack.url, {"model": "m", "input": "hello", "store": False})
    assert status == 200
    unknown = stack.lookups("unknown")
    await post(stack.url, {"model": "m", "input": "x", "previous_response_id": json.loads(body)["id"]})
    assert stack.lookups("unknown") - unknown == 1


async def test_when_the_replica_that_stored_it_has_left_the_pool_the_answer_is_a_clear_404(stack):
    status, headers, body = await post(stack.url, {"model": "m", "input": "hello"})
    assert status == 200
    home, previous = stack.replica(headers["x-backend"]), json.loads(body)["id"]
    registry = stack.epp.endpoints
    everyone = registry.snapshot()
    registry.set_endpoints(spec for spec in parse_endpoint_list(",".join(r.hostport for r in stack.replicas))
                           if spec.name != home.hostport)
    try:
        received = sum(len(r.received) for r in stack.replicas)
        status, _, body = await post(stack.url, {"model": "m", "input": "and?", "previous_response_id": previous})
        assert status == 404
        error = json.loads(body)["error"]
        assert (error["type"], error["param"], error["code"]) == ("not_found_error", "previous_response_id", "NotFound")
        assert f"was stored by replica {home.hostport}, which has left the pool" in error["message"]
        assert sum(len(r.received) for r in stack.replicas) == received  # answered by the picker: no replica saw it
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{stack.port}/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.NotFoundError, match="has left the pool"):
            await client.responses.create(model="m", input="and?", previous_response_id=previous)
    finally:
        registry.set_endpoints(parse_endpoint_list(",".join(ep.hostport for ep in everyone)))
