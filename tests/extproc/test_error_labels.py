"""`inference_objective_request_error_total` names the model a refused request asked for, when its body names one."""

from __future__ import annotations

import json

import pytest

from epp.requestcontrol.lifecycle import model_named_in
from epp.server.runner import EppServer
from tests.support.extproc import options, request_body, request_headers, serving, simple_pipeline


@pytest.mark.parametrize("path, body, model, target, code", [
    # The model is there; another field is wrong.
    ("/v1/chat/completions", {"model": "llama", "messages": "not a list"}, "llama", "llama", "BadRequest"),
    ("/v1/completions", {"model": "llama", "prompt": ""}, "llama", "llama", "BadRequest"),
    ("/v1/messages", {"model": "claude-x", "max_tokens": 5}, "claude-x", "claude-x", "BadRequest"),
    # A rewrite header names the target model.
    ("/v1/completions", {"model": "base", "prompt": ["x", 3]}, "base", "base-lora", "BadRequest"),
    # No model, or no JSON object: the labels stay empty.
    ("/v1/completions", {"prompt": "hi"}, "", "", "BadRequest"),
    ("/v1/completions", "not json", "", "", "BadRequest"),
    ("/v1/completions", {"model": 3, "prompt": "hi"}, "", "", "BadRequest"),
])
async def test_a_refused_request_counts_under_the_model_it_named(path, body, model, target, code):
    server = EppServer(options(), pipeline=simple_pipeline())
    extra = [("x-llm-d-model-name-rewrite", target)] if target != model else []
    raw = body.encode() if isinstance(body, str) else json.dumps(body).encode()
    async with serving(server) as client:
        [reply] = await client.exchange([request_headers(path, extra=extra), request_body(raw)], expect=1)
        assert reply.immediate_response.status.code == 400
        value = server.metrics.registry.get_sample_value(
            "inference_objective_request_error_total",
            {"model_name": model, "target_model_name": target, "error_code": code})
    assert value == 1


@pytest.mark.parametrize("body, model", [
    (b'{"model": "m", "messages": {"deep": [[[[1]]]]}}', "m"),
    (b'{"messages": [], "model": "late"}', "late"),
    (b'{"model": null}', ""),
    (b'[{"model": "m"}]', ""),
    (b"\xff\xfe", ""),
    (b'{"x": ' + b"[" * 200 + b"]" * 200 + b', "model": "deep"}', ""),  # too deep to read again
    (b"", ""),
])
def test_model_named_in_reads_the_top_level_model_only(body, model):
    assert model_named_in(body) == model
