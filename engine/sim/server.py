"""The HTTP face of one simulated vLLM replica (aiohttp): its APIs, /metrics, sleep, KV events.

The APIs: OpenAI completions and chat here; OpenAI Responses (`responses_api.py`), embeddings
(`embeddings_api.py`), Anthropic messages and count_tokens (`anthropic_api.py`), vLLM's
token-in/token-out `/inference/v1/generate` and SGLang's `/generate` (`token_apis.py`). Every
one runs its prompt through the same engine, so prefix caching, timing and KV events are the same.

Every response carries ``x-sim-replica: <name>`` so tests can see where a request went.
Errors use vLLM's JSON shape ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from aiohttp import web

from epp.engine.kv_publisher import KVEventPublisher, kv_topic
from epp.engine.sim.anthropic_api import AnthropicRoutes
from epp.engine.sim.embeddings_api import EmbeddingRoutes
from epp.engine.sim.engine import EngineError, SimEngine, SimRequest
from epp.engine.sim.metrics import MetricsRenderer
from epp.engine.sim.pd import TRANSFER_ROUTE, PDSupport
from epp.engine.sim.replica_config import ReplicaConfig
from epp.engine.sim.request_parsing import RequestError, RequestReader, error_response
from epp.engine.sim.responses_api import ResponsesRoutes
from epp.engine.sim.scale_out import ScaleOutRoutes
from epp.engine.sim.token_apis import TokenRoutes
from epp.engine.sim.tokenizer import SimTokenizer

log = logging.getLogger(__name__)

REPLICA_HEADER = "x-sim-replica"
_json_encode = msgspec.json.Encoder().encode


class SimReplica:
    """One simulated vLLM server: `await start()`, then `endpoint`; `await stop()`."""

    def __init__(self, config: ReplicaConfig, tokenizer: SimTokenizer) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.requests = RequestReader(config, tokenizer)
        self.engine = SimEngine(config.engine, output_token_pool=tokenizer.output_token_pool)
        self.pd = PDSupport(config, self.engine)
        # OpenAI Responses: the responses this replica produced, for `previous_response_id` (bounded).
        self.responses = ResponsesRoutes(self, config.max_stored_responses)
        self._token_text = {t: tokenizer.decode([t]) for t in tokenizer.output_token_pool}
        self.publisher: KVEventPublisher | None = None
        self.port = config.port
        self._runner: web.AppRunner | None = None
        self._created = int(time.time())
        ec = self.engine.config
        self._renderer = MetricsRenderer(
            config.model,
            {
                "block_size": str(ec.block_size),
                "num_gpu_blocks": str(ec.num_gpu_blocks),
                "num_cpu_blocks": str(ec.tiers.cpu_blocks or None),
                "enable_prefix_caching": "True",
                "prefix_caching_hash_algo": "sha256",
                "hash_block_size": "None",  # vLLM leaves it unset when it equals block_size
                "cache_dtype": "auto",
                "gpu_memory_utilization": "0.9",
            },
            lora_info=self._lora_info if config.lora_modules else None,
        )

    @property
    def endpoint(self) -> str:
        """``host:port`` of the HTTP server."""
        return f"{self.config.host}:{self.port}"

    def build_app(self) -> web.Application:
        """The aiohttp application with every route."""
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.on_response_prepare.append(self._tag_response)
        r = app.router
        r.add_post("/v1/completions", self.completions)
        r.add_post("/v1/chat/completions", self.chat_completions)
        r.add_get("/v1/models", self.models)
        r.add_get("/health", self.health)
        r.add_get("/load", self.load)
        r.add_get("/version", self.version)
        r.add_post("/tokenize", self.tokenize)
        r.add_post("/detokenize", self.detokenize)
        r.add_get("/metrics", self.metrics)
        r.add_post("/sleep", self.sleep)
        r.add_post("/wake_up", self.wake_up)
        r.add_get("/is_sleeping", self.is_sleeping)
        r.add_post("/reset_prefix_cache", self.reset_prefix_cache)
        r.add_get("/kv_event_sources", self.kv_event_sources)
        r.add_get("/sim/state", self.sim_state)
        r.add_post(TRANSFER_ROUTE, self.pd.handle_pull)
        r.add_post("/sim/speed", self.sim_speed)
        ScaleOutRoutes(self.requests, self.engine.config.max_model_len, self.config.enable_scale_out).attach(app)
        self.responses.attach(app)
        AnthropicRoutes(self).attach(app)
        EmbeddingRoutes(self).attach(app)
        TokenRoutes(self).attach(app)
        return app

    async def start(self) -> None:
        """Bind the HTTP port, then the KV-event sockets (the topic names the HTTP port)."""
        app = self.build_app()
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.host, self.config.port, reuse_address=True)
        await site.start()
        server = site._server  # the bound socket tells the real port when port=0 was asked
        assert server is not None
        self.port = self.pd.port = server.sockets[0].getsockname()[1]
        c = self.config
        if c.kv_events:
            topic = c.kv_topic if c.kv_topic is not None else kv_topic(c.host, self.port, c.model)
            self.publisher = KVEventPublisher(
                c.kv_events_endpoint or f"tcp://{c.host}:*",
                replay_endpoint=(c.kv_replay_endpoint or f"tcp://{c.host}:*") if c.kv_replay else None,
                topic=topic,
                legacy_array_events=c.legacy_array_events,
                bind=c.kv_events_bind,
            )
            self.engine.publisher = self.publisher
        self.engine.start()

    async def stop(self) -> None:
        """Stop serving and close the sockets."""
        await self.engine.stop()
        await self.pd.close()
        if self._runner is not None:
            await self._runner.cleanup()
        if self.publisher is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.publisher.close)

    def describe(self) -> dict[str, Any]:
        """Endpoints of this replica, for launchers and tests."""
        p = self.publisher
        return {
            "name": self.config.name,
            "endpoint": self.endpoint,
            "model": self.config.model,
            "kv_events_endpoint": p.bound_endpoint if p else None,
            "kv_replay_endpoint": p.replay_bound_endpoint if p else None,
            "kv_topic": p.topic if p else None,
            "labels": dict(self.config.labels),
            "profile": self.engine.profile.name,
            "block_size": self.engine.block_size,
            "num_gpu_blocks": self.engine.config.num_gpu_blocks,
        }

    async def _tag_response(self, request: web.Request, response: web.StreamResponse) -> None:
        response.headers[REPLICA_HEADER] = self.config.name

    def _natural_len(self, prompt_ids: list[int]) -> int:
        lo, hi = self.config.chat_output_len
        return lo + (hash(tuple(prompt_ids)) & 0xFFFF) % (hi - lo + 1)

    # -- generation routes --------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/completions."""
        try:
            body = await self.requests.body(request)
            ctx, stream, include_usage = self.requests.common(body)
            ids = self.requests.completion_prompt(body)
            max_tokens = self.requests.int_field(body, "max_tokens")
            r = self.engine.new_request(ids, 16 if max_tokens is None else max_tokens, stream=stream, ctx=ctx,
                                        request_id=_request_id(body, "cmpl"))
            self.pd.accept(r, body)
        except RequestError as exc:
            return error_response(str(exc), exc.status, exc.err_type, exc.param)
        except EngineError as exc:
            return error_response(str(exc))
        return await self._serve(request, r, body, chat=False, include_usage=include_usage)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/chat/completions."""
        try:
            body = await self.requests.body(request)
            ctx, stream, include_usage = self.requests.common(body)
            ids = self.requests.chat_prompt(body)
            max_tokens = self.requests.int_field(body, "max_completion_tokens", "max_tokens")
            r = self.engine.new_request(ids, max_tokens, stream=stream, ctx=ctx,
                                        natural_len=self._natural_len(ids),
                                        request_id=_request_id(body, "chatcmpl"))
            self.pd.accept(r, body)
        except RequestError as exc:
            return error_response(str(exc), exc.status, exc.err_type, exc.param)
        except EngineError as exc:
            return error_response(str(exc))
        return await self._serve(request, r, body, chat=True, include_usage=include_usage)

    def _usage(self, r: SimRequest, *, streamed: bool = False, chat: bool = False) -> dict[str, Any]:
        """vLLM's usage object: details only with --enable-prompt-tokens-details.

        A JSON response carries every field (the details as null when off, and every field of
        the prompt details); a stream's usage chunk is dumped with unset fields left out, so it
        has neither detail when off, never `completion_tokens_details` (only a reasoning parser
        fills that), and of the prompt details only what vLLM sets: `cached_tokens` for
        completions, also `created_cache_tokens` and `multimodal_tokens` for chat.
        """
        usage: dict[str, Any] = {
            "prompt_tokens": len(r.prompt_ids),
            "total_tokens": len(r.prompt_ids) + len(r.output),
            "completion_tokens": len(r.output),
        }
        if self.config.enable_prompt_tokens_details:
            details: dict[str, Any] = {"cached_tokens": r.num_cached_tokens}
            if chat:
                # Chat also reports the prompt tokens this request added to the cache: its full
                # blocks, less those it found there.
                full = len(r.prompt_ids) // self.engine.block_size * self.engine.block_size
                details.update(created_cache_tokens=max(0, full - r.num_cached_tokens), multimodal_tokens=None)
            elif not streamed:
                details.update(created_cache_tokens=None, multimodal_tokens=None)
            usage["prompt_tokens_details"] = details
        elif not streamed:
            usage["prompt_tokens_details"] = None
        if not streamed:
            usage["completion_tokens_details"] = None
        return usage

    def _text(self, ids: list[int]) -> str:
        tt = self._token_text
        return "".join([tt[t] for t in ids])

    def text_of(self, ids: list[int]) -> str:
        """The text of generated token ids (each from the replica's pool of plain words)."""
        return self._text(ids)

    def natural_len(self, prompt_ids: list[int]) -> int:
        """How many tokens a chat-like request generates unless its limit stops it first (from its prompt)."""
        return self._natural_len(prompt_ids)

    def cached_usage(self, r: SimRequest) -> tuple[int, int]:
        """(prompt tokens found in the prefix cache, full prompt blocks' tokens this request added to it)."""
        full = len(r.prompt_ids) // self.engine.block_size * self.engine.block_size
        return r.num_cached_tokens, max(0, full - r.num_cached_tokens)

    async def generate(self, r: SimRequest) -> AsyncIterator[list[int]]:
        """Run `r` on the engine and yield its new output tokens as steps make them, until it finishes.

        A consumer that stops early (a client gone) aborts the request, freeing its blocks.
        """
        loop = asyncio.get_running_loop()
        try:
            await self.pd.before_submit(r)  # a decode leg receives its prompt's KV first
            self.engine.submit(r)
            sent = 0
            while True:
                n = len(r.output)
                if n > sent:
                    new, sent = r.output[sent:n], n
                    yield new
                    continue  # the consumer may have waited: look again before sleeping
                if r.finished:
                    return
                r.waiter = loop.create_future()
                await r.waiter
        finally:
            if not r.finished:
                self.engine.abort(r)

    async def _serve(self, request: web.Request, r: SimRequest, body: dict[str, Any], *, chat: bool,
                     include_usage: bool) -> web.StreamResponse:
        loop = asyncio.get_running_loop()
        model = body.get("model") or self.config.model
        created = int(time.time())
        try:
            await self.pd.before_submit(r)  # a decode leg receives its prompt's KV first
            self.engine.submit(r)
            if not r.stream:
                while not r.finished:
                    r.waiter = loop.create_future()
                    await r.waiter
                if r.finish_reason == "abort":
                    return error_response("The request was aborted by the engine.", 503, "ServiceUnavailableError")
                text = self._text(r.output)
                if chat:
                    choice = {"index": 0, "message": {"role": "assistant", "content": text, "refusal": None,
                                                      "tool_calls": [], "reasoning_content": None},
                              "logprobs": None, "finish_reason": r.finish_reason, "stop_reason": None}
                    obj = "chat.completion"
                else:
                    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": r.finish_reason,
                              "stop_reason": None, "prompt_logprobs": None}
                    obj = "text_completion"
                resp = {"id": r.request_id, "object": obj, "created": created, "model": model,
                        "choices": [choice], "usage": self._usage(r, chat=chat), "system_fingerprint": None,
                        "prompt_logprobs": None, "kv_transfer_params": self.pd.response_params(r)}
                return web.Response(body=_json_encode(resp), content_type="application/json")
            return await self._stream(request, r, model, created, chat=chat, include_usage=include_usage)
        finally:
            if not r.finished:
                self.engine.abort(r)

    async def _stream(self, request: web.Request, r: SimRequest, model: str, created: int, *, chat: bool,
                      include_usage: bool) -> web.StreamResponse:
        loop = asyncio.get_running_loop()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        obj = "chat.completion.chunk" if chat else "text_completion"
        head = {"id": r.request_id, "object": obj, "created": created, "model": model}

        def chunk(text: str | None, finish: str | None, *, first: bool = False) -> bytes:
            if chat:
                delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else {"content": text}
                if finish is not None and not first:
                    delta = {"content": text} if text else {}
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish, "stop_reason": None}
            else:
                choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish, "stop_reason": None}
            return b"data: " + _json_encode({**head, "choices": [choice]}) + b"\n\n"

        sent = 0
        if chat:
            await resp.write(chunk(None, None, first=True))
        while True:
            n = len(r.output)
            if n > sent or r.finished:
                new = r.output[sent:n]
                sent = n
                finish = r.finish_reason if r.finished and r.finish_reason != "abort" else None
                if r.finished and r.finish_reason == "abort":
                    break
                parts = []
                if new:
                    # One chunk per token, like vLLM's per-step deltas.
                    for i, t in enumerate(new):
                        last = i == len(new) - 1
                        parts.append(chunk(self._token_text[t], finish if last else None))
                elif finish is not None:
                    parts.append(chunk("", finish))
                if parts:
                    await resp.write(b"".join(parts))
                if r.finished:
                    break
            r.waiter = loop.create_future()
            await r.waiter
        if include_usage and r.finish_reason != "abort":
            usage_chunk = {**head, "choices": [], "usage": self._usage(r, streamed=True, chat=chat)}
            await resp.write(b"data: " + _json_encode(usage_chunk) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    # -- other routes ---------------------------------------------------------------------------
    async def models(self, request: web.Request) -> web.Response:
        """GET /v1/models: the base model and its LoRA adapters."""
        mml = self.engine.config.max_model_len
        cards = [{"id": self.config.model, "object": "model", "created": self._created, "owned_by": "vllm",
                  "root": self.config.model, "parent": None, "max_model_len": mml, "permission": []}]
        for name, path in self.config.lora_modules.items():
            cards.append({"id": name, "object": "model", "created": self._created, "owned_by": "vllm",
                          "root": path, "parent": self.config.model, "max_model_len": None, "permission": []})
        return web.Response(body=_json_encode({"object": "list", "data": cards}), content_type="application/json")

    async def health(self, request: web.Request) -> web.Response:
        """GET /health: 200, empty (a sleeping engine is still healthy)."""
        return web.Response(status=200)

    async def load(self, request: web.Request) -> web.Response:
        """GET /load: in-flight generation requests."""
        e = self.engine
        return web.json_response({"server_load": len(e.running) + len(e.waiting)})

    async def version(self, request: web.Request) -> web.Response:
        """GET /version."""
        return web.json_response({"version": "0.33.0+sim"})

    async def tokenize(self, request: web.Request) -> web.Response:
        """POST /tokenize: prompt or messages, with the same defaults as generation."""
        try:
            body = await self.requests.body(request)
            self.requests.lora_for(body)
            if "messages" in body:
                ids = self.requests.chat_prompt(body)
            else:
                prompt = body.get("prompt")
                if not isinstance(prompt, str):
                    raise RequestError("Field 'prompt' (a string) or 'messages' is required.", param="prompt")
                ids = self.tokenizer.encode(prompt, add_special_tokens=bool(body.get("add_special_tokens", True)))
        except RequestError as exc:
            return error_response(str(exc), exc.status, exc.err_type, exc.param)
        strs = [self.tokenizer.tokenizer.id_to_token(i) for i in ids] if body.get("return_token_strs") else None
        out: dict[str, Any] = {"count": len(ids), "max_model_len": self.engine.config.max_model_len, "tokens": ids,
                               "token_strs": strs}  # vLLM always sends the key (null unless asked)
        return web.Response(body=_json_encode(out), content_type="application/json")

    async def detokenize(self, request: web.Request) -> web.Response:
        """POST /detokenize."""
        try:
            body = await self.requests.body(request)
            tokens = body.get("tokens")
            if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
                raise RequestError("Field 'tokens' must be a list of integers.", param="tokens")
        except RequestError as exc:
            return error_response(str(exc), exc.status, exc.err_type, exc.param)
        return web.json_response({"prompt": self.tokenizer.decode(tokens)})

    async def metrics(self, request: web.Request) -> web.Response:
        """GET /metrics in the Prometheus text format."""
        e = self.engine
        cpu = e.cache.cpu
        text = self._renderer.render(
            running=len(e.running), waiting=len(e.waiting), kv_usage=e.cache.usage,
            sleep_level=e.sleep_level if e.sleeping else None, m=e.metrics,
            cpu_usage=(len(cpu.blocks) / cpu.capacity) if cpu is not None else None) + self.pd.render_metrics()
        return web.Response(text=text, content_type="text/plain", charset="utf-8",
                            headers={"X-Content-Type-Options": "nosniff"})

    async def sleep(self, request: web.Request) -> web.Response:
        """POST /sleep?level=0|1|2."""
        try:
            level = int(request.query.get("level", "1"))
        except ValueError:
            return error_response("'level' must be an integer.")
        if level not in (0, 1, 2):
            return error_response("'level' must be 0, 1 or 2.")
        self.engine.sleep(level)
        return web.json_response({"status": "sleeping", "level": level})

    async def wake_up(self, request: web.Request) -> web.Response:
        """POST /wake_up: answers once awake, after the profile's wake time (weights back on the GPU)."""
        if self.config.wake_error:
            return error_response(self.config.wake_error, 500, "InternalServerError")
        e = self.engine
        if e.sleeping:
            await asyncio.sleep(e.profile.wake_seconds * e.config.time_scale)
        e.wake_up()
        tags = request.query.getall("tags", None)
        return web.json_response({"status": "awake", "tags": tags})

    async def is_sleeping(self, request: web.Request) -> web.Response:
        """GET /is_sleeping."""
        return web.json_response({"is_sleeping": self.engine.sleeping})

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        """POST /reset_prefix_cache."""
        self.engine.reset_prefix_cache()
        return web.json_response({"success": True})

    async def kv_event_sources(self, request: web.Request) -> web.Response:
        """GET /kv_event_sources: the resolved KV-events config, keyed by DP rank."""
        p = self.publisher
        if p is None:
            return web.json_response({})
        return web.json_response({"0": {"enable_kv_cache_events": True, "publisher": "zmq",
                                        "endpoint": p.bound_endpoint, "replay_endpoint": p.replay_bound_endpoint,
                                        "topic": p.topic}})

    async def sim_state(self, request: web.Request) -> web.Response:
        """GET /sim/state: simulator internals (not a vLLM route) for demos, tests and benchmarks."""
        e = self.engine
        c = e.cache
        p = self.publisher
        state = {
            "replica": self.config.name,
            "running": len(e.running),
            "waiting": len(e.waiting),
            "sleeping": e.sleeping,
            "steps": e.steps,
            "lag_resyncs": e.lag_resyncs,
            "sim_time": e.now(),
            "slowdown": e.slowdown,
            "prefill_per_token": e.profile.prefill_per_token,
            "gpu": {"capacity": c.capacity, "cached": len(c.cached), "used": c.used_blocks, "evicted": c.gpu_evicted},
            "cpu": None if c.cpu is None else {"capacity": c.cpu.capacity, "blocks": len(c.cpu.blocks),
                                               "evicted": c.cpu.evicted},
            "disk": None if c.disk is None else {"capacity": c.disk.capacity, "blocks": len(c.disk.blocks),
                                                 "evicted": c.disk.evicted, "eviction_runs": c.disk.evictions_runs},
            "kv_events": None if p is None else {"published": p.published, "dropped": p.dropped},
            "pd": self.pd.state(),
            "responses": self.responses.store.state(),
        }
        return web.json_response(state)

    async def sim_speed(self, request: web.Request) -> web.Response:
        """POST /sim/speed?slowdown=2: from now on run 2x slower than the profile (not a vLLM route)."""
        try:
            self.engine.set_speed(float(request.query.get("slowdown", "1")))
        except ValueError as exc:
            return error_response(f"'slowdown' must be a number > 0: {exc}")
        return web.json_response({"slowdown": self.engine.slowdown,
                                  "prefill_per_token": self.engine.profile.prefill_per_token})

    def _lora_info(self) -> tuple[int, list[str], list[str]]:
        e = self.engine
        running = sorted({r.ctx.lora_name for r in e.running if r.ctx.lora_name})
        waiting = sorted({r.ctx.lora_name for r in e.waiting if r.ctx.lora_name})
        return self.config.max_loras, waiting, running


def _request_id(body: dict[str, Any], prefix: str) -> str:
    rid = body.get("request_id")
    return rid if isinstance(rid, str) and rid else f"{prefix}-{uuid.uuid4().hex}"
