"""End to end: `epp serve` as a process over simulated vLLM replicas behind real Envoy, asked by `epp explain`.

A prompt sent through Envoy leaves its prefix on one replica; `epp explain` with the same prompt
shows that replica scoring 1 on the prefix scorer and chosen, as the next real request then is,
and the picker's state (in-flight bookings, prefix index) is the same before and after explaining.
"""

from __future__ import annotations

import asyncio
import json
import sys

import aiohttp
import pytest

from epp.engine.sim import FleetConfig, SimFleet
from epp.engine.sim.fleet import default_tokenizer_dir
from epp.engine.sim.server import REPLICA_HEADER
from epp.envoy import EnvoyProcess, render_config
from epp.netutil import free_ports
from tests.support.configs import endpoint_picker_config, plugin
from tests.support.precise import prompt_of

pytestmark = [pytest.mark.envoy, pytest.mark.timeout(120)]

MODEL = "sim-model"
CONFIG = endpoint_picker_config(
    [plugin("approx-prefix-cache-producer", autoTune=False), "prefix-cache-scorer", "queue-scorer",
     "kv-cache-utilization-scorer", "max-score-picker"],
    {"prefix-cache-scorer": 3, "queue-scorer": 1, "kv-cache-utilization-scorer": 1, "max-score-picker": None})


async def epp_command(*args: str, stdin: bytes | None = None) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "epp.cli", *args, stdin=asyncio.subprocess.PIPE if stdin else None,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(stdin), 60)
    return proc.returncode, out.decode(), err.decode()


async def debug_state(http: aiohttp.ClientSession, metrics_port: int) -> dict:
    async with http.get(f"http://127.0.0.1:{metrics_port}/debug/state") as resp:
        assert resp.status == 200
        return await resp.json()


def booked_and_indexed(state: dict) -> tuple:
    prefix = next(p for p in state["plugins"] if p["name"] == "approx-prefix-cache-producer")
    return state["inflight_ledger"]["bookings"], prefix["state"]["entries"], prefix["state"]["endpoints"]


async def test_epp_explain_shows_the_replica_holding_the_prefix(tmp_path):
    tokenizer_dir = default_tokenizer_dir()
    fleet_config = FleetConfig(replicas=3, model=MODEL, tokenizer_dir=tokenizer_dir, kv_events=False)
    grpc_port, health_port, metrics_port, listen, admin = free_ports(5)
    prompt = prompt_of(tokenizer_dir, seed=5, tokens=600)
    request = {"model": MODEL, "prompt": prompt, "max_tokens": 2}
    (tmp_path / "request.json").write_text(json.dumps(request))
    async with SimFleet(fleet_config) as fleet, aiohttp.ClientSession() as http:
        names = {d["name"]: d["endpoint"] for d in fleet.info}
        picker = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "epp.cli", "serve", "--grpc-port", str(grpc_port), "--grpc-health-port",
            str(health_port), "--metrics-port", str(metrics_port), "--bind-address", "127.0.0.1",
            "--endpoints", fleet.endpoints_arg, "--config-text", CONFIG, "--enable-debug-endpoint",
            "--grace-period", "1", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        envoy = None
        try:
            started = await asyncio.wait_for(picker.stdout.readline(), 60)
            assert started.startswith(b"epp serve:"), started + await picker.stderr.read()
            envoy = EnvoyProcess(render_config(listen_port=listen, admin_port=admin, epp_port=grpc_port), admin)
            await envoy.start()
            url = f"http://127.0.0.1:{listen}/v1/completions"
            async with http.post(url, json=request) as resp:
                assert resp.status == 200, await resp.text()
                holder = names[resp.headers[REPLICA_HEADER]]
            before = booked_and_indexed(await debug_state(http, metrics_port))
            assert list(before[2]) == [holder]

            code, out, err = await epp_command("explain", "--url", f"127.0.0.1:{metrics_port}",
                                               str(tmp_path / "request.json"))
            assert code == 0, err
            assert out.rstrip().endswith(f"the picker would route to: {holder}")
            row = next(line for line in out.splitlines() if line.strip().startswith(holder))
            assert row.split()[1:3] == ["*", "1.000"]  # picked, prefix-cache-scorer 1.0
            assert "producer approx-prefix-cache-producer: ok" in out

            code, out, err = await epp_command("explain", "--url", f"http://127.0.0.1:{metrics_port}/metrics",
                                               "--json", "-", stdin=json.dumps(request).encode())
            assert code == 0, err
            answer = json.loads(out)
            [profile] = answer["profiles"]
            rows = {r["endpoint"]: r for r in profile["endpoints"]}
            assert answer["picked"] == [holder] and set(rows) == set(fleet.endpoints)
            assert rows[holder]["scores"]["prefix-cache-scorer"] == 1.0
            assert all(r["scores"]["prefix-cache-scorer"] == 0.0 for ep, r in rows.items() if ep != holder)

            assert booked_and_indexed(await debug_state(http, metrics_port)) == before
            async with http.post(url, json=request) as resp:
                assert resp.status == 200
                assert names[resp.headers[REPLICA_HEADER]] == holder

            code, _, err = await epp_command("explain", "--url", f"127.0.0.1:{metrics_port}", '{"prompt": "x"}')
            assert code == 1 and "400 inference error: BadRequest - model not found in request body" in err
        finally:
            if envoy is not None:
                await envoy.stop()
            picker.terminate()
            assert await asyncio.wait_for(picker.wait(), 30) == 0
    code, _, err = await epp_command("explain", "--url", f"127.0.0.1:{metrics_port}", json.dumps(request))
    assert code == 1 and "cannot reach" in err
