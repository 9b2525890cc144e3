"""Two models in two pools behind one real Envoy, the body-based router in front of each pool's picker.

Pool A serves `model-a` and its adapter `a-lora`; pool B serves `model-b` and `b-lora`. Each pool
is a simulated fleet with its own picker. A request reaches the pool of the model it names, an
adapter the pool of its base model (from the mapping file), a model no pool serves gets 404; a
mapping change (`b-lora` added to model-b's adapters) routes the adapter without any restart.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
import pytest_asyncio

from epp.bbr.envoy_config import Pool, render_bbr_config
from epp.bbr.server import BbrOptions, BbrServer
from epp.datalayer.registry import parse_endpoint_list
from epp.engine.sim import FleetConfig, SimFleet
from epp.engine.sim.fleet import default_tokenizer_dir
from epp.engine.sim.server import REPLICA_HEADER
from epp.envoy import EnvoyProcess
from epp.server.runner import EppServer, ServeOptions
from tests.support.ports import free_port

pytestmark = [pytest.mark.envoy, pytest.mark.timeout(120), pytest.mark.asyncio(loop_scope="module")]


class Gateway:
    def __init__(self, port: int, mapping_file, router: BbrServer) -> None:
        self.port, self.mapping_file, self.router = port, mapping_file, router

    async def post(self, path: str, body: dict) -> tuple[int, str | None, dict]:
        async with aiohttp.ClientSession() as http:
            async with http.post(f"http://127.0.0.1:{self.port}{path}", json=body) as r:
                return r.status, r.headers.get(REPLICA_HEADER), json.loads(await r.read())


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def gateway(tmp_path_factory):
    folder = tmp_path_factory.mktemp("adapters")
    mapping_file = folder / "config"
    mapping_file.write_text("baseModel: model-a\nadapters: [a-lora]\n")
    tokenizers = default_tokenizer_dir()
    fleets = [SimFleet(FleetConfig(replicas=2, model=f"model-{x}", name_prefix=f"pool-{x}", tokenizer_dir=tokenizers,
                                   kv_events=False, lora_modules={f"{x}-lora": f"/adapters/{x}"})) for x in "ab"]
    pickers: list[EppServer] = []
    router = envoy = None
    try:
        for fleet in fleets:
            await fleet.start()
            picker = EppServer(ServeOptions(grpc_port=0, grpc_health_port=0, metrics_port=0, bind_address="127.0.0.1",
                                            endpoints=parse_endpoint_list(fleet.endpoints_arg), grace_period_s=1))
            await picker.start()
            pickers.append(picker)
        router = BbrServer(BbrOptions(grpc_port=0, grpc_health_port=0, metrics_port=0, bind_address="127.0.0.1",
                                      adapters=(str(folder),), adapters_poll_interval_s=0.1))
        await router.start()
        listen, admin = free_port(), free_port()
        config = render_bbr_config([Pool("model-a", "127.0.0.1", pickers[0].grpc_port),
                                    Pool("model-b", "127.0.0.1", pickers[1].grpc_port)],
                                   bbr_port=router.grpc_port, listen_port=listen, admin_port=admin)
        envoy = EnvoyProcess(config, admin)
        await envoy.start()
        yield Gateway(listen, mapping_file, router)
    finally:
        if envoy is not None:
            await envoy.stop()
        if router is not None:
            await router.stop(0)
        for picker in pickers:
            await picker.stop(0)
        for fleet in fleets:
            await fleet.stop()


async def test_each_model_reaches_its_own_pool(gateway):
    for i in range(6):
        for model in ("model-a", "model-b"):
            status, replica, body = await gateway.post("/v1/completions", {"model": model, "prompt": f"hello {i}",
                                                                           "max_tokens": 2})
            assert status == 200, body
            assert replica.startswith(f"pool-{model[-1]}-") and body["model"] == model


async def test_every_api_format_is_routed_by_its_model(gateway):
    status, replica, _ = await gateway.post("/v1/chat/completions", {
        "model": "model-b", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
    assert (status, replica[:7]) == (200, "pool-b-")
    status, replica, answer = await gateway.post("/v1/messages", {
        "model": "model-a", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
    assert (status, replica[:7], answer["type"]) == (200, "pool-a-", "message")
    status, replica, _ = await gateway.post("/v1/responses", {"model": "model-b", "input": "hi",
                                                              "max_output_tokens": 2})
    assert (status, replica[:7]) == (200, "pool-b-")
    # A prompt far larger than Envoy's 6.2 KB double-FULL_DUPLEX trap passes both ext_proc filters intact.
    status, replica, body = await gateway.post("/v1/completions", {"model": "model-a", "prompt": "word " * 3_000,
                                                                   "max_tokens": 1})
    assert (status, replica[:7]) == (200, "pool-a-") and body["usage"]["prompt_tokens"] > 3_000


async def test_an_adapter_reaches_its_base_models_pool_and_the_mapping_reloads_without_restart(gateway):
    status, replica, body = await gateway.post("/v1/completions", {"model": "a-lora", "prompt": "x", "max_tokens": 1})
    assert (status, replica[:7], body["model"]) == (200, "pool-a-", "a-lora")
    # b-lora is in no mapping yet: its own base, which no pool serves.
    status, replica, body = await gateway.post("/v1/completions", {"model": "b-lora", "prompt": "x", "max_tokens": 1})
    assert (status, replica) == (404, None) and body["error"]["message"] == "no pool serves this model"
    gateway.mapping_file.write_text("baseModel: model-a\nadapters: [a-lora]\n---\nbaseModel: model-b\n"
                                    "adapters: [b-lora]\n")
    for _ in range(50):
        if gateway.router.mapping().base_of("b-lora") == "model-b":
            break
        await asyncio.sleep(0.1)
    status, replica, body = await gateway.post("/v1/completions", {"model": "b-lora", "prompt": "x", "max_tokens": 1})
    assert (status, replica[:7], body["model"]) == (200, "pool-b-", "b-lora")
    assert gateway.router.metrics.registry.get_sample_value("epp_bbr_mapping_reloads_total", {"outcome": "ok"}) == 1


async def test_unknown_models_and_bad_bodies_never_reach_a_pool(gateway):
    status, replica, body = await gateway.post("/v1/completions", {"model": "model-z", "prompt": "x"})
    assert (status, replica, body["error"]["code"]) == (404, None, 404)
    status, replica, body = await gateway.post("/v1/chat/completions", {"model": "model-a", "messages": "x"})
    assert (status, replica) == (400, None)
    assert body["error"]["message"].startswith("inference error: BadRequest - invalid chat completions request")
