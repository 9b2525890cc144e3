"""The sidecar's E/PD encode stage (`x-encoder-hosts-ports`) and P2P KV pull hint (`x-kv-cache-source-host-port`),
against recording engines: what each leg is sent."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from epp.engine.pd_sidecar import PDSidecar, SidecarConfig
from epp.framework import (
    ENCODER_HOSTS_PORTS_HEADER,
    KV_CACHE_SOURCE_HEADER,
    KV_CACHE_SOURCE_P2P_PORT_HEADER,
    PREFILLER_HOST_PORT_HEADER,
)


class Recorder:
    """An engine that records each request (path, headers, JSON body) and answers like vLLM with KV params."""

    def __init__(self, status: int = 200) -> None:
        self.status = status
        self.seen: list[tuple[str, dict[str, str], dict[str, Any]]] = []
        self.port = 0

    async def handle(self, request: web.Request) -> web.Response:
        self.seen.append((request.path, dict(request.headers), json.loads(await request.read())))
        body = {"choices": [{"message": {"content": "ok"}}], "kv_transfer_params": {"remote_engine_id": "e"}}
        return web.json_response(body, status=self.status)

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/{tail:.*}", self.handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = self._runner.addresses[0][1]

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def stop(self) -> None:
        await self._runner.cleanup()


@pytest.fixture
async def stage():
    """A decode engine, two encoders, a prefiller, a sidecar factory and a client session."""
    engines = {name: Recorder() for name in ("decode", "enc1", "enc2", "prefill")}
    for engine in engines.values():
        await engine.start()
    sidecars: list[PDSidecar] = []

    async def sidecar(**options) -> PDSidecar:
        sc = PDSidecar(SidecarConfig(host="127.0.0.1", port=0, vllm_port=engines["decode"].port, **options))
        await sc.start()
        sidecars.append(sc)
        return sc

    async with aiohttp.ClientSession() as session:
        yield engines, sidecar, session
    for sc in sidecars:
        await sc.stop()
    for engine in engines.values():
        await engine.stop()


async def post(session, sc, body, headers):
    async with session.post(f"http://127.0.0.1:{sc.bound_port}/v1/chat/completions", json=body,
                            headers=headers) as resp:
        return resp.status, await resp.json(content_type=None)


def image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


MULTIMODAL = {"model": "m", "stream": True, "max_tokens": 50, "messages": [
    {"role": "system", "content": "describe"},
    {"role": "user", "content": [{"type": "text", "text": "what is in these?"}, image("http://x/a.png"),
                                 image("http://x/b.png"), image("http://x/a.png"),
                                 {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}]}


async def test_each_distinct_multimodal_item_goes_to_an_encoder_before_decode(stage):
    engines, sidecar, session = stage
    sc = await sidecar()
    header = f"{engines['enc1'].endpoint},{engines['enc2'].endpoint}"
    status, _ = await post(session, sc, MULTIMODAL, {ENCODER_HOSTS_PORTS_HEADER: header})
    assert status == 200
    sent = [body for enc in ("enc1", "enc2") for _, _, body in engines[enc].seen]
    assert sorted(json.dumps(b["messages"][0]["content"][0], sort_keys=True) for b in sent) == sorted(
        json.dumps(item, sort_keys=True) for item in (image("http://x/a.png"), image("http://x/b.png"),
                                                      MULTIMODAL["messages"][1]["content"][4]))
    assert (len(engines["enc1"].seen), len(engines["enc2"].seen)) == (2, 1)  # round robin
    assert all(b["max_tokens"] == 1 and b["stream"] is False and len(b["messages"]) == 1 for b in sent)
    [(path, headers, decoded)] = engines["decode"].seen
    assert decoded == MULTIMODAL
    assert ENCODER_HOSTS_PORTS_HEADER not in {k.lower() for k in headers}


async def test_a_failing_encoder_is_a_502_and_a_bad_header_a_400(stage):
    engines, sidecar, session = stage
    sc = await sidecar()
    engines["enc1"].status = 500
    status, body = await post(session, sc, MULTIMODAL, {ENCODER_HOSTS_PORTS_HEADER: engines["enc1"].endpoint})
    assert status == 502 and "answered 500" in body["error"]["message"]
    assert engines["decode"].seen == []
    status, body = await post(session, sc, MULTIMODAL, {ENCODER_HOSTS_PORTS_HEADER: "encoder-a:8000"})
    assert status == 400 and "with an IP address" in body["error"]["message"]


async def test_a_text_request_reaches_no_encoder(stage):
    engines, sidecar, session = stage
    text = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}
    status, _ = await post(session, await sidecar(), text, {ENCODER_HOSTS_PORTS_HEADER: engines["enc1"].endpoint})
    assert status == 200 and engines["enc1"].seen == [] and len(engines["decode"].seen) == 1


CHAT = {"model": "m", "messages": [{"role": "user", "content": "a long document " * 50}],
        "kv_transfer_params": {"client": "owned"}}


async def test_a_kv_source_makes_the_decode_leg_pull_from_the_peer(stage):
    engines, sidecar, session = stage
    sc = await sidecar(p2p_connector_port=7788, self_host="10.0.0.9")
    status, _ = await post(session, sc, CHAT, {KV_CACHE_SOURCE_HEADER: "10.0.0.7:8000"})
    assert status == 200
    [(_, headers, body)] = engines["decode"].seen
    pull = body["kv_transfer_params"]["remote_kv_source"]
    assert (pull["remote_host"], pull["remote_port"]) == ("10.0.0.7", 7788) and len(pull["kv_request_id"]) == 36
    assert set(body["kv_transfer_params"]) == {"remote_kv_source"}  # the sidecar owns the field
    assert KV_CACHE_SOURCE_HEADER not in {k.lower() for k in headers}


async def test_the_pickers_p2p_port_wins_over_the_sidecars(stage):
    engines, sidecar, session = stage
    sc = await sidecar(p2p_connector_port=7788, self_host="10.0.0.9")
    for sent, used in (("7780", 7780), ("0", 7788), ("not-a-port", 7788), ("70000", 7788)):
        status, _ = await post(session, sc, CHAT, {KV_CACHE_SOURCE_HEADER: "10.0.0.7:8003",
                                                   KV_CACHE_SOURCE_P2P_PORT_HEADER: sent})
        assert status == 200
        _, headers, body = engines["decode"].seen[-1]
        assert body["kv_transfer_params"]["remote_kv_source"]["remote_port"] == used, sent
        assert KV_CACHE_SOURCE_P2P_PORT_HEADER not in {k.lower() for k in headers}


@pytest.mark.parametrize("value", ["10.0.0.9:0", "peer:8000", "10.0.0.9"])
async def test_a_malformed_kv_source_is_ignored(stage, value):
    engines, sidecar, session = stage
    status, _ = await post(session, await sidecar(), CHAT, {KV_CACHE_SOURCE_HEADER: value})
    assert status == 200 and engines["decode"].seen[0][2] == CHAT


async def test_a_kv_source_that_is_this_pod_is_ignored(stage):
    engines, sidecar, session = stage
    sc = await sidecar(self_host="127.0.0.1")
    status, _ = await post(session, sc, CHAT, {KV_CACHE_SOURCE_HEADER: f"127.0.0.1:{sc.config.port}"})
    assert status == 200 and engines["decode"].seen[0][2] == CHAT


async def test_with_a_prefiller_the_prefill_leg_pulls_from_the_peer(stage):
    engines, sidecar, session = stage
    sc = await sidecar()
    headers = {PREFILLER_HOST_PORT_HEADER: engines["prefill"].endpoint, KV_CACHE_SOURCE_HEADER: "10.0.0.7:8000"}
    status, _ = await post(session, sc, CHAT, headers)
    assert status == 200
    [(_, _, leg)] = engines["prefill"].seen
    assert leg["kv_transfer_params"]["do_remote_decode"] is True
    assert leg["kv_transfer_params"]["remote_kv_source"]["remote_host"] == "10.0.0.7"
    # The prefiller itself as the source: nothing to pull.
    same = {PREFILLER_HOST_PORT_HEADER: engines["prefill"].endpoint,
            KV_CACHE_SOURCE_HEADER: engines["prefill"].endpoint}
    await post(session, sc, CHAT, same)
    assert "remote_kv_source" not in engines["prefill"].seen[1][2]["kv_transfer_params"]
