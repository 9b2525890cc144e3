"""predicted-ttft-scorer through the real picker: queue wait against recompute, from scraped metrics.

Two simulated replicas serve one sequence at a time (max_num_seqs=1, a slowed profile so that a
queue lasts). X holds the request's prefix in GPU memory; Y holds nothing. The picker scrapes
their `/metrics` (waiting and running requests) and learns X's blocks from KV events. Two pickers
differ only in the calibrated prefill cost per token:
- both idle: X wins in both (nothing queued, fewer tokens to compute);
- X has a queue: with cheap prefill, recomputing on idle Y is faster; with expensive prefill,
  waiting in X's queue still beats recomputing the prefix.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from epp.engine.sim import FleetConfig, SimFleet
from epp.engine.sim.fleet import default_tokenizer_dir
from epp.framework.types import InferenceRequest
from epp.kvevents.decoding import Tier
from tests.support.configs import endpoint_picker_config, plugin
from tests.support.precise import Picker, fleet_specs, post_completion, prompt_of
from tests.support.requests import format_of
from tests.support.wait import wait_until

pytestmark = pytest.mark.timeout(60)

MODEL = "sim-model"
BLOCK = 16
QUESTION = " Now answer the question about that document in one word."
BASE_S, QUEUE_S, RUNNING_S = 0.01, 0.1, 0.005
CHEAP_PREFILL_S, EXPENSIVE_PREFILL_S = 2e-4, 1e-2


def picker_config(tokenizer_dir: str, prefill_s: float) -> str:
    """Precise producer and the predicted-TTFT scorer alone (these costs, `prefill_s` a token), max-score picker."""
    return endpoint_picker_config(
        [plugin("precise-prefix-cache-producer", blockSizeTokens=BLOCK, tokenizers={MODEL: tokenizer_dir}),
         plugin("predicted-ttft-scorer", prefillSecondsPerToken=prefill_s, queueSecondsPerWaitingRequest=QUEUE_S,
                secondsPerRunningRequest=RUNNING_S, baseSeconds=BASE_S),
         "max-score-picker"],
        ["predicted-ttft-scorer", "max-score-picker"])


async def predicted_ttft(picker: Picker, prefill_s: float, request: str, endpoints: list[str]) -> dict[str, float]:
    """The documented formula, from the picker's scraped metrics and index (GPU-only blocks here)."""
    tokens = await picker.producer.prompt_tokens(
        InferenceRequest("probe", "completions", MODEL, MODEL, {"prompt": request}, format=format_of("completions")))
    held = await picker.held_tiers(MODEL, request, endpoints)
    out = {}
    for name in endpoints:
        assert set(held[name]) <= {Tier.GPU}
        metrics = picker.server.endpoints.get(name).metrics
        uncached = len(tokens) - len(held[name]) * BLOCK
        out[name] = (BASE_S + metrics.waiting_queue_size * QUEUE_S + metrics.running_requests_size * RUNNING_S
                     + uncached * prefill_s)
    return out


async def test_lowest_predicted_ttft_wins_queue_against_recompute():
    tokenizer_dir = default_tokenizer_dir()
    config = FleetConfig(replicas=2, model=MODEL, tokenizer_dir=tokenizer_dir, block_size=BLOCK,
                         profile="fast*200", max_num_seqs=1)
    prefix = prompt_of(tokenizer_dir, seed=11, tokens=8 * BLOCK)
    request = prefix + QUESTION
    busy: list[asyncio.Task] = []

    async with SimFleet(config) as fleet, aiohttp.ClientSession() as http:
        x, y = fleet.endpoints
        await post_completion(http, x, MODEL, prefix)
        pickers = {prefill: await Picker.start(picker_config(str(tokenizer_dir), prefill),
                                               fleet_specs(fleet.info))
                   for prefill in (CHEAP_PREFILL_S, EXPENSIVE_PREFILL_S)}
        try:
            for picker in pickers.values():
                await wait_until(lambda picker=picker: _scraped(picker, x, waiting=0, running=0)
                                 and _scraped(picker, y, waiting=0, running=0), "the first scrape", 10)
                await wait_until(lambda picker=picker: _holds(picker, request, x, 8), "X's blocks in the index", 10)

            # Idle fleet: X holds the prefix, so X is predicted fastest whatever prefill costs.
            for prefill, picker in pickers.items():
                predicted = await predicted_ttft(picker, prefill, request, [x, y])
                assert predicted[x] < predicted[y]
                assert await picker.route(MODEL, request) == x

            # X gets one running and three waiting requests (each decodes for ~20 s of wall time).
            for seed in range(4):
                busy.append(asyncio.create_task(post_completion(
                    http, x, MODEL, prompt_of(tokenizer_dir, seed=200 + seed, tokens=BLOCK), max_tokens=200)))
            for picker in pickers.values():
                await wait_until(lambda picker=picker: _scraped(picker, x, waiting=3, running=1),
                                 "the picker to scrape X's queue", 10)

            cheap = await predicted_ttft(pickers[CHEAP_PREFILL_S], CHEAP_PREFILL_S, request, [x, y])
            assert cheap[y] < cheap[x]  # recomputing ~140 tokens costs less than 3 queued requests
            assert await pickers[CHEAP_PREFILL_S].route(MODEL, request) == y
            expensive = await predicted_ttft(pickers[EXPENSIVE_PREFILL_S], EXPENSIVE_PREFILL_S, request, [x, y])
            assert expensive[x] < expensive[y]  # recomputing the prefix costs more than the queue
            assert await pickers[EXPENSIVE_PREFILL_S].route(MODEL, request) == x
        finally:
            for task in busy:
                task.cancel()
            await asyncio.gather(*busy, return_exceptions=True)
            for picker in pickers.values():
                await picker.stop()


def _scraped(picker: Picker, name: str, *, waiting: int, running: int) -> bool:
    endpoint = picker.server.endpoints.get(name)
    return (endpoint is not None and endpoint.metrics.update_time > 0
            and endpoint.metrics.waiting_queue_size == waiting and endpoint.metrics.running_requests_size == running)


async def _holds(picker: Picker, request: str, name: str, blocks: int) -> bool:
    return (await picker.held_blocks(MODEL, request, [name]))[name] >= blocks
