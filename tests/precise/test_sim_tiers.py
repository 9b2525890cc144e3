"""Tier weights decide between a long prefix in an offload tier and a shorter one in GPU memory.

Two simulated replicas (vLLM's KV-event wire format, GPU pool of 32 blocks of 16 tokens, plus a
CPU or a disk tier that every computed block is copied to). Replica X computes a long prefix,
then enough other prompts that the prefix leaves its GPU pool but stays in the offload tier;
replica Y computes the first half of the same prefix and keeps it in GPU. Two pickers, started
afterwards (their view comes from replay), differ only in the offload tier's weight.
"""

from __future__ import annotations

import aiohttp
import pytest

from epp.engine.sim import FleetConfig, SimFleet
from epp.engine.sim.fleet import default_tokenizer_dir
from epp.kvevents.decoding import Tier
from tests.support.configs import endpoint_picker_config, plugin
from tests.support.precise import Picker, fleet_specs, post_completion, prompt_of
from tests.support.wait import wait_until

pytestmark = pytest.mark.timeout(60)

MODEL = "sim-model"
BLOCK = 16
GPU_BLOCKS = 32
QUESTION = " Now answer the question about that document in one word."

def picker_config(tokenizer_dir: str, tier: str, weight: float) -> str:
    """Prefix routing from KV events, an offload tier's blocks counting `weight` of a GPU block."""
    return endpoint_picker_config(
        [plugin("precise-prefix-cache-producer", blockSizeTokens=BLOCK, tokenizers={MODEL: tokenizer_dir},
                tierWeights={"gpu": 1.0, tier: weight}),
         "prefix-cache-scorer", "max-score-picker"],
        ["prefix-cache-scorer", "max-score-picker"])


@pytest.mark.parametrize("tier", ["cpu", "disk"])
async def test_offload_tier_weight_decides_between_long_offloaded_and_short_gpu_prefixes(tier):
    tokenizer_dir = default_tokenizer_dir()
    offloaded = Tier.CPU if tier == "cpu" else Tier.DISK
    config = FleetConfig(replicas=2, model=MODEL, tokenizer_dir=tokenizer_dir, block_size=BLOCK,
                         num_gpu_blocks=GPU_BLOCKS, cpu_blocks=256 if tier == "cpu" else 0,
                         disk_blocks=256 if tier == "disk" else 0)
    prefix = prompt_of(tokenizer_dir, seed=7, tokens=8 * BLOCK)
    words = prefix.split()
    half = " ".join(words[: len(words) // 2])
    request = prefix + QUESTION

    async with SimFleet(config) as fleet, aiohttp.ClientSession() as http:
        x, y = fleet.endpoints
        await post_completion(http, x, MODEL, prefix)
        for seed in (100, 101, 102):  # 24+ blocks each: the prefix leaves X's 32-block GPU pool
            await post_completion(http, x, MODEL, prompt_of(tokenizer_dir, seed=seed, tokens=24 * BLOCK))
        await post_completion(http, y, MODEL, half)

        pickers = {weight: await Picker.start(picker_config(tokenizer_dir, tier, weight), fleet_specs(fleet.info))
                   for weight in (0.8, 0.1)}
        try:
            for picker in pickers.values():
                async def view_complete(picker=picker) -> bool:
                    held = await picker.held_tiers(MODEL, request, [x, y])
                    return (len(held[x]) >= 8 and set(held[x]) == {offloaded}
                            and len(held[y]) >= 2 and set(held[y]) == {Tier.GPU})
                await wait_until(view_complete, f"the picker to replay X's {tier} blocks and Y's GPU blocks", 10)

            held = await pickers[0.8].held_tiers(MODEL, request, [x, y])
            long_offloaded, short_gpu = len(held[x]), len(held[y])
            assert long_offloaded * 0.8 > short_gpu > long_offloaded * 0.1  # the weights make the difference
            assert await pickers[0.8].route(MODEL, request) == x
            assert await pickers[0.1].route(MODEL, request) == y
        finally:
            for picker in pickers.values():
                await picker.stop()
