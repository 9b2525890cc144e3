"""`GET /debug/state` on the metrics port: off unless enabled; plugins', endpoints', ledger's state, no request content."""

from __future__ import annotations

import json

import aiohttp
import pytest

from epp.debug.state import MAX_PLUGIN_STATE_BYTES
from epp.framework import Scorer
from tests.support.configs import endpoint_picker_config, plugin
from tests.support.extproc import ExtProcClient, options, pipeline_of, request_body, request_headers, started
from tests.support.wait import wait_until

SESSION = "session-of-alice-7f3a"
PROMPT = "a secret prompt the debug page must never show " * 8
CONFIG = endpoint_picker_config(
    [plugin("approx-prefix-cache-producer", autoTune=False), "prefix-cache-scorer", "queue-scorer",
     plugin("session-affinity-scorer", strategy="session_id"), "max-score-picker"],
    {"prefix-cache-scorer": 3, "queue-scorer": 1, "session-affinity-scorer": 1, "max-score-picker": None})


async def get(port: int, path: str, method: str = "GET", body: bytes | None = None) -> tuple[int, str]:
    async with aiohttp.ClientSession() as http:
        async with http.request(method, f"http://127.0.0.1:{port}{path}", data=body) as resp:
            return resp.status, await resp.text()


async def send(server, count: int) -> None:
    """`count` requests through the picker's ext_proc, left in flight (no response yet)."""
    client = ExtProcClient(server.grpc_port)
    body = json.dumps({"model": "m", "prompt": PROMPT}).encode()
    try:
        for _ in range(count):
            await client.exchange([request_headers(extra=[("x-session-id", SESSION)]), request_body(body)], 2)
    finally:
        await client.close()


def plugin_state(page: dict, name: str) -> dict:
    return next(p for p in page["plugins"] if p["name"] == name)


async def test_the_debug_routes_are_off_unless_enabled():
    server = await started()
    try:
        status, text = await get(server.metrics_port, "/debug/state")
        assert status == 404 and "--enable-debug-endpoint" in json.loads(text)["error"]
        status, text = await get(server.metrics_port, "/debug/explain", "POST", b"{}")
        assert status == 404
        status, text = await get(server.metrics_port, "/metrics")
        assert status == 200 and "inference_extension_scheduler_attempts_total" in text
    finally:
        await server.stop(0)


async def test_the_state_shows_plugins_endpoints_and_ledger_without_request_content():
    from epp.server.runner import EppServer

    server = EppServer(options(config_text=CONFIG, enable_debug_endpoint=True))
    await server.start()
    try:
        await send(server, 3)
        status, text = await get(server.metrics_port, "/debug/state")
    finally:
        await server.stop(0)
    assert status == 200
    page = json.loads(text)
    assert PROMPT[:30] not in text and SESSION not in text
    assert page["server"]["ready"] is True and page["server"]["profiles"] == ["default"]
    # The same prompt three times, one session: one endpoint holds its blocks and got every request.
    prefix = plugin_state(page, "approx-prefix-cache-producer")
    assert prefix["kinds"] == ["data-producer", "pre-request"]
    [(holder, held)] = prefix["state"]["endpoints"].items()
    assert held["held"] > 0 and held["capacity"] == 31250
    assert prefix["state"]["entries"] == held["held"]
    sessions = plugin_state(page, "session-affinity-scorer")["state"]
    assert sessions == {"strategy": "session_id", "sessions": 1, "max_sessions": 100_000, "ttl_s": 300.0}
    assert plugin_state(page, "queue-scorer")["state"] == {}
    assert page["inflight_ledger"]["bookings"] == 3 and page["inflight_ledger"]["capacity"] == 100_000
    endpoints = {ep["endpoint"]: ep for ep in page["endpoints"]}
    assert set(endpoints) == {"10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"}
    assert endpoints[holder]["inflight"]["requests"] == 3
    assert sum(ep["inflight"]["requests"] for ep in page["endpoints"]) == 3
    assert all(ep["scrape_age_s"] is None and ep["fresh"] is None for ep in page["endpoints"])  # not scraped
    assert page["flow_control"] is None


async def test_flow_control_shows_a_waiting_request_in_its_band():
    from epp.server.runner import EppServer

    # Never scraped, the pool looks saturated to the detector: a request waits in the queue.
    config = endpoint_picker_config(["queue-scorer"], ["queue-scorer"], featureGates=["flowControl"])
    server = EppServer(options(config_text=config, enable_debug_endpoint=True))
    await server.start()
    client = ExtProcClient(server.grpc_port)
    try:
        call = await client.open()
        await call.write(request_headers())
        await call.write(request_body(json.dumps({"model": "m", "prompt": PROMPT}).encode()))
        await wait_until(lambda: server.pipeline.flow_controller.queued_requests == 1, "the request to queue")
        status, text = await get(server.metrics_port, "/debug/state")
        call.cancel()
    finally:
        await client.close()
        await server.stop(0)
    flow = json.loads(text)["flow_control"]
    assert flow["queued_requests"] == 1 and flow["queued_bytes"] > 0
    assert [(b["priority"], b["requests"], b["flows"]) for b in flow["bands"]] == [(0, 1, 1)]
    assert "default-flow" not in text  # fairness ids are the clients'


class BrokenState(Scorer):
    type_name = "broken-state"

    def score(self, state, request, endpoints):
        return {}

    def debug_state(self):
        raise RuntimeError("this message may quote a prompt")


class HugeState(Scorer):
    type_name = "huge-state"

    def score(self, state, request, endpoints):
        return {}

    def debug_state(self):
        return {"blob": "x" * (MAX_PLUGIN_STATE_BYTES + 1), "nan": float("nan")}


class OddState(Scorer):
    type_name = "odd-state"

    def score(self, state, request, endpoints):
        return {}

    def debug_state(self):
        return {"inf": float("inf"), "set": frozenset({1}), "tuple": (1, 2), "object": object, 3: "int key"}


async def test_one_plugins_state_cannot_break_or_bloat_the_page(caplog):
    server = await started(pipeline_of([BrokenState(), HugeState(), OddState()]), enable_debug_endpoint=True)
    try:
        status, text = await get(server.metrics_port, "/debug/state")
    finally:
        await server.stop(0)
    assert status == 200
    page = json.loads(text)  # valid JSON: no NaN or Infinity
    assert plugin_state(page, "broken-state") == {"name": "broken-state", "type": "broken-state", "kinds": ["scorer"],
                                                  "error": "debug_state failed: RuntimeError"}
    assert "may quote a prompt" not in text
    huge = plugin_state(page, "huge-state")["state"]
    assert huge["truncated"] is True and huge["bytes"] > MAX_PLUGIN_STATE_BYTES
    assert len(text) < 2 * MAX_PLUGIN_STATE_BYTES
    assert plugin_state(page, "odd-state")["state"] == {"inf": None, "set": [1], "tuple": [1, 2],
                                                        "object": "<class 'object'>", "3": "int key"}


async def test_one_plugin_asked_for_by_name_comes_whole_and_alone():
    server = await started(pipeline_of([HugeState(), OddState()]), enable_debug_endpoint=True)
    try:
        status, text = await get(server.metrics_port, "/debug/state?plugin=huge-state")
        missing, error = await get(server.metrics_port, "/debug/state?plugin=no-such-plugin")
    finally:
        await server.stop(0)
    assert status == 200
    page = json.loads(text)
    assert [p["name"] for p in page["plugins"]] == ["huge-state"]
    assert plugin_state(page, "huge-state")["state"] == {"blob": "x" * (MAX_PLUGIN_STATE_BYTES + 1), "nan": None}
    assert missing == 404 and "huge-state" in json.loads(error)["error"]  # the names it has


@pytest.mark.parametrize("method, path, status", [
    ("POST", "/debug/state", 405), ("GET", "/debug/explain", 405), ("GET", "/debug/nothing", 404),
    ("GET", "/debug", 404),
])
async def test_wrong_routes_and_methods_get_a_json_error(method, path, status):
    server = await started(enable_debug_endpoint=True)
    try:
        got, text = await get(server.metrics_port, path, method, b"{}" if method == "POST" else None)
    finally:
        await server.stop(0)
    assert got == status and json.loads(text)["error"]
