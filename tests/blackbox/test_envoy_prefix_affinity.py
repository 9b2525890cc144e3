"""Approximate prefix affinity through the real Envoy: a shared long prefix keeps a group on one endpoint.

Real Envoy (FULL_DUPLEX_STREAMED ext_proc + ORIGINAL_DST) -> the picker on GIE's default config
(queue 2, kv 2, prefix 3, approximate prefix producer) -> 4 echo backends on 127.0.0.1 (distinct
ports) that also serve a stable vLLM `/metrics` page.

Why it is deterministic enough: every backend reports the same load, so a group's first request
is a max-score tie, broken at random; the pick is then recorded in the prefix index (optimistic
insert), and later requests of that group score ~3 x 0.95 on that endpoint against 0 elsewhere.
The requests of one group are sent one after another (two in flight at once could both miss the
index and tie again); the groups run concurrently. All groups landing on one endpoint by chance
has probability 4^-(GROUPS-1).
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter

import aiohttp
import pytest
from aiohttp import web

from epp.datalayer.registry import EndpointSpec
from epp.envoy import EnvoyProcess, render_config
from tests.support.backends import EchoBackend
from tests.support.pods import start_picker
from tests.support.ports import free_port
from tests.support.vllm_metrics import VllmState, vllm_metrics_page
from tests.support.wait import wait_until

pytestmark = pytest.mark.envoy

GROUPS = 10
REQUESTS_PER_GROUP = 8
PREFIX_CHARS = 6 * 1024
WORDS = ("alpha", "beta", "gamma", "delta", "kernel", "token", "cache", "route", "model", "block", "prefix",
         "system", "prompt", "answer", "policy")


class MetricsEchoBackend(EchoBackend):
    """An echo backend that also serves a fixed vLLM `/metrics` page (the same load on every backend)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.page = vllm_metrics_page(VllmState(waiting=0, running=1, kv_usage=0.1, block_size=16,
                                                num_gpu_blocks=100_000))

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=self.page, content_type="text/plain")

    async def start(self) -> None:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/{tail:.*}", self.handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()


def group_prefix(group: int) -> str:
    """A long system prompt of its own for each group (several KB, seeded so runs are alike)."""
    rng = random.Random(group)
    words: list[str] = [f"group {group} instructions:"]
    while sum(len(w) + 1 for w in words) < PREFIX_CHARS:
        words.append(rng.choice(WORDS))
    return " ".join(words)


async def send_group(session: aiohttp.ClientSession, url: str, group: int) -> list[str]:
    """The group's requests, one after another; returns the backend that served each."""
    prefix = group_prefix(group)
    served = []
    for i in range(REQUESTS_PER_GROUP):
        prompt = f"{prefix}\nQuestion {i}: what is {i} times {group}? Explain step {i * 7 % 5} briefly."
        async with session.post(url, json={"model": "m", "prompt": prompt, "max_tokens": 1}) as resp:
            assert resp.status == 200, await resp.text()
            served.append(resp.headers["x-backend"])
    return served


async def test_prefix_groups_stick_to_one_endpoint_and_spread_over_the_pool():
    backends = [MetricsEchoBackend(f"b{i}") for i in range(4)]
    for b in backends:
        await b.start()
    epp = envoy = None
    try:
        # No config: GIE's system defaults.
        epp = await start_picker(None, [EndpointSpec("127.0.0.1", b.port) for b in backends])
        await wait_until(lambda: all(ep.metrics.cache_block_size == 16 for ep in epp.endpoints.snapshot()),
                         "every backend's /metrics to be scraped")
        listen, admin = free_port(), free_port()
        envoy = EnvoyProcess(render_config(listen_port=listen, admin_port=admin, epp_port=epp.grpc_port), admin)
        await envoy.start()
        url = f"http://127.0.0.1:{listen}/v1/completions"
        async with aiohttp.ClientSession() as session:
            served = await asyncio.wait_for(
                asyncio.gather(*(send_group(session, url, g) for g in range(GROUPS))), timeout=30)
    finally:
        if envoy is not None:
            await envoy.stop()
        if epp is not None:
            await epp.stop(0)
        for b in backends:
            await b.stop()

    majority = []
    for group, names in enumerate(served):
        name, count = Counter(names).most_common(1)[0]
        assert count >= 0.9 * REQUESTS_PER_GROUP, f"group {group} was spread over {Counter(names)}"
        majority.append(name)
    assert len(set(majority)) >= 2, f"every group went to {majority[0]}"
    # What the backends saw matches what the picker chose.
    for b in backends:
        assert all(r["headers"]["x-gateway-destination-endpoint"] == b.hostport for r in b.received)
    assert sum(len(b.received) for b in backends) == GROUPS * REQUESTS_PER_GROUP
