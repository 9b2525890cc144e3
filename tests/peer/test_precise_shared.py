"""Precise prefix state is shared by construction: pickers subscribed to the same KV events hold the same index."""

from __future__ import annotations

import aiohttp
import pytest

from epp.engine.sim import FleetConfig, SimFleet
from epp.engine.sim.fleet import default_tokenizer_dir
from tests.configs import plugin, scorer_then_max_score
from tests.precise.support import Picker, fleet_specs, post_completion, prompt_of, wait_until

pytestmark = pytest.mark.timeout(120)

MODEL = "sim-model"


def picker_config(tokenizer_dir: str) -> str:
    return scorer_then_max_score(plugin("precise-prefix-cache-producer", blockSizeTokens=16, mode="per-endpoint",
                                        tokenizers={MODEL: tokenizer_dir}))


async def test_two_pickers_fed_the_same_traffic_hold_the_same_precise_index_and_route_alike():
    tokenizer_dir = default_tokenizer_dir()
    config = FleetConfig(replicas=3, model=MODEL, tokenizer_dir=tokenizer_dir, block_size=16)
    groups = [prompt_of(tokenizer_dir, seed=40 + g, tokens=6 * 16) for g in range(5)]
    async with SimFleet(config) as fleet:
        specs = fleet_specs(fleet.info)
        pickers = [await Picker.start(picker_config(tokenizer_dir), specs) for _ in range(2)]
        try:
            async with aiohttp.ClientSession() as session:
                # Requests alternate between the pickers; each goes where its picker said.
                for i in range(20):
                    picker = pickers[i % 2]
                    prompt = f"{groups[i % len(groups)]} question {i}"
                    await post_completion(session, await picker.route(MODEL, prompt), MODEL, prompt)

            def same_and_full() -> bool:
                first, second = (p.producer.index.contents() for p in pickers)
                return len(first) > 0 and first == second

            await wait_until(same_and_full, "both pickers' indexes to hold the same keys, endpoints and tiers", 10)
            # Same index, same decisions: each group's next request goes to the same replica from either picker.
            for prompt in groups:
                assert await pickers[0].route(MODEL, prompt) == await pickers[1].route(MODEL, prompt)
        finally:
            for picker in pickers:
                await picker.stop()
