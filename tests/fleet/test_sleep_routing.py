"""The data layer learns which replicas sleep, and no configuration sends a request to one."""

from __future__ import annotations

import time

import aiohttp
import pytest
from aiohttp import web

from epp.config.compose import plugin
from epp.datalayer.promparse import parse_vllm_metrics
from epp.datalayer.registry import EndpointRegistry, EndpointSpec
from epp.datalayer.scraper import MetricsScraper
from epp.framework.errors import InferenceError
from epp.framework.plugin import CycleState
from epp.framework.types import EndpointMetrics, InferenceRequest
from tests.fleet.support import config, spec, start_fleet
from tests.support.pods import start_picker
from tests.support.ports import free_port
from tests.support.wait import wait_until

SLEEP_PAGE = """# TYPE vllm:engine_sleep_state gauge
vllm:engine_sleep_state{{engine="0",model_name="m",sleep_state="awake"}} {awake}
vllm:engine_sleep_state{{engine="0",model_name="m",sleep_state="weights_offloaded"}} {l1}
vllm:engine_sleep_state{{engine="0",model_name="m",sleep_state="discard_all"}} 0
vllm:num_requests_waiting{{engine="0",model_name="m"}} 0
"""


def request_for(model: str, i: int = 0) -> InferenceRequest:
    return InferenceRequest(request_id=f"r{i}", api="completions", model=model, target_model=model,
                            body={"model": model, "prompt": f"question {i}", "max_tokens": 1})


def test_sleep_state_series_reads_awake_asleep_or_absent():
    assert parse_vllm_metrics(SLEEP_PAGE.format(awake=1, l1=0)).sleeping is False
    assert parse_vllm_metrics(SLEEP_PAGE.format(awake=0, l1=1)).sleeping is True
    assert parse_vllm_metrics('vllm:num_requests_waiting{engine="0"} 3\n').sleeping is None


async def test_scraper_sees_a_simulated_replica_fall_asleep_and_wake_within_two_seconds():
    fleet = await start_fleet(1)
    registry = EndpointRegistry()
    registry.set_endpoints([spec(fleet.replicas[0])])
    scraper = MetricsScraper(registry, interval=0.05)
    name = fleet.endpoints[0]
    try:
        await scraper.start()
        await wait_until(lambda: registry.get(name).metrics.update_time > 0, "the first scrape")
        assert registry.get(name).metrics.sleeping is False
        async with aiohttp.ClientSession() as session:
            async with session.post(f"http://{name}/sleep?level=1") as resp:
                assert resp.status == 200
            t0 = time.monotonic()
            await wait_until(lambda: registry.get(name).metrics.sleeping, "the sleep to be seen", timeout=2.0)
            assert time.monotonic() - t0 < 2.0
            async with session.post(f"http://{name}/wake_up") as resp:
                assert resp.status == 200
            await wait_until(lambda: not registry.get(name).metrics.sleeping, "the wake to be seen", timeout=2.0)
    finally:
        await scraper.stop()
        await fleet.stop()


@pytest.mark.slow
async def test_without_the_sleep_series_the_scraper_asks_is_sleeping():
    """A server whose /metrics lacks vllm:engine_sleep_state is asked GET /is_sleeping instead."""
    state = {"sleeping": False, "probes": 0}

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text='vllm:num_requests_waiting{engine="0"} 0\n', content_type="text/plain")

    async def is_sleeping(request: web.Request) -> web.Response:
        state["probes"] += 1
        return web.json_response({"is_sleeping": state["sleeping"]})

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/is_sleeping", is_sleeping)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    registry = EndpointRegistry()
    registry.set_endpoints([EndpointSpec("127.0.0.1", port)])
    scraper = MetricsScraper(registry, interval=0.05, sleep_probe_interval=0.5)
    name = f"127.0.0.1:{port}"
    try:
        await scraper.start()
        await wait_until(lambda: registry.get(name).metrics.update_time > 0, "the first scrape")
        state["sleeping"] = True
        await wait_until(lambda: registry.get(name).metrics.sleeping, "the probe to see the sleep", timeout=2.0)
        # A modest rate: about one probe per 0.5 s, not one per 50 ms scrape.
        probes, t0 = state["probes"], time.monotonic()
        await wait_until(lambda: time.monotonic() - t0 > 1.0, "a second to pass")
        assert state["probes"] - probes <= 3
    finally:
        await scraper.stop()
        await runner.cleanup()


@pytest.mark.parametrize("with_config", [False, True], ids=["gie-default-config", "sleep-wake-config"])
async def test_a_sleeping_simulated_replica_is_never_picked(with_config):
    fleet = await start_fleet(3)
    text = None
    if with_config:  # a config with the policy, wake on demand off: its filter-free profile still never picks it
        text = config(plugin("sleep-wake-policy", wakeOnDemand=False))
    epp = await start_picker(text, [spec(r) for r in fleet.replicas])
    sleeper = fleet.replicas[1]
    try:
        await wait_until(lambda: all(ep.metrics.update_time > 0 for ep in epp.endpoints.snapshot()), "scrapes")
        async with aiohttp.ClientSession() as session:
            async with session.post(f"http://{sleeper.endpoint}/sleep?level=1") as resp:
                assert resp.status == 200
        await wait_until(lambda: epp.endpoints.get(sleeper.endpoint).metrics.sleeping, "the sleep to be seen")
        picked = set()
        for i in range(60):
            result = await epp.director.schedule(CycleState(), request_for("model-a", i))
            picked.add(result.targets[0].name)
        assert sleeper.endpoint not in picked
        assert picked == {fleet.replicas[0].endpoint, fleet.replicas[2].endpoint}
        # Body-less requests take a random endpoint: never the sleeper either.
        assert all(epp.director.random_endpoint().name != sleeper.endpoint for _ in range(60))
        # Everything asleep: a clear 503, not a request parked on a sleeping engine.
        for rep in (fleet.replicas[0], fleet.replicas[2]):
            rep.engine.sleep(1)
        await wait_until(lambda: all(ep.metrics.sleeping for ep in epp.endpoints.snapshot()), "all asleep")
        with pytest.raises(InferenceError) as err:
            await epp.director.schedule(CycleState(), request_for("model-a"))
        assert err.value.code.http_status == 503
    finally:
        await epp.stop(0)
        await fleet.stop()


def test_a_page_fetched_before_a_sleep_call_does_not_wake_the_replica_again():
    registry = EndpointRegistry()
    registry.set_endpoints([EndpointSpec("127.0.0.1", 8000)])
    name = "127.0.0.1:8000"
    registry.expect_sleeping(name, True, for_seconds=30)
    assert registry.get(name).metrics.sleeping
    registry.update(name, metrics=EndpointMetrics(sleeping=False, update_time=1.0))  # the stale page
    assert registry.get(name).metrics.sleeping
    registry.update(name, metrics=EndpointMetrics(sleeping=True, update_time=2.0))  # the replica agrees
    registry.update(name, metrics=EndpointMetrics(sleeping=False, update_time=3.0))  # woken by someone else
    assert not registry.get(name).metrics.sleeping
    # A hold that times out gives way to what the pages say.
    registry.expect_sleeping(name, True, for_seconds=0)
    registry.update(name, metrics=EndpointMetrics(sleeping=False, update_time=4.0))
    assert not registry.get(name).metrics.sleeping
