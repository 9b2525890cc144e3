"""`epp serve --workers N --enable-debug-endpoint`: the supervisor's metrics port gathers its workers' debug answers."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import aiohttp
from aiohttp import web

from epp.debug.supervisor import add_debug_routes
from epp.netutil import free_ports

ENDPOINTS = "127.0.0.1:1,127.0.0.1:2,127.0.0.1:3"


def call(port: int, path: str, body: dict | None = None) -> tuple[int, dict]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, method="POST" if data else "GET")
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def worker_states(port: int) -> list[dict] | None:
    """Every worker's debug page from the supervisor, once all of them answer (None before)."""
    try:
        status, page = call(port, "/debug/state")
    except OSError:  # the supervisor does not listen yet
        return None
    states = page.get("workers", []) if status == 200 else []
    return states if states and all(w["state"] is not None for w in states) else None


def test_the_supervisor_lists_every_workers_state_and_has_one_explain():
    grpc_port, health_port, metrics_port = free_ports(3)
    proc = subprocess.Popen(
        [sys.executable, "-m", "epp.cli", "serve", "--workers", "2", "--grpc-port", str(grpc_port),
         "--grpc-health-port", str(health_port), "--metrics-port", str(metrics_port), "--bind-address",
         "127.0.0.1", "--endpoints", ENDPOINTS, "--refresh-metrics-interval", "60", "--grace-period", "1",
         "--enable-debug-endpoint"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while (workers := worker_states(metrics_port)) is None:
            assert time.monotonic() < deadline and proc.poll() is None, "the workers never answered"
            time.sleep(0.2)
        assert [w["worker"] for w in workers] == [0, 1]
        assert len({w["pid"] for w in workers}) == 2
        for worker in workers:
            assert {ep["endpoint"] for ep in worker["state"]["endpoints"]} == set(ENDPOINTS.split(","))
            assert worker["state"]["server"]["pid"] == worker["pid"]
        status, page = call(metrics_port, "/debug/state?plugin=max-score-picker")  # passed on to every worker
        assert status == 200 and [[p["name"] for p in w["state"]["plugins"]] for w in page["workers"]] == [
            ["max-score-picker"], ["max-score-picker"]]
        status, answer = call(metrics_port, "/debug/explain", {"body": {"model": "m", "prompt": "hello"}})
        assert status == 200 and answer["worker"] == 0 and len(answer["picked"]) == 1
        status, answer = call(metrics_port, "/debug/explain", {"body": {"prompt": "hello"}})
        assert (status, answer) == (400, {"error": "inference error: BadRequest - model not found in request body"})
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def test_without_the_flag_the_supervisor_says_how_to_enable_it():
    app = web.Application()
    async with aiohttp.ClientSession() as http:
        add_debug_routes(app, [], http, enabled=False)
        runner = web.AppRunner(app)
        await runner.setup()
        [port] = free_ports(1)
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            for method, path in (("GET", "/debug/state"), ("POST", "/debug/explain")):
                async with http.request(method, f"http://127.0.0.1:{port}{path}") as resp:
                    assert resp.status == 404
                    assert "--enable-debug-endpoint" in (await resp.json())["error"]
        finally:
            await runner.cleanup()
