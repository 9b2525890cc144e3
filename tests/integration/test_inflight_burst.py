"""A burst within one scrape interval, through real Envoy, the real picker and simulated vLLM replicas.

Three of four replicas hold a long request that keeps about half their KV cache busy; the
fourth is empty. The picker runs GIE's default pipeline (queue 2, kv-cache 2, approximate
prefix 3) and stops scraping once it has seen the busy replicas, so the burst lands within one
scrape interval however slowly the machine runs. Eight unique prompts then arrive at once. From the scrape
alone the empty replica is the best choice for all eight (no queue anywhere, least KV in use),
so scrape-only scoring (`useInflight: false`, GIE's behaviour) piles the burst onto it; with
the picker's own in-flight accounting each pick counts on its replica at once and the burst
spreads over the fleet.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from epp.config.compose import DEFAULT_SCORER_WEIGHTS
from epp.datalayer.registry import parse_endpoint_list
from epp.engine.sim import FleetConfig, SimFleet
from epp.engine.sim.fleet import default_tokenizer_dir
from epp.envoy import EnvoyProcess, render_config
from tests.support.configs import endpoint_picker_config, plugin
from tests.support.pods import start_picker
from tests.support.ports import free_port
from tests.support.precise import prompt_of
from tests.support.wait import wait_until

pytestmark = [pytest.mark.envoy, pytest.mark.timeout(90)]

MODEL = "sim-model"
BURST = 8


def picker_config(use_inflight: bool) -> str:
    """GIE's default weights (queue 2, kv 2, prefix 3) with the load scorers reading the ledger or not."""
    load = {"useInflight": use_inflight}
    return endpoint_picker_config(
        [plugin("queue-scorer", **load), plugin("kv-cache-utilization-scorer", **load), "prefix-cache-scorer",
         "max-score-picker"],
        {**DEFAULT_SCORER_WEIGHTS, "max-score-picker": None})


async def served_requests(http: aiohttp.ClientSession, endpoint: str) -> float:
    async with http.get(f"http://{endpoint}/metrics") as resp:
        text = await resp.text()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "vllm:request_success_total")


async def stream_completion(http: aiohttp.ClientSession, url: str, prompt: str) -> None:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "stream": True}
    async with http.post(url, json=body) as resp:
        assert resp.status == 200, await resp.text()
        await resp.read()


async def burst_spread(use_inflight: bool, seed: int) -> list[int]:
    """Requests of the burst each replica served, the empty replica first."""
    tokenizer_dir = default_tokenizer_dir()
    # fast*100: 0.2 ms of prefill per token, so each 1,000-token prompt is in prefill for ~0.2 s.
    fleet_config = FleetConfig(replicas=4, model=MODEL, tokenizer_dir=tokenizer_dir, profile="fast*100",
                               num_gpu_blocks=1024, block_size=16, kv_events=False)
    background: list[asyncio.Task] = []
    epp = envoy = None
    async with SimFleet(fleet_config) as fleet, aiohttp.ClientSession() as http:
        empty, *busy = fleet.endpoints
        try:
            for i, endpoint in enumerate(busy):  # ~440 of 1,024 blocks each, decoding for tens of seconds
                body = {"model": MODEL, "prompt": prompt_of(tokenizer_dir, seed=900 + i, tokens=7000),
                        "max_tokens": 900}
                background.append(asyncio.create_task(http.post(f"http://{endpoint}/v1/completions", json=body)))
            epp = await start_picker(picker_config(use_inflight),
                                     parse_endpoint_list(",".join(fleet.endpoints)))
            await wait_until(lambda: all(ep.metrics.kv_cache_usage > 0.3 for ep in epp.endpoints.snapshot()
                                         if ep.name in busy), "the busy replicas' KV use to be scraped", 20)
            # The burst must land within one scrape interval; on a loaded machine eight picks through
            # Envoy can take longer than 50 ms, so the signals are frozen at this scrape instead.
            await epp.scraper.stop()
            listen, admin = free_port(), free_port()
            envoy = EnvoyProcess(render_config(listen_port=listen, admin_port=admin, epp_port=epp.grpc_port),
                                 admin)
            await envoy.start()
            before = [await served_requests(http, e) for e in fleet.endpoints]
            url = f"http://127.0.0.1:{listen}/v1/completions"
            prompts = [prompt_of(tokenizer_dir, seed=seed * 100 + i, tokens=1000) for i in range(BURST)]
            await asyncio.wait_for(asyncio.gather(*(stream_completion(http, url, p) for p in prompts)), 40)
            after = [await served_requests(http, e) for e in fleet.endpoints]
        finally:
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
            if envoy is not None:
                await envoy.stop()
            if epp is not None:
                await epp.stop(0)
    return [int(a - b) for a, b in zip(after, before)]


async def test_a_burst_spreads_over_the_fleet_with_in_flight_accounting():
    spread = await burst_spread(True, seed=1)
    assert sum(spread) == BURST
    assert max(spread) <= 3, f"the burst piled up: {spread}"
    assert min(spread) >= 1, f"a replica got none: {spread}"


async def test_scrape_only_scoring_piles_the_burst_onto_the_replica_that_looked_idle():
    spread = await burst_spread(False, seed=2)
    assert sum(spread) == BURST
    assert spread[0] >= BURST - 1, f"expected a pile-up on the empty replica: {spread}"
