"""vLLM's default KV-event topic is "": the picker routes on it per endpoint and says why not centralized.

Simulated replicas publish on topic "" (what `vllm serve --kv-events-config` does unless a topic
is set, and the only topic vllm-router's kv_aware policy subscribes to). In per-endpoint mode
the picker knows the replica from the socket it dialled and the model from its one configured
tokenizer; in centralized mode one bound socket cannot tell the publishers apart, so the
messages are dropped, counted and explained in a warning.
"""

from __future__ import annotations

import logging

import aiohttp
import pytest

from epp.datalayer.registry import EndpointSpec
from epp.engine.sim import FleetConfig, SimFleet
from epp.engine.sim.fleet import default_tokenizer_dir
from epp.netutil import free_ports
from tests.support.configs import plugin, scorer_then_max_score
from tests.support.precise import Picker, fleet_specs, post_completion, prompt_of
from tests.support.wait import wait_until

pytestmark = pytest.mark.timeout(60)

MODEL = "sim-model"



def picker_config(mode: str, bind: str, tokenizer_dir: str) -> str:
    return scorer_then_max_score(plugin("precise-prefix-cache-producer", blockSizeTokens=16, mode=mode,
                                        zmqEndpoint=bind, tokenizers={MODEL: tokenizer_dir}))


async def test_per_endpoint_mode_routes_on_events_published_with_the_empty_topic():
    tokenizer_dir = default_tokenizer_dir()
    config = FleetConfig(replicas=2, model=MODEL, tokenizer_dir=tokenizer_dir, block_size=16, kv_topic="")
    prompt = prompt_of(tokenizer_dir, seed=11, tokens=8 * 16)
    async with SimFleet(config) as fleet:
        assert {d["kv_topic"] for d in fleet.info} == {""}
        picker = await Picker.start(picker_config("per-endpoint", "tcp://127.0.0.1:0", tokenizer_dir), fleet_specs(fleet.info))
        try:
            holder = fleet.endpoints[1]
            async with aiohttp.ClientSession() as session:
                await post_completion(session, holder, MODEL, prompt)

            async def indexed() -> bool:
                return (await picker.held_blocks(MODEL, prompt, fleet.endpoints))[holder] >= 7

            await wait_until(indexed, "the replica's blocks in the picker's index", 10)
            assert (await picker.held_blocks(MODEL, prompt, fleet.endpoints))[fleet.endpoints[0]] == 0
            assert await picker.route(MODEL, prompt) == holder
        finally:
            await picker.stop()


async def test_centralized_mode_drops_empty_topic_events_and_says_why(caplog):
    tokenizer_dir = default_tokenizer_dir()
    [port] = free_ports(1)
    bind = f"tcp://127.0.0.1:{port}"
    config = FleetConfig(replicas=1, model=MODEL, tokenizer_dir=tokenizer_dir, block_size=16, kv_topic="",
                         kv_events_connect=bind, kv_replay=False)
    prompts = [prompt_of(tokenizer_dir, seed=100 + i, tokens=4 * 16) for i in range(100)]
    caplog.set_level(logging.WARNING, logger="epp.kvevents.subscriber")
    async with SimFleet(config) as fleet:
        specs = [EndpointSpec(d["endpoint"].rsplit(":", 1)[0], int(d["endpoint"].rsplit(":", 1)[1]))
                 for d in fleet.info]
        picker = await Picker.start(picker_config("centralized", bind, tokenizer_dir),
                                    specs)
        try:
            async with aiohttp.ClientSession() as session:
                async def unresolved() -> bool:
                    # The PUB connects asynchronously: send new prompts until a batch reaches the bound socket.
                    await post_completion(session, fleet.endpoints[0], MODEL, prompts.pop())
                    return picker.metric("epp_kv_events_unresolved_topics_total") > 0

                await wait_until(unresolved, "an unresolved-topic count", 10)
            assert (await picker.held_blocks(MODEL, prompts[0], fleet.endpoints))[fleet.endpoints[0]] == 0
        finally:
            await picker.stop()
    warnings = [r.getMessage() for r in caplog.records if "does not say which replica" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "kv@<ip:port>@<model>" in warnings[0] and "per-endpoint" in warnings[0]

