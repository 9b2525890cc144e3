"""Simulator P/D roles: the prefill leg returns transfer parameters and holds its blocks; the decode
leg loads the KV (at the modelled bandwidth), publishes it, and frees the prefiller's blocks."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from epp.engine.sim.fleet import FleetConfig, SimFleet
from epp.engine.sim.pd import ROLE_LABEL

PROMPT = "the quick brown fox jumps over the lazy dog " * 40


async def post(session, endpoint, body, path="/v1/completions"):
    async with session.post(f"http://{endpoint}{path}", json=body) as resp:
        return resp.status, await resp.json()


async def state(session, endpoint):
    async with session.get(f"http://{endpoint}/sim/state") as resp:
        return (await resp.json())["pd"]


def prefill_leg(prompt=PROMPT):
    return {"model": "sim-model", "prompt": prompt, "max_tokens": 1, "stream": False,
            "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}}


@pytest.fixture
async def pd_fleet(tokenizer_dir):
    config = FleetConfig(replicas=2, roles=["prefill", "decode"], tokenizer_dir=tokenizer_dir,
                         kv_transfer_window=0.5)
    async with SimFleet(config) as fleet, aiohttp.ClientSession() as session:
        yield fleet, session


async def test_prefill_then_decode_moves_the_kv(pd_fleet, subscriber_factory):
    fleet, session = pd_fleet
    prefiller, decoder = fleet.replicas
    assert prefiller.config.labels[ROLE_LABEL] == "prefill" and decoder.pd.role == "decode"
    events = subscriber_factory(decoder.publisher.bound_endpoint)
    await events.ready()

    status, first = await post(session, prefiller.endpoint, prefill_leg())
    assert status == 200
    params = first["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_host"] == "127.0.0.1" and params["remote_port"] == prefiller.port
    assert params["remote_engine_id"] == prefiller.config.name and params["tp_size"] == 1
    prompt_tokens = first["usage"]["prompt_tokens"]
    assert len(params["remote_block_ids"]) == prompt_tokens // 16  # the full prompt blocks
    assert (await state(session, prefiller.endpoint))["held_transfers"] == 1

    body = {"model": "sim-model", "prompt": PROMPT, "max_tokens": 8, "kv_transfer_params": params}
    status, second = await post(session, decoder.endpoint, body)
    assert status == 200 and second["usage"]["completion_tokens"] == 8
    assert second["kv_transfer_params"] is None
    decoded = await state(session, decoder.endpoint)
    assert decoded["decode_legs"] == 1 and decoded["load_failures"] == 0
    assert decoded["remote_tokens"] == prompt_tokens - 1  # the last prompt token is computed locally
    held = await state(session, prefiller.endpoint)
    assert held["held_transfers"] == 0 and held["transfers_pulled"] == 1 and held["prefill_legs"] == 1
    # The decoder published the received blocks: the picker's index will see them in the decode pool.
    await events.drain()
    stored = [ev for ev in events.events() if ev.get("type") == "BlockStored" or ev[0] == "BlockStored"]
    assert sum(len(ev["block_hashes"] if isinstance(ev, dict) else ev[1]) for ev in stored) >= prompt_tokens // 16

    async with session.get(f"http://{decoder.endpoint}/metrics") as resp:
        text = await resp.text()
    assert 'sim:pd_decode_legs_total{role="decode"} 1.0' in text


async def test_transfer_time_follows_the_profile_bandwidth(pd_fleet):
    fleet, session = pd_fleet
    prefiller, decoder = fleet.replicas
    profile = decoder.engine.profile
    _, first = await post(session, prefiller.endpoint, prefill_leg())
    n = first["usage"]["prompt_tokens"] - 1
    body = {"model": "sim-model", "prompt": PROMPT, "max_tokens": 1, "kv_transfer_params": first["kv_transfer_params"]}
    await post(session, decoder.endpoint, body)
    decoded = await state(session, decoder.endpoint)
    assert decoded["transfer_seconds"] == pytest.approx(profile.kv_transfer_base + n * profile.kv_transfer_per_token)

    # Blocks the decoder already holds are not transferred again.
    _, again = await post(session, prefiller.endpoint, prefill_leg())
    body["kv_transfer_params"] = again["kv_transfer_params"]
    await post(session, decoder.endpoint, body)
    assert (await state(session, decoder.endpoint))["remote_tokens"] == n + (n % 16)


async def test_blocks_are_freed_after_the_window_and_a_late_decode_recomputes(pd_fleet):
    fleet, session = pd_fleet
    prefiller, decoder = fleet.replicas
    _, first = await post(session, prefiller.endpoint, prefill_leg())
    used = prefiller.engine.cache.used_blocks
    assert used > 0
    deadline = time.monotonic() + 3
    while (await state(session, prefiller.endpoint))["held_transfers"] and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert (await state(session, prefiller.endpoint))["held_transfers"] == 0
    assert prefiller.engine.cache.used_blocks == 0  # freed (still cached for prefix hits)
    body = {"model": "sim-model", "prompt": PROMPT, "max_tokens": 4, "kv_transfer_params": first["kv_transfer_params"]}
    status, late = await post(session, decoder.endpoint, body)
    assert status == 200 and late["usage"]["completion_tokens"] == 4
    decoded = await state(session, decoder.endpoint)
    assert decoded["load_failures"] == 1 and decoded["decode_legs"] == 0


@pytest.mark.parametrize("params, message", [
    ("yes", "must be an object"),
    ({"do_remote_prefill": True, "remote_host": "127.0.0.1"}, "needs remote_port, remote_request_id"),
])
async def test_malformed_transfer_parameters_are_a_400(pd_fleet, params, message):
    fleet, session = pd_fleet
    status, body = await post(session, fleet.replicas[1].endpoint,
                              {"model": "sim-model", "prompt": "hi", "kv_transfer_params": params})
    assert status == 400 and message in body["error"]["message"]
