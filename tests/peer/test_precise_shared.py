"""Precise prefix state is shared by construction: pickers subscribed to the same KV events hold the same index.

What the events cannot show yet (a pick whose prefill has not stored its blocks) travels over
the peer link as a claim.
"""

from __future__ import annotations

import aiohttp
import pytest

from epp.datalayer.registry import EndpointSpec
from epp.engine.sim import FleetConfig, SimFleet
from epp.engine.sim.fleet import default_tokenizer_dir
from epp.netutil import free_ports
from epp.server.runner import EppServer, ServeOptions
from tests.support.configs import plugin, scorer_then_max_score
from tests.support.precise import Picker, fleet_specs, post_completion, prompt_of
from tests.support.wait import wait_until

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
            # Same index, same decisions: each group's next request goes to the replica holding the most
            # of it from either picker (the same one where one holds most; a tie breaks at random).
            names = [spec.name for spec in specs]
            for prompt in groups:
                held = await pickers[0].held_blocks(MODEL, prompt, names)
                assert held == await pickers[1].held_blocks(MODEL, prompt, names)
                best = {ep for ep, blocks in held.items() if blocks == max(held.values())}
                routes = {await pickers[0].route(MODEL, prompt), await pickers[1].route(MODEL, prompt)}
                assert routes <= best and (len(best) > 1 or len(routes) == 1), (held, routes)
        finally:
            for picker in pickers:
                await picker.stop()


async def start_linked_picker(config: str, endpoints: list[EndpointSpec], peer_port: int, peer: int) -> Picker:
    server = EppServer(ServeOptions(
        grpc_port=0, grpc_health_port=0, metrics_port=0, bind_address="127.0.0.1", config_text=config,
        endpoints=endpoints, scrape_metrics=False, grace_period_s=0,
        peer_port=peer_port, peers=[f"127.0.0.1:{peer}"]))
    await server.start()
    return Picker(server)


async def test_a_pick_by_one_linked_picker_is_a_prefix_hit_in_the_other_before_any_kv_event():
    # No replica publishes events here (subscribe: false): all the second picker knows of the
    # first one's picks are the claims that came over the peer link.
    tokenizer_dir = default_tokenizer_dir()
    config = scorer_then_max_score(plugin("precise-prefix-cache-producer", blockSizeTokens=16, subscribe=False,
                                          tokenizers={MODEL: tokenizer_dir}, speculativeTTL="30s"))
    endpoints = [EndpointSpec("127.0.0.1", port) for port in free_ports(4)]
    port_a, port_b = free_ports(2)
    a = await start_linked_picker(config, endpoints, port_a, port_b)
    b = await start_linked_picker(config, endpoints, port_b, port_a)
    try:
        await wait_until(lambda: a.metric("epp_peer_following") == 1 and b.metric("epp_peer_following") == 1,
                         "the pickers to follow each other", 10)
        groups = [prompt_of(tokenizer_dir, seed=60 + g, tokens=4 * 16) for g in range(7)]
        placed = [await a.route(MODEL, prompt) for prompt in groups]
        await wait_until(lambda: b.metric("epp_peer_decisions_received_total", {"kind": "prefix_claimed"}) == 7,
                         "the second picker to receive the first one's claims", 5)
        # Each group goes where the first picker sent it.
        assert [await b.route(MODEL, prompt) for prompt in groups] == placed
        assert b.producer.index.speculative_entries() >= 7 * 4
    finally:
        await a.stop()
        await b.stop()
