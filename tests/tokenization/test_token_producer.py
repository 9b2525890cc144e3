"""token-producer: the prompt's tokens from the model server's renderer (vLLM's /render, or /tokenize when the
render API is refused), bounded by a timeout and cached; from local tokenizer files; or estimated.

The renderer here is a loopback HTTP server whose answers a test sets (status, delay, token ids), so that
the fallback, the timeout and the cache are each shown; tests/vllm/test_token_producer_vllm.py asks a real
vLLM for the tokens and checks they are the tokenizer's.
"""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry

from epp.engine.tinymodel import write_tiny_model
from epp.framework import CycleState, InferenceRequest, PluginContext
from epp.framework.datakeys import PROMPT_TOKENS
from epp.framework.registry import default_registry
from epp.tokenization.pool import TokenizerPool
from tests.support.requests import format_of


def make(params: dict, registry: CollectorRegistry | None = None):
    return default_registry().build("token-producer", "token-producer", params,
                                    PluginContext(metrics_registry=registry or CollectorRegistry()))


def completion(prompt: str, model: str = "tiny") -> InferenceRequest:
    return InferenceRequest("r", "completions", model, model, {"model": model, "prompt": prompt}, format=format_of("completions"))


def chat(text: str, model: str = "tiny") -> InferenceRequest:
    body = {"model": model, "messages": [{"role": "user", "content": text}]}
    return InferenceRequest("r", "chat/completions", model, model, body, format=format_of("chat/completions"))


class Renderer:
    """A loopback renderer: answers vLLM's render and /tokenize paths with `ids`, as a test sets it."""

    def __init__(self) -> None:
        self.render_status = 200
        self.delay = 0.0
        self.ids = [1, 2, 3]
        self.calls: list[tuple[str, dict]] = []
        self.port = 0
        self._runner: web.AppRunner | None = None

    async def _render(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.calls.append((request.path, body))
        if self.delay:
            await asyncio.sleep(self.delay)
        if self.render_status != 200:
            return web.json_response({"error": "scale-out endpoints are disabled"}, status=self.render_status)
        answer = {"request_id": "x", "token_ids": self.ids}
        return web.json_response([answer] if request.path == "/v1/completions/render" else answer)

    async def _tokenize(self, request: web.Request) -> web.Response:
        self.calls.append((request.path, await request.json()))
        return web.json_response({"count": len(self.ids), "max_model_len": 1024, "tokens": self.ids})

    async def start(self) -> Renderer:
        app = web.Application()
        app.router.add_post("/v1/completions/render", self._render)
        app.router.add_post("/v1/chat/completions/render", self._render)
        app.router.add_post("/tokenize", self._tokenize)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self.port = self._runner.addresses[0][1]
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@pytest.fixture
async def renderer():
    server = await Renderer().start()
    yield server
    await server.stop()


async def started(params: dict, registry: CollectorRegistry | None = None):
    producer = make(params, registry)
    await producer.start()
    return producer


async def test_vllm_backend_renders_the_request_body_and_caches_it(renderer):
    registry = CollectorRegistry()
    producer = await started({"modelName": "tiny", "vllm": {"url": renderer.url}}, registry)
    try:
        renderer.calls.clear()  # the start-up probe
        state = CycleState()
        await producer.prepare(state, completion("hello world"), [])
        assert state.get(PROMPT_TOKENS).token_ids == (1, 2, 3) and state.get(PROMPT_TOKENS).exact
        assert renderer.calls == [("/v1/completions/render", {"model": "tiny", "prompt": "hello world"})]
        renderer.ids = [9, 9]  # a second identical request is answered from the cache
        assert (await producer.tokens(completion("hello world"))).token_ids == (1, 2, 3)
        assert len(renderer.calls) == 1
        assert (await producer.tokens(chat("hi"))).token_ids == (9, 9)
        assert renderer.calls[-1][0] == "/v1/chat/completions/render"

        def outcome(name: str) -> float:
            return registry.get_sample_value("epp_token_producer_requests_total", {
                "plugin": "token-producer", "backend": "vllm", "outcome": name}) or 0.0

        assert (outcome("rendered"), outcome("cached")) == (2.0, 1.0)
        assert registry.get_sample_value("epp_token_producer_cache_tokens", {"plugin": "token-producer"}) == 5.0
    finally:
        await producer.stop()


async def test_a_renderer_that_refuses_the_render_api_is_asked_tokenize(renderer):
    renderer.render_status = 403  # vLLM without --enable-scale-out
    producer = await started({"modelName": "tiny", "vllm": {"url": renderer.url}})
    try:
        tokens = await producer.tokens(chat("hi there"))
        assert tokens.token_ids == (1, 2, 3)
        path, body = renderer.calls[-1]
        assert (path, body) == ("/tokenize", {"model": "tiny", "messages": [{"role": "user", "content": "hi there"}]})
        await producer.tokens(completion("plain"))
        assert renderer.calls[-1] == ("/tokenize", {"model": "tiny", "prompt": "plain", "add_special_tokens": True})
    finally:
        await producer.stop()


async def test_a_slow_or_failing_renderer_leaves_the_request_without_tokens(renderer):
    registry = CollectorRegistry()
    producer = await started({"modelName": "tiny", "vllm": {"url": renderer.url, "timeout": "50ms",
                                                            "mmTimeout": "50ms"}}, registry)
    try:
        renderer.delay = 0.5
        state = CycleState()
        await producer.prepare(state, completion("slow"), [])
        assert state.get(PROMPT_TOKENS) is None
        renderer.delay, renderer.render_status = 0.0, 500
        assert await producer.tokens(completion("broken")) is None
        labels = {"plugin": "token-producer", "backend": "vllm"}
        assert registry.get_sample_value("epp_token_producer_requests_total", {**labels, "outcome": "timeout"}) == 1
        assert registry.get_sample_value("epp_token_producer_requests_total", {**labels, "outcome": "failed"}) == 1
    finally:
        await producer.stop()


async def test_an_unreachable_renderer_does_not_stop_the_start():
    producer = await started({"modelName": "tiny", "vllm": {"url": "http://127.0.0.1:9", "timeout": "200ms"}})
    try:
        assert await producer.tokens(completion("x")) is None
    finally:
        await producer.stop()


def test_the_cache_is_bounded_by_tokens_least_recently_used_out():
    producer = make({"modelName": "tiny", "vllm": {"url": "http://127.0.0.1:9"}, "cacheTokens": 5})
    cache = producer._cache
    # Entries are a rendered prompt's ids and its media items.
    cache.put(b"a", ((1, 2), ()))
    cache.put(b"b", ((3, 4), ()))
    cache.get(b"a")
    cache.put(b"c", ((5, 6), ()))  # 6 tokens > 5: the least recently used (b) goes
    assert (cache.get(b"a"), cache.get(b"b"), cache.get(b"c"), cache.tokens) == (((1, 2), ()), None, ((5, 6), ()), 4)


async def test_local_backend_gives_the_tokenizer_files_tokens(tmp_path):
    model_dir = write_tiny_model(tmp_path / "tiny", seed=0, weights=False)
    producer = await started({"tokenizers": {"tiny": str(model_dir)}})
    pool = TokenizerPool({"tiny": model_dir})
    try:
        for req in (completion("the cache block of a replica"), chat("route this request")):
            tokens = await producer.tokens(req)
            assert tokens.exact and list(tokens.token_ids) == list(await pool.tokenize(req))
    finally:
        await producer.stop()
        pool.close()


async def test_estimate_backend_counts_four_bytes_per_token():
    producer = make({})
    tokens = await producer.tokens(completion("x" * 4000))
    assert len(tokens.token_ids) == 1000 and not tokens.exact
    assert len((await producer.tokens(chat("y" * 400))).token_ids) == 100
