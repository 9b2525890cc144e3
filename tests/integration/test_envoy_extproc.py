"""Real Envoy → the picker (ext_proc) → real local backends, over loopback."""

from __future__ import annotations

import asyncio
import hashlib
import json
import time

import aiohttp
import pytest
import pytest_asyncio

from epp.datalayer.registry import parse_endpoint_list
from epp.envoy import EnvoyProcess, render_config
from epp.server.runner import EppServer, ServeOptions
from tests.support.backends import EchoBackend
from tests.support.configs import endpoint_picker_config
from tests.support.ports import free_port

pytestmark = [pytest.mark.envoy, pytest.mark.asyncio(loop_scope="module")]

RANDOM_PICKER_CONFIG = endpoint_picker_config(["random-picker"], ["random-picker"])


class Stack:
    def __init__(self, backends, epp, envoy, port):
        self.backends, self.epp, self.envoy, self.port = backends, epp, envoy, port

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


async def start_envoy(epp_port: int, **kw) -> tuple[EnvoyProcess, int]:
    listen, admin = free_port(), free_port()
    envoy = EnvoyProcess(render_config(listen_port=listen, admin_port=admin, epp_port=epp_port, **kw), admin)
    await envoy.start()
    return envoy, listen


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def stack():
    backends = [EchoBackend(f"b{i}") for i in range(3)]
    for b in backends:
        await b.start()
    epp = EppServer(ServeOptions(
        grpc_port=0, grpc_health_port=0, metrics_port=0, bind_address="127.0.0.1",
        endpoints=parse_endpoint_list(",".join(b.hostport for b in backends)),
        config_text=RANDOM_PICKER_CONFIG, scrape_metrics=False, grace_period_s=1))
    await epp.start()
    envoy, port = await start_envoy(epp.grpc_port)
    yield Stack(backends, epp, envoy, port)
    await envoy.stop()
    await epp.stop(0)
    for b in backends:
        await b.stop()


async def post(url: str, body: bytes | dict, headers: dict | None = None):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with aiohttp.ClientSession() as session:
        async with session.post(url, data=data, headers={"content-type": "application/json", **(headers or {})}) as r:
            return r.status, dict(r.headers), await r.read()


async def test_requests_reach_the_endpoint_the_picker_chose(stack):
    seen = set()
    for i in range(12):
        status, headers, body = await post(stack.url + "/v1/completions", {"model": "m", "prompt": f"hello {i}"})
        assert status == 200, body
        backend = next(b for b in stack.backends if b.name == headers["x-backend"])
        assert backend.received[-1]["headers"]["x-gateway-destination-endpoint"] == backend.hostport
        seen.add(backend.name)
    assert len(seen) >= 2  # a random picker over 3 backends spreads 12 requests


async def test_one_mib_body_arrives_byte_identical(stack):
    payload = json.dumps({"model": "m", "prompt": "ab" * (512 * 1024)}).encode()
    status, _, body = await post(stack.url + "/v1/completions", payload)
    assert status == 200
    echoed = json.loads(body)
    assert echoed["size"] == len(payload)
    assert echoed["sha256"] == hashlib.sha256(payload).hexdigest()


async def test_sse_arrives_chunk_by_chunk(stack):
    arrivals = []
    async with aiohttp.ClientSession() as session:
        async with session.post(stack.url + "/v1/completions",
                                json={"model": "m", "prompt": "hi", "stream": True, "events": 4, "delay": 0.3}) as r:
            assert r.status == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            async for line in r.content:
                if line.startswith(b"data: {") and b'"sent"' in line:
                    arrivals.append((time.time(), json.loads(line[6:])["sent"]))
    assert len(arrivals) == 4
    # Each event reaches the client long before the stream ends (no buffering on the way).
    stream_end = arrivals[-1][0]
    assert stream_end - arrivals[0][0] > 0.6
    assert all(received - sent < 0.25 for received, sent in arrivals)


async def test_malformed_body_gets_the_400_body(stack):
    status, headers, body = await post(stack.url + "/v1/completions", b"no healthy upstream")
    assert (status, headers["Content-Type"]) == (400, "application/json")
    assert json.loads(body)["error"]["message"].startswith(
        "inference error: BadRequest - error unmarshaling request bodyMap")
    status, _, body = await post(stack.url + "/v1/completions", {"prompt": "hello world"})
    assert (status, json.loads(body)) == (400, {"error": {
        "message": "inference error: BadRequest - model not found in request body", "type": "invalid_request_error",
        "param": None, "code": "BadRequest"}})


async def test_subset_hint_header_is_obeyed(stack):
    target = stack.backends[1]
    for i in range(6):
        status, headers, _ = await post(stack.url + "/v1/completions", {"model": "m", "prompt": f"s{i}"},
                                        {"x-gateway-destination-endpoint-subset": target.hostport})
        assert status == 200 and headers["x-backend"] == target.name
    status, headers, body = await post(stack.url + "/v1/completions", {"model": "m", "prompt": "x"},
                                       {"x-gateway-destination-endpoint-subset": "127.0.0.1:1"})
    assert status == 503 and b"failed to find endpoint candidates" in body
    assert headers["x-llm-d-request-dropped-reason"] == "rejected-no-endpoints"


async def test_header_only_request_is_routed(stack):
    async with aiohttp.ClientSession() as session:
        async with session.get(stack.url + "/v1/models") as r:
            assert r.status == 200
            assert r.headers["x-backend"] in {b.name for b in stack.backends}


@pytest.mark.parametrize("fail_open", [False, True])
async def test_picker_down_follows_failure_mode_allow(stack, fail_open):
    dead_port = free_port()  # nothing listens: the picker is down
    envoy, port = await start_envoy(dead_port, failure_mode_allow=fail_open)
    target = stack.backends[2]
    own_route = {"x-gateway-destination-endpoint": target.hostport}
    try:
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://127.0.0.1:{port}/v1/models", headers=own_route) as r:
                # Unprocessed, the request has no picked endpoint; a client's own header is stripped
                # (tests/integration/test_open_proxy.py), so Envoy has no upstream for it.
                assert r.status == (503 if fail_open else 500)
                assert "x-backend" not in r.headers
        # With FULL_DUPLEX_STREAMED bodies Envoy (1.40) fails closed for a request whose body was
        # already streamed when the stream failed; the fail-open config ejects the picker at the
        # first failure (and health-checks it), so this later one fails open, to no upstream either
        # (tests/blackbox/test_gie_conformance.py: the first request is the one that fails closed).
        status, _, _ = await post(f"http://127.0.0.1:{port}/v1/completions", {"model": "m", "prompt": "x"},
                                  own_route)
        assert status == (503 if fail_open else 500)
    finally:
        await envoy.stop()



async def test_request_only_envoy_config_routes_without_response_phases(stack):
    envoy, port = await start_envoy(stack.epp.grpc_port, responses="none")
    phases = _phase_counts(stack)
    try:
        for i in range(4):
            status, headers, body = await post(f"http://127.0.0.1:{port}/v1/completions",
                                               {"model": "m", "prompt": f"lean {i}"})
            assert status == 200 and json.loads(body)["model"] == "m"
        after = _phase_counts(stack)
        assert after["request_headers"] - phases.get("request_headers", 0) == 4
        assert after.get("response_headers", 0) == phases.get("response_headers", 0)
        # The picker still sees each request end (the ext_proc stream closes), so nothing stays in flight.
        for _ in range(40):
            if stack.epp.metrics.running_requests.labels("m")._value.get() == 0:
                break
            await asyncio.sleep(0.05)
        assert stack.epp.metrics.running_requests.labels("m")._value.get() == 0
    finally:
        await envoy.stop()


async def test_headers_only_responses_stream_past_the_picker_and_end_with_the_response(stack):
    envoy, port = await start_envoy(stack.epp.grpc_port, responses="headers")
    running = stack.epp.metrics.running_requests.labels("m")._value
    phases = _phase_counts(stack)
    try:
        async with aiohttp.ClientSession() as session:
            async with session.post(f"http://127.0.0.1:{port}/v1/completions",
                                    json={"model": "m", "prompt": "lean", "stream": True, "events": 4,
                                          "delay": 0.2}) as r:
                assert r.status == 200
                first = await r.content.readline()
                assert json.loads(first.removeprefix(b"data: "))["choices"][0]["text"] == "t0"
                await asyncio.sleep(0.1)  # time for the picker (in this process) to see a close, were there one
                # The response is still streaming (0.6 s to go): the request still runs on its endpoint.
                assert running.get() == 1
                rest = await r.read()
        assert b"t3" in rest and rest.endswith(b"data: [DONE]\n\n")
        for _ in range(40):  # the ext_proc stream closes once the response has ended
            if running.get() == 0:
                break
            await asyncio.sleep(0.05)
        assert running.get() == 0
        after = _phase_counts(stack)
        assert after["response_headers"] - phases.get("response_headers", 0) == 1
        assert after.get("response_body", 0) == phases.get("response_body", 0)  # no chunk crossed gRPC
    finally:
        await envoy.stop()


def _phase_counts(stack) -> dict[str, float]:
    return {s.labels["phase"]: s.value for s in stack.epp.metrics.messages.collect()[0].samples
            if s.name.endswith("_total")}



def _stream_errors(stack) -> dict[str, float]:
    return {s.labels["reason"]: s.value for s in stack.epp.metrics.stream_errors.collect()[0].samples
            if s.name.endswith("_total")}


@pytest.mark.parametrize("responses", ["full", "headers", "none"])
async def test_successful_requests_count_no_stream_error(stack, responses):
    """Envoy resets about half the ext_proc streams it is done with instead of half-closing them: no error."""
    envoy, port = (stack.envoy, stack.port) if responses == "full" else await start_envoy(
        stack.epp.grpc_port, responses=responses)
    before = _stream_errors(stack)
    try:
        async with aiohttp.ClientSession() as session:
            for i in range(24):
                body = {"model": "m", "prompt": f"s{i}", "stream": i % 3 != 0, "events": 3, "delay": 0.0}
                async with session.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as r:
                    assert r.status == 200
                    await r.read()
        running = stack.epp.metrics.running_requests.labels("m")._value
        for _ in range(40):  # each ext_proc stream closes after its response
            if running.get() == 0:
                break
            await asyncio.sleep(0.05)
        assert running.get() == 0
        assert _stream_errors(stack) == before
    finally:
        if envoy is not stack.envoy:
            await envoy.stop()


async def test_a_client_leaving_mid_stream_counts_as_cancelled(stack):
    before = _stream_errors(stack).get("cancelled", 0.0)
    async with aiohttp.ClientSession() as session:
        async with session.post(stack.url + "/v1/completions",
                                json={"model": "m", "prompt": "leaving", "stream": True, "events": 20,
                                      "delay": 0.1}) as r:
            assert r.status == 200
            await r.content.readline()
            r.close()  # the client hangs up with 19 events to go
    for _ in range(60):
        if _stream_errors(stack).get("cancelled", 0.0) > before:
            break
        await asyncio.sleep(0.05)
    assert _stream_errors(stack).get("cancelled", 0.0) == before + 1
