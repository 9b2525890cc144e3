"""P/D disaggregation end to end: real Envoy -> the picker (examples/configs/pd.yaml) -> the decode
pod's sidecar -> simulated prefill and decode replicas speaking vLLM's kv_transfer_params.

The pool: prefill replica P (label llm-d.ai/role=prefill) and decode pod S (role decode), whose
port is the sidecar's, in front of simulated replica D. A long prompt is prefilled on P and
decoded on D; a short one stays on D; a failing prefill leg falls back to D; a decode leg error
is answered clearly.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from epp.config.compose import plugin
from epp.datalayer.registry import EndpointSpec
from epp.engine.pd_sidecar import FALLBACK_HEADER, USED_PREFILLER_HEADER, PDSidecar, SidecarConfig
from epp.engine.sim.fleet import FleetConfig, SimFleet, default_tokenizer_dir
from epp.engine.sim.server import REPLICA_HEADER
from epp.envoy import EnvoyProcess, render_config
from epp.framework import PREFILLER_HOST_PORT_HEADER
from tests.support.backends import EchoBackend
from tests.support.configs import pd_config
from tests.support.pods import start_picker
from tests.support.ports import free_port
from tests.support.vllm_metrics import VllmState, vllm_metrics_page
from tests.support.wait import wait_until

pytestmark = pytest.mark.envoy

ROLE = "llm-d.ai/role"
CONFIG = pd_config(threshold=64)
LONG = "Summarise the following report about caching in inference servers. " * 30   # ~500 tokens by estimate
OTHER_LONG = "Translate this memo about scheduling of GPU batches into French. " * 30
SHORT = "hi there"


class PrefillerWithoutConnector(EchoBackend):
    """A replica labelled prefill whose vLLM has no KV connector: 200, but no kv_transfer_params."""

    def __init__(self) -> None:
        super().__init__("no-connector")
        self.bodies: list[dict] = []
        self.page = vllm_metrics_page(VllmState(block_size=16, num_gpu_blocks=1000))

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/{tail:.*}", self.handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=self.page, content_type="text/plain")

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.bodies.append(await request.json())
        return await super().handle(request)


@dataclass
class Stack:
    url: str
    fleet: SimFleet
    sidecar: PDSidecar
    closers: list = field(default_factory=list)
    epp: Any = None

    @property
    def prefiller(self):
        return self.fleet.replicas[0]

    @property
    def decoder(self):
        return self.fleet.replicas[1]


@pytest.fixture
async def start_stack():
    """Start sims, the sidecar, the picker and Envoy; `prefill` replaces P in the pool when given."""
    stacks: list[Stack] = []

    async def start(prefill: EndpointSpec | None = None, config: str = CONFIG) -> Stack:
        fleet = SimFleet(FleetConfig(replicas=2, roles=["prefill", "decode"], tokenizer_dir=default_tokenizer_dir(),
                                     kv_transfer_window=5.0))
        await fleet.start()
        stack = Stack("", fleet, PDSidecar(SidecarConfig(host="127.0.0.1", port=0,
                                                         vllm_port=fleet.replicas[1].port)))
        stacks.append(stack)
        stack.closers.append(fleet.stop)
        await stack.sidecar.start()
        stack.closers.append(stack.sidecar.stop)
        # KV-event ports as labels: the decode pod's events come from the replica behind its sidecar.
        events = [{"kv-events-port": d["kv_events_endpoint"].rpartition(":")[2],
                   "kv-replay-port": d["kv_replay_endpoint"].rpartition(":")[2]} for d in fleet.info]
        pool = [prefill or EndpointSpec("127.0.0.1", stack.prefiller.port, {ROLE: "prefill", **events[0]}),
                EndpointSpec("127.0.0.1", stack.sidecar.bound_port, {ROLE: "decode", **events[1]})]
        epp = await start_picker(config, pool)
        stack.epp = epp
        stack.closers.append(lambda: epp.stop(0))
        await wait_until(lambda: all(ep.metrics.update_time > 0 for ep in epp.endpoints.snapshot()),
                         "both pods' /metrics (the decode pod's through the sidecar) to be scraped")
        listen, admin = free_port(), free_port()
        envoy = EnvoyProcess(render_config(listen_port=listen, admin_port=admin, epp_port=epp.grpc_port), admin)
        await envoy.start()
        stack.closers.append(envoy.stop)
        stack.url = f"http://127.0.0.1:{listen}"
        return stack

    yield start
    for stack in stacks:
        for close in reversed(stack.closers):
            await close()


async def complete(session, stack, prompt, headers=None, **fields):
    body = {"model": "sim-model", "prompt": prompt, "max_tokens": 8, **fields}
    async with session.post(f"{stack.url}/v1/completions", json=body, headers=headers or {}) as resp:
        return resp.status, resp.headers, await resp.read()


async def test_long_prompt_is_prefilled_on_the_prefiller_and_decoded_on_the_decode_pod(start_stack):
    stack = await start_stack()
    async with aiohttp.ClientSession() as session:
        status, headers, raw = await complete(session, stack, LONG)
        assert status == 200, raw
        assert headers[USED_PREFILLER_HEADER] == stack.prefiller.endpoint  # the picker's prefill pick
        assert headers[REPLICA_HEADER] == stack.decoder.config.name         # the destination decoded
        assert json.loads(raw)["usage"]["completion_tokens"] == 8
        assert stack.prefiller.pd.stats.prefill_legs == 1 and stack.prefiller.pd.stats.transfers_pulled == 1
        assert stack.decoder.pd.stats.decode_legs == 1 and stack.decoder.pd.stats.remote_tokens > 0

        # Streaming (another prompt: the decode pod now holds LONG, so LONG would stay there):
        # the prefill leg is never streamed, the decode leg streams to the client.
        status, headers, raw = await complete(session, stack, OTHER_LONG, stream=True)
        assert status == 200 and headers["content-type"].startswith("text/event-stream")
        events = [line for line in raw.decode().split("\n\n") if line]
        assert events[-1] == "data: [DONE]" and len(events) == 8 + 1
        assert headers[USED_PREFILLER_HEADER] == stack.prefiller.endpoint
        assert stack.decoder.pd.stats.decode_legs == 2


async def test_short_prompt_stays_on_the_decode_pod_and_a_client_cannot_choose_the_prefiller(start_stack):
    stack = await start_stack()
    attacker = EchoBackend("attacker")
    await attacker.start()
    try:
        async with aiohttp.ClientSession() as session:
            forged = {PREFILLER_HOST_PORT_HEADER: attacker.hostport}
            status, headers, raw = await complete(session, stack, SHORT, forged)
            assert status == 200, raw
            assert USED_PREFILLER_HEADER not in headers and headers[REPLICA_HEADER] == stack.decoder.config.name
            status, headers, _ = await complete(session, stack, LONG, forged)
            assert status == 200 and headers[USED_PREFILLER_HEADER] == stack.prefiller.endpoint
        assert attacker.received == []
        assert stack.prefiller.pd.stats.prefill_legs == 1
    finally:
        await attacker.stop()


async def test_a_failing_prefill_leg_falls_back_to_a_local_prefill(start_stack):
    broken = PrefillerWithoutConnector()
    await broken.start()
    try:
        stack = await start_stack(EndpointSpec("127.0.0.1", broken.port, {ROLE: "prefill"}))
        async with aiohttp.ClientSession() as session:
            status, headers, raw = await complete(session, stack, LONG, stream=True,
                                                  stream_options={"include_usage": True})
        assert status == 200, raw
        assert "returned no kv_transfer_params" in headers[FALLBACK_HEADER]
        assert headers[REPLICA_HEADER] == stack.decoder.config.name
        assert raw.decode().endswith("data: [DONE]\n\n")
        assert stack.decoder.pd.stats.decode_legs == 0  # prefilled locally
        # What the prefill leg asked for: vLLM's KV-transfer fields, one token, not streamed.
        (leg,) = broken.bodies
        assert leg["kv_transfer_params"]["do_remote_decode"] is True
        assert leg["kv_transfer_params"]["do_remote_prefill"] is False
        assert leg["max_tokens"] == 1 and leg["stream"] is False and "stream_options" not in leg
        assert PREFILLER_HOST_PORT_HEADER not in {k.lower() for k in broken.received[0]["headers"]}
    finally:
        await broken.stop()


async def test_a_decode_leg_error_is_answered_clearly(start_stack):
    stack = await start_stack()
    async with aiohttp.ClientSession() as session:
        # The prefill leg asks for one token and succeeds; the decode replica refuses the real limit.
        status, headers, raw = await complete(session, stack, LONG, max_tokens=100_000)
    assert status == 400
    assert "max_tokens" in json.loads(raw)["error"]["message"]
    assert headers[USED_PREFILLER_HEADER] == stack.prefiller.endpoint
    assert stack.prefiller.pd.stats.prefill_legs == 1 and stack.decoder.pd.stats.decode_legs == 0


# Precise mode: the picker subscribes to both replicas' KV events. The decode replica publishes the
# blocks it received from the prefiller, so the picker sees them in the decode pool, and the same
# long prompt (with a short question) then needs no remote prefill: the decision is exact.
PRECISE = pd_config(64, plugin("precise-prefix-cache-producer", blockSizeTokens=16,
                               tokenizers={"sim-model": str(default_tokenizer_dir())}))


async def test_precise_mode_sees_the_transferred_blocks_in_the_decode_pool(start_stack):
    from epp.kvevents.index import DEFAULT_POOL
    from epp.kvevents.producer import PrecisePrefixCacheProducer

    assert PRECISE != CONFIG
    stack = await start_stack(config=PRECISE)
    [producer] = stack.epp.director.pipeline.plugins_of(PrecisePrefixCacheProducer)
    index = producer.index
    decode_pod = f"127.0.0.1:{stack.sidecar.bound_port}"
    async with aiohttp.ClientSession() as session:
        status, headers, _ = await complete(session, stack, LONG)
        assert status == 200 and headers[USED_PREFILLER_HEADER] == stack.prefiller.endpoint
        tokens = stack.decoder.tokenizer.encode(LONG)
        keys = index.keyer.request_keys(tokens, "sim-model", None)

        def transferred() -> bool:
            # Confirmed entries only: lookup() also counts the picker's speculative booking of the
            # decode pod, which is there before the decode replica's own events arrive.
            return all(index.tiers_of(key, decode_pod) for key in keys[:-1])

        await wait_until(transferred, "the decode replica's events for the transferred blocks", 10)
        assert len(index.lookup(keys, pool="decode").get(decode_pod, ())) >= len(keys) - 1
        assert index.pool_of(decode_pod) == "decode" and index.pool_of(stack.prefiller.endpoint) == "prefill"
        assert set(index.pools_holding(keys[0])) == {"decode", "prefill"} and index.pool_entries()[DEFAULT_POOL] == 0
        status, headers, _ = await complete(session, stack, LONG + " And in one word?")
        assert status == 200 and USED_PREFILLER_HEADER not in headers  # cached on the decode pod: no remote prefill
    assert stack.prefiller.pd.stats.prefill_legs == 1
