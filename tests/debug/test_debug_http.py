"""The metrics port's `/debug` routes when the event loop cannot answer: busy, closed, or failing."""

from __future__ import annotations

import asyncio
import json

import aiohttp
from prometheus_client import CollectorRegistry, Counter

from epp.debug import http as debug_http
from epp.debug.http import DebugRoutes, metrics_app, start_metrics_http

EXPLAIN = json.dumps({"body": {"model": "m", "prompt": "hi"}}).encode()


async def ask(port: int) -> list[tuple[int, dict]]:
    answers = []
    async with aiohttp.ClientSession() as http:
        for method, path, body in (("GET", "/debug/state", None), ("POST", "/debug/explain", EXPLAIN)):
            async with http.request(method, f"http://127.0.0.1:{port}{path}", data=body) as resp:
                answers.append((resp.status, await resp.json()))
    return answers


async def serving(routes: DebugRoutes, registry: CollectorRegistry | None = None):
    server = start_metrics_http("127.0.0.1", 0, metrics_app(registry or CollectorRegistry(), routes))
    return server, server.server_port


async def test_a_loop_that_does_not_answer_in_time_gets_503(monkeypatch):
    monkeypatch.setattr(debug_http, "LOOP_TIMEOUT_S", 0.2)
    release = asyncio.Event()

    async def stuck(*_args):
        await release.wait()

    server, port = await serving(DebugRoutes(asyncio.get_running_loop(), stuck, stuck))
    try:
        for status, answer in await ask(port):
            assert (status, answer) == (503, {"error": "the picker's event loop did not answer within 0.2s"})
    finally:
        release.set()
        server.shutdown()
        server.server_close()


async def test_a_closed_loop_means_shutting_down():
    closed = asyncio.new_event_loop()
    closed.close()

    async def never(*_args):
        raise AssertionError("not run")

    server, port = await serving(DebugRoutes(closed, never, never))
    try:
        for status, answer in await ask(port):
            assert (status, answer) == (503, {"error": "the picker is shutting down"})
    finally:
        server.shutdown()
        server.server_close()


async def test_a_failure_inside_is_a_logged_500_naming_its_type(caplog):
    caplog.set_level("INFO")
    async def broken(*_args):
        raise KeyError("a detail that stays in the log")

    server, port = await serving(DebugRoutes(asyncio.get_running_loop(), broken, broken))
    try:
        for status, answer in await ask(port):
            assert (status, answer) == (500, {"error": "the debug request failed: KeyError (logged)"})
    finally:
        server.shutdown()
        server.server_close()
    assert "debug request failed: KeyError at test_debug_http.py" in caplog.text
    assert "a detail that stays" not in caplog.text  # an exception's message may quote a prompt


async def test_metrics_are_served_on_every_other_path():
    registry = CollectorRegistry()
    Counter("epp_debug_test_hits", "A counter this test reads back.", registry=registry).inc()
    server, port = await serving(None, registry)
    try:
        async with aiohttp.ClientSession() as http:
            for path in ("/metrics", "/"):
                async with http.get(f"http://127.0.0.1:{port}{path}") as resp:
                    assert resp.status == 200 and "epp_debug_test_hits_total 1.0" in await resp.text()
    finally:
        server.shutdown()
        server.server_close()
