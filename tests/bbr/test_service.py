"""`epp bbr` over gRPC: the model headers for every API format, the route cache cleared, bad bodies refused."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from epp.bbr.server import BbrOptions, BbrServer
from tests.support.extproc import ExtProcClient, headers_of, request_body, request_headers, response_body

MAPPING = "baseModel: llama-8b\nadapters: [sql-lora]\n"


@pytest.fixture
async def router(tmp_path):
    (tmp_path / "config").write_text(MAPPING)
    server = BbrServer(BbrOptions(grpc_port=0, grpc_health_port=0, metrics_port=0, bind_address="127.0.0.1",
                                  adapters=(str(tmp_path),)))
    await server.start()
    client = ExtProcClient(server.grpc_port)
    yield server, client
    await client.close()
    await server.stop(0)


async def routed(client, path: str, body: dict | bytes) -> tuple[dict[str, str], list[str], bytes]:
    """(headers set, headers removed, body sent on) for a request the router answers."""
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    replies = await client.exchange([request_headers(path), request_body(raw)], expect=2)
    common = replies[0].request_headers.response
    assert common.clear_route_cache is True  # the route is chosen again, by the headers set here
    piece = replies[1].request_body.response.body_mutation.streamed_response
    assert piece.end_of_stream is True
    return headers_of(common.header_mutation), list(common.header_mutation.remove_headers), piece.body


@pytest.mark.parametrize("path, body, model", [
    ("/v1/completions", {"model": "llama-8b", "prompt": "hi"}, "llama-8b"),
    ("/v1/chat/completions", {"model": "qwen", "messages": [{"role": "user", "content": "hi"}]}, "qwen"),
    ("/v1/responses", {"model": "qwen", "input": "hi"}, "qwen"),
    ("/v1/embeddings", {"model": "embedder", "input": ["a", "b"]}, "embedder"),
    ("/v1/messages", {"model": "claude-like", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
     "claude-like"),
    # Paths no parser reads yet: the model of a JSON body is still read.
    ("/v1/messages/count_tokens", {"model": "claude-like", "messages": [{"role": "user", "content": "hi"}]},
     "claude-like"),
    ("/inference/v1/generate", {"model": "llama-8b", "token_ids": [1, 2, 3], "sampling_params": {}}, "llama-8b"),
])
async def test_every_api_format_gets_the_model_headers_and_its_body_unchanged(router, path, body, model):
    _, client = router
    set_headers, _, sent = await routed(client, path, body)
    assert set_headers["x-gateway-model-name"] == model == set_headers["x-gateway-base-model-name"]
    assert sent == json.dumps(body).encode()


async def test_an_adapter_names_its_base_model(router):
    server, client = router
    set_headers, _, _ = await routed(client, "/v1/completions", {"model": "sql-lora", "prompt": "select"})
    assert (set_headers["x-gateway-model-name"], set_headers["x-gateway-base-model-name"]) == ("sql-lora", "llama-8b")
    assert server.metrics.registry.get_sample_value("epp_bbr_adapters") == 1


async def test_a_body_naming_no_model_goes_on_without_the_headers(router):
    server, client = router
    set_headers, removed, _ = await routed(client, "/generate", {"text": "hello"})  # SGLang names no model
    assert "x-gateway-model-name" not in set_headers
    assert {"x-gateway-model-name", "x-gateway-base-model-name"} <= set(removed)  # a client cannot pick the pool
    [reply] = await client.exchange([request_headers("/v1/models", end_of_stream=True)], expect=1)
    assert {"x-gateway-model-name", "x-gateway-base-model-name"} <= set(
        reply.request_headers.response.header_mutation.remove_headers)
    assert server.metrics.registry.get_sample_value("epp_bbr_requests_total", {"outcome": "no_model"}) == 2


async def test_a_bad_body_gets_the_pickers_answer(router):
    server, client = router
    [reply] = await client.exchange([request_headers("/v1/chat/completions"),
                                     request_body(b'{"model": "qwen", "messages": "x"}')], expect=1)
    answer = reply.immediate_response
    assert answer.status.code == 400
    assert json.loads(answer.body)["error"]["message"] == (
        "inference error: BadRequest - invalid chat completions request: must have valid messages field")
    assert server.metrics.registry.get_sample_value("epp_bbr_refused_requests_total",
                                                    {"error_code": "BadRequest"}) == 1


async def test_a_large_body_is_sent_on_in_pieces(router):
    _, client = router
    prompt = "x" * 200_000
    raw = json.dumps({"model": "qwen", "prompt": prompt}).encode()
    replies = await client.exchange([request_headers(), request_body(raw[:70_000], end_of_stream=False),
                                     request_body(raw[70_000:])], expect=5)
    pieces = [r.request_body.response.body_mutation.streamed_response for r in replies[1:]]
    assert b"".join(p.body for p in pieces) == raw and [p.end_of_stream for p in pieces] == [False] * 3 + [True]


async def test_response_messages_pass_through(router):
    _, client = router
    replies = await client.exchange([request_headers(), request_body(b'{"model": "m", "prompt": "p"}'),
                                     response_body(b"chunk", end_of_stream=True)], expect=3)
    assert replies[2].response_body.response.body_mutation.streamed_response.body == b"chunk"


def test_epp_bbr_refuses_a_bad_mapping_before_serving(tmp_path):
    (tmp_path / "bad").write_text("baseModel: [")
    done = subprocess.run([sys.executable, "-m", "epp.cli", "bbr", "--adapters", str(tmp_path), "--grpc-port", "0",
                           "--grpc-health-port", "0", "--metrics-port", "0", "--bind-address", "127.0.0.1"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.startswith(f"epp bbr: {tmp_path / 'bad'}: not YAML")
    help_text = subprocess.run([sys.executable, "-m", "epp.cli", "bbr", "--help"], capture_output=True, text=True,
                               timeout=60).stdout
    assert help_text.startswith("usage: epp bbr") and "--adapters PATH" in help_text
