"""The P/D sidecar's legs one by one, against simulated replicas (no Envoy): what each failure answers."""

from __future__ import annotations

import ipaddress

import aiohttp
import pytest

from epp.engine.pd_sidecar import (
    FALLBACK_HEADER,
    USED_PREFILLER_HEADER,
    PDSidecar,
    SidecarConfig,
    main,
    parse_prefiller,
    prefill_body,
)
from epp.engine.sim.fleet import FleetConfig, SimFleet, default_tokenizer_dir
from epp.engine.sim.server import REPLICA_HEADER
from epp.framework import PREFILLER_HOST_PORT_HEADER
from tests.support.ports import free_port

PROMPT = "a long shared document about KV caches " * 20
CHAT = {"model": "sim-model", "messages": [{"role": "user", "content": PROMPT}], "max_completion_tokens": 6}


@pytest.fixture
async def pods():
    """Prefill replica P, decode replica D and a sidecar in front of D; yields a factory of sidecars."""
    fleet = SimFleet(FleetConfig(replicas=2, roles=["prefill", "decode"], tokenizer_dir=default_tokenizer_dir()))
    await fleet.start()
    sidecars: list[PDSidecar] = []

    async def sidecar(**options) -> PDSidecar:
        sc = PDSidecar(SidecarConfig(host="127.0.0.1", port=0, vllm_port=fleet.replicas[1].port, **options))
        await sc.start()
        sidecars.append(sc)
        return sc

    async with aiohttp.ClientSession() as session:
        yield fleet.replicas[0], fleet.replicas[1], sidecar, session
    for sc in sidecars:
        await sc.stop()
    await fleet.stop()


async def post(session, sidecar, body, prefiller=None, path="/v1/chat/completions"):
    headers = {PREFILLER_HOST_PORT_HEADER: prefiller} if prefiller else {}
    async with session.post(f"http://127.0.0.1:{sidecar.bound_port}{path}", json=body, headers=headers) as resp:
        return resp.status, resp.headers, await resp.json(content_type=None)


async def test_chat_request_runs_both_legs(pods):
    prefiller, decoder, sidecar, session = pods
    sc = await sidecar()
    status, headers, body = await post(session, sc, CHAT, prefiller.endpoint)
    assert status == 200 and body["usage"]["completion_tokens"] == 6
    assert headers[USED_PREFILLER_HEADER] == prefiller.endpoint and headers[REPLICA_HEADER] == decoder.config.name
    assert prefiller.pd.stats.prefill_legs == 1 and decoder.pd.stats.decode_legs == 1


async def test_without_the_header_everything_passes_through(pods):
    prefiller, decoder, sidecar, session = pods
    sc = await sidecar()
    status, headers, _ = await post(session, sc, CHAT)
    assert status == 200 and USED_PREFILLER_HEADER not in headers
    async with session.get(f"http://127.0.0.1:{sc.bound_port}/metrics") as resp:
        assert resp.status == 200 and "vllm:num_requests_running" in await resp.text()
    assert prefiller.pd.stats.prefill_legs == 0 and decoder.pd.stats.decode_legs == 0


async def test_unreachable_prefiller_falls_back_or_is_a_502(pods):
    _, decoder, sidecar, session = pods
    nobody = f"127.0.0.1:{free_port()}"
    status, headers, body = await post(session, await sidecar(), CHAT, nobody)
    assert status == 200 and f"prefill leg to {nobody} failed" in headers[FALLBACK_HEADER]
    assert headers[REPLICA_HEADER] == decoder.config.name
    status, _, body = await post(session, await sidecar(fallback_to_local=False), CHAT, nobody)
    assert status == 502 and f"prefill leg to {nobody} failed" in body["error"]["message"]


async def test_prefiller_refusing_the_request_is_the_clients_answer(pods):
    prefiller, decoder, sidecar, session = pods
    bad = dict(CHAT, messages="not a list")
    status, _, body = await post(session, await sidecar(), bad, prefiller.endpoint)
    assert status == 400 and "refused the request (400)" in body["error"]["message"]
    assert decoder.pd.stats.decode_legs == 0


@pytest.mark.parametrize("header, options, status, message", [
    ("prefill-host", {}, 400, "must be ip:port"),
    ("example.com:8000", {}, 400, "must be ip:port"),
    ("127.0.0.1:8000", {"allowed_prefillers": (ipaddress.ip_network("10.0.0.0/8"),)}, 403,
     "outside --allowed-prefillers"),
])
async def test_bad_or_disallowed_prefiller_is_refused(pods, header, options, status, message):
    _, decoder, sidecar, session = pods
    got, _, body = await post(session, await sidecar(**options), CHAT, header)
    assert got == status and message in body["error"]["message"]


async def test_unreachable_local_vllm_is_a_503(pods):
    prefiller, decoder, sidecar, session = pods
    sc = await sidecar()
    await decoder.stop()
    status, _, body = await post(session, sc, CHAT, prefiller.endpoint)
    assert status == 503 and "local vLLM at http://127.0.0.1:" in body["error"]["message"]


def test_prefill_body_and_header_parsing():
    leg = prefill_body({"model": "m", "prompt": "x", "stream": True, "stream_options": {"include_usage": True},
                        "max_tokens": 50, "max_completion_tokens": 50})
    assert leg["stream"] is False and leg["max_tokens"] == 1 and leg["max_completion_tokens"] == 1
    assert "stream_options" not in leg and leg["kv_transfer_params"]["do_remote_decode"] is True
    assert parse_prefiller("[::1]:8000") == ("::1", 8000)
    with pytest.raises(ValueError):
        parse_prefiller("10.0.0.1:0")


def test_cli_refuses_the_sidecar_fronting_itself(capsys):
    assert main(["--port", "8000", "--vllm-port", "8000"]) == 2
    assert "must differ" in capsys.readouterr().err
