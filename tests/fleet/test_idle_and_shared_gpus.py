"""Idle replicas go to sleep (never the last awake one of a model unless configured), and two models
sharing GPUs take turns: waking model B on a GPU first puts that GPU's idle model-A replica to sleep."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest

from epp.config.compose import plugin
from epp.datalayer.registry import EndpointRegistry, EndpointSpec
from epp.envoy import EnvoyProcess, render_config
from epp.fleet.sleepwake import SleepWakePolicy
from epp.framework import PluginParams
from epp.framework.plugin import CycleState, PluginContext, ProfileRunResult, SchedulingResult
from epp.framework.types import ResponseInfo
from tests.fleet.support import config, spec, start_fleet
from tests.fleet.test_sleep_routing import request_for
from tests.support.pods import start_picker
from tests.support.ports import free_port
from tests.support.wait import wait_until


def policy_of(epp) -> SleepWakePolicy:
    return epp.director.pipeline.plugins_of(SleepWakePolicy)[0]


def idle_config(sleep_last: bool) -> str:
    return config(plugin("sleep-wake-policy", idleSleepSeconds=0.4, minIdleSeconds=0.2, idleCheckSeconds=0.05,
                         sleepLastReplica=sleep_last))


@pytest.mark.parametrize("sleep_last", [False, True])
async def test_idle_replicas_sleep_but_the_last_awake_one_only_when_configured(sleep_last):
    fleet = await start_fleet(3)
    epp = await start_picker(idle_config(sleep_last), [spec(r) for r in fleet.replicas])
    try:
        want_awake = 0 if sleep_last else 1
        await wait_until(lambda: sum(not r.engine.sleeping for r in fleet.replicas) == want_awake,
                         f"{want_awake} replica(s) left awake", timeout=5.0)
        # Give the policy more rounds: the count stays there.
        await asyncio.sleep(0.6)
        assert sum(not r.engine.sleeping for r in fleet.replicas) == want_awake
        assert all(ep.metrics.sleeping == (not any(r.endpoint == ep.name and not r.engine.sleeping
                                                   for r in fleet.replicas))
                   for ep in epp.endpoints.snapshot())
    finally:
        await epp.stop(0)
        await fleet.stop()


async def test_a_replica_with_requests_in_flight_is_not_put_to_sleep():
    fleet = await start_fleet(2)
    epp = await start_picker(idle_config(True), [spec(r) for r in fleet.replicas])
    policy = policy_of(epp)
    try:
        await wait_until(lambda: all(ep.metrics.update_time > 0 for ep in epp.endpoints.snapshot()), "scrapes")
        held = epp.endpoints.get(fleet.replicas[0].endpoint)
        # The picker sent a request there that has not finished yet.
        policy.pre_request(CycleState(), request_for("model-a"),
                           SchedulingResult({"default": ProfileRunResult((held,))}, "default"))
        await wait_until(lambda: fleet.replicas[1].engine.sleeping, "the idle replica to sleep", timeout=5.0)
        await asyncio.sleep(0.6)
        assert not fleet.replicas[0].engine.sleeping
    finally:
        await epp.stop(0)
        await fleet.stop()


SHARED_CONFIG = Path(__file__).resolve().parents[2] / "examples" / "fleet" / "shared-gpus.yaml"


@pytest.mark.envoy
async def test_two_models_sharing_gpus_take_turns():
    """GPU g0 and g1 each hold a model-a and a model-b replica; only one per GPU is awake."""
    fleet_a = await start_fleet(2, model="model-a", name_prefix="a")
    fleet_b = await start_fleet(2, model="model-b", name_prefix="b")
    for rep in fleet_b.replicas:
        rep.engine.sleep(1)
    specs = [spec(r, gpu=f"g{i}") for i, r in enumerate(fleet_a.replicas)]
    specs += [spec(r, gpu=f"g{i}") for i, r in enumerate(fleet_b.replicas)]
    epp = await start_picker(SHARED_CONFIG.read_text(), specs)  # the documented example config, as shipped
    try:
        await wait_until(lambda: sum(ep.metrics.sleeping for ep in epp.endpoints.snapshot()) == 2, "b asleep")
        async with aiohttp.ClientSession() as session:
            listen, admin = free_port(), free_port()
            envoy = EnvoyProcess(render_config(listen_port=listen, admin_port=admin, epp_port=epp.grpc_port), admin)
            await envoy.start()
            url = f"http://127.0.0.1:{listen}/v1/completions"
            try:
                async def post(model: str) -> tuple[int, str]:
                    async with session.post(url, json={"model": model, "prompt": "hi", "max_tokens": 1}) as resp:
                        await resp.read()
                        return resp.status, resp.headers.get("x-sim-replica", "")

                # model-a is served by the awake a replicas, never by b replicas.
                status, replica = await post("model-a")
                assert status == 200 and replica.startswith("a-")
                # model-b has nothing awake: one b replica wakes, its GPU's a replica goes to sleep first.
                status, replica = await post("model-b")
                assert status == 200 and replica.startswith("b-")
                gpu = replica.split("-")[1]
                assert fleet_a.replicas[int(gpu)].engine.sleeping
                assert not fleet_b.replicas[int(gpu)].engine.sleeping
                # The other GPU's a replica is the last awake one of model-a: it is never evicted.
                other = 1 - int(gpu)
                assert not fleet_a.replicas[other].engine.sleeping
                assert fleet_b.replicas[other].engine.sleeping
                # One awake replica per GPU, always.
                for g in (0, 1):
                    assert (not fleet_a.replicas[g].engine.sleeping) + (not fleet_b.replicas[g].engine.sleeping) == 1
                status, replica = await post("model-a")
                assert status == 200 and replica == f"a-{other}"
            finally:
                await envoy.stop()
    finally:
        await epp.stop(0)
        await fleet_a.stop()
        await fleet_b.stop()


def test_a_replica_that_just_finished_or_woke_is_not_idle_yet():
    """Requests held for a wake reach the woken replica just after it: another model's wake must not take it."""
    registry = EndpointRegistry()
    registry.set_endpoints([EndpointSpec("127.0.0.1", 8000, {"model": "m", "gpu": "g0"})])
    [ep] = registry.snapshot()
    policy = SleepWakePolicy("p", PluginParams("p", {"minIdleSeconds": 30}), PluginContext(None, registry))
    assert policy.idle(ep)  # never used
    policy.on_response_complete(CycleState(), request_for("m"), ResponseInfo(), ep)
    assert not policy.idle(ep) and not policy.working(ep)


async def test_gpu_mates_chosen_for_eviction_stop_taking_requests_at_once():
    """Between the choice and its /sleep call no request may reach the mate; a failed call gives it back."""
    port = free_port()  # nothing listens: the /sleep call fails
    registry = EndpointRegistry()
    registry.set_endpoints([EndpointSpec("127.0.0.1", port, {"model": "a", "gpu": "g0"}),
                            EndpointSpec("127.0.0.2", port, {"model": "b", "gpu": "g0"}),
                            EndpointSpec("127.0.0.3", port, {"model": "a", "gpu": "g1"})])
    registry.expect_sleeping(f"127.0.0.2:{port}", True, 0.0)
    policy = SleepWakePolicy("p", PluginParams("p", {"gpuLabel": "gpu", "minIdleSeconds": 0}),
                             PluginContext(None, registry))
    await policy.start()
    try:
        task = policy._start_wake("b", request_for("b"), first=True)
        assert task is not None
        assert registry.get(f"127.0.0.1:{port}").metrics.sleeping  # marked in the same step as the choice
        with pytest.raises(Exception, match="could not free the GPU"):
            await task
        assert not registry.get(f"127.0.0.1:{port}").metrics.sleeping
    finally:
        await policy.stop()
