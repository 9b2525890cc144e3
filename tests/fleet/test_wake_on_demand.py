"""Wake on demand through the real Envoy: the request waits, a replica wakes, the request is served."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from epp.config.compose import PluginDef, plugin
from epp.envoy import EnvoyProcess, render_config
from tests.fleet.support import config, set_wake_seconds, spec, start_fleet
from tests.support.pods import start_picker
from tests.support.ports import free_port
from tests.support.wait import wait_until

pytestmark = pytest.mark.envoy

WAKE_S = 0.6
HOLD_S = 2.0
POLICY = plugin("sleep-wake-policy", maxHoldSeconds=HOLD_S, wakeCooldownSeconds=30)


class Stack:
    """Simulated replicas (asleep) -> the picker with the policy -> real Envoy."""

    async def start(self, count: int, policy: PluginDef = POLICY) -> Stack:
        self.fleet = await start_fleet(count)
        set_wake_seconds(self.fleet.replicas, WAKE_S)
        for rep in self.fleet.replicas:
            rep.engine.sleep(1)
        self.epp = await start_picker(config(policy), [spec(r) for r in self.fleet.replicas])
        await wait_until(lambda: all(ep.metrics.sleeping for ep in self.epp.endpoints.snapshot()),
                         "every replica seen asleep")
        listen, admin = free_port(), free_port()
        self.envoy = EnvoyProcess(render_config(listen_port=listen, admin_port=admin, epp_port=self.epp.grpc_port),
                                  admin)
        await self.envoy.start()
        self.url = f"http://127.0.0.1:{listen}/v1/completions"
        return self

    async def stop(self) -> None:
        await self.envoy.stop()
        await self.epp.stop(0)
        await self.fleet.stop()

    async def post(self, session: aiohttp.ClientSession, i: int = 0) -> tuple[int, str, str, float]:
        t0 = time.monotonic()
        body = {"model": "model-a", "prompt": f"hello {i}", "max_tokens": 2}
        async with session.post(self.url, json=body) as resp:
            text = await resp.text()
            return resp.status, resp.headers.get("x-sim-replica", ""), text, time.monotonic() - t0


async def test_request_waits_while_one_replica_wakes_then_is_served():
    stack = await Stack().start(3)
    try:
        async with aiohttp.ClientSession() as session:
            results = await asyncio.gather(*(stack.post(session, i) for i in range(4)))
        for status, _replica, text, elapsed in results:
            assert status == 200, text
            assert elapsed >= WAKE_S * 0.9  # held while the replica woke
            assert elapsed < HOLD_S
        # One wake for the burst (cooldown): all four were served by the same, woken replica.
        woken = {replica for _, replica, _, _ in results}
        assert len(woken) == 1
        awake = [r for r in stack.fleet.replicas if not r.engine.sleeping]
        assert [r.config.name for r in awake] == list(woken)
        assert stack.epp.metrics.registry.get_sample_value(
            "epp_sleep_wake_actions_total", {"action": "wake", "outcome": "ok"}) == 1
    finally:
        await stack.stop()


async def test_failing_wake_answers_503_within_the_bound():
    stack = await Stack().start(1)
    stack.fleet.replicas[0].config.wake_error = "CUDA error: out of memory"
    try:
        async with aiohttp.ClientSession() as session:
            status, _, text, elapsed = await stack.post(session)
        assert status == 503, text
        assert "ServiceUnavailable" in text and "out of memory" in text
        assert elapsed < HOLD_S
        assert stack.fleet.replicas[0].engine.sleeping
    finally:
        await stack.stop()


async def test_slow_wake_answers_503_at_the_hold_bound():
    stack = await Stack().start(1)
    set_wake_seconds(stack.fleet.replicas, 10.0)
    try:
        async with aiohttp.ClientSession() as session:
            status, _, text, elapsed = await stack.post(session)
        assert status == 503, text
        assert "within 2s" in text
        assert HOLD_S * 0.9 <= elapsed < HOLD_S + 1.0
    finally:
        await stack.stop()
