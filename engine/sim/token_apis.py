"""Token-in, token-out APIs on a simulated replica: vLLM's `/inference/v1/generate`, SGLang's `/generate`.

- vLLM (`vllm/entrypoints/serve/disagg`, what llm-d's coordinator calls after rendering the chat;
  a scale-out route, so served with `--enable-scale-out` only, 403 otherwise, as vLLM does):
  `{"token_ids": [...], "sampling_params": {"max_tokens": N, ...}, "model"?, "stream"?,
  "stream_options"?, "cache_salt"?, "kv_transfer_params"?, "request_id"?}` answers
  `{"request_id", "choices": [{"index", "logprobs", "finish_reason", "token_ids"}], "usage",
  "prompt_logprobs", "kv_transfer_params"}`; a stream sends one `data:` chunk per step's tokens,
  the usage chunk when `stream_options.include_usage`, then `data: [DONE]`. Usage as vLLM's:
  `prompt_tokens_details.cached_tokens` only with `--enable-prompt-tokens-details` and a hit.
- SGLang: `{"text": "..."}` or `{"input_ids": [...]}`, `"sampling_params": {"max_new_tokens": N}`
  (default 128), `"stream"?`, `"rid"?` answers `{"text", "output_ids", "meta_info": {"id",
  "finish_reason": {"type": "length", "length": N} or {"type": "stop", "matched": <eos id>},
  "prompt_tokens", "completion_tokens", "cached_tokens", "e2e_latency"}}`; a stream sends the text
  and ids so far in each `data:` chunk, then `data: [DONE]`. One prompt per request (SGLang's
  batched lists are refused).
"""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Any

import msgspec
from aiohttp import web

from epp.engine.sim.engine import EngineError, SimRequest
from epp.engine.sim.hashing import HashContext
from epp.engine.sim.request_parsing import RequestError, error_response, validate_salt
from epp.engine.sim.scale_out import GENERATE_ROUTE

if TYPE_CHECKING:
    from epp.engine.sim.replica_api import Replica

_json_encode = msgspec.json.Encoder().encode
SGLANG_DEFAULT_MAX_NEW_TOKENS = 128


def _token_ids(value: Any, param: str) -> list[int]:
    if not isinstance(value, list) or not value or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value):
        raise RequestError(f"'{param}' must be a non-empty list of token ids.", param=param)
    return list(value)


def _object(body: dict[str, Any], name: str, *, required: bool) -> dict[str, Any]:
    value = body.get(name)
    if value is None and not required:
        return {}
    if not isinstance(value, dict):
        raise RequestError(f"'{name}' must be an object.", param=name)
    return value


def _int_or_none(params: dict[str, Any], name: str, where: str) -> int | None:
    value = params.get(name)
    if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
        raise RequestError(f"'{where}.{name}' must be an integer.", param=f"{where}.{name}")
    return value


class TokenRoutes:
    """`POST /inference/v1/generate` (vLLM) and `POST /generate` (SGLang) of one replica."""

    def __init__(self, replica: Replica) -> None:
        self.replica = replica

    def attach(self, app: web.Application) -> None:
        """Add the routes to the replica's application."""
        # vLLM serves it with --enable-scale-out only (scale_out.py answers 403 without it).
        if self.replica.config.enable_scale_out:
            app.router.add_post(GENERATE_ROUTE, self.vllm_generate)
        app.router.add_post("/generate", self.sglang_generate)

    def _context(self, body: dict[str, Any]) -> HashContext:
        lora_name, lora_path = self.replica.requests.lora_for(body)
        return HashContext(cache_salt=validate_salt(body.get("cache_salt")), lora_name=lora_name, lora_path=lora_path)

    # -- vLLM -----------------------------------------------------------------------------------
    async def vllm_generate(self, request: web.Request) -> web.StreamResponse:
        """POST /inference/v1/generate: token ids in, token ids out."""
        replica = self.replica
        try:
            body = await replica.requests.body(request)
            ids = _token_ids(body.get("token_ids"), "token_ids")
            params = _object(body, "sampling_params", required=True)
            if params.get("n", 1) != 1:
                raise RequestError("'sampling_params.n' must be 1 on this route.", param="sampling_params.n")
            max_tokens = _int_or_none(params, "max_tokens", "sampling_params")
            stream = body.get("stream") or False
            if not isinstance(stream, bool):
                raise RequestError("'stream' must be a boolean.", param="stream")
            options = _object(body, "stream_options", required=False)
            if options and not stream:
                raise RequestError("Stream options can only be defined when `stream=True`.", param="stream_options")
            given = body.get("request_id")
            request_id = f"generate-tokens-{given if isinstance(given, str) and given else uuid.uuid4().hex}"
            r = replica.engine.new_request(ids, max_tokens, stream=stream, ctx=self._context(body),
                                           natural_len=replica.natural_len(ids), request_id=request_id)
            replica.pd.accept(r, body)
        except RequestError as exc:
            return error_response(str(exc), exc.status, exc.err_type, exc.param)
        except EngineError as exc:
            return error_response(str(exc))
        if stream:
            return await self._vllm_stream(request, r, bool(options.get("include_usage", False)))
        output: list[int] = []
        async for new in replica.generate(r):
            output.extend(new)
        if r.finish_reason == "abort":
            return error_response("The request was aborted by the engine.", 503, "ServiceUnavailableError")
        answer = {"request_id": r.request_id,
                  "choices": [{"index": 0, "logprobs": None, "finish_reason": r.finish_reason, "token_ids": output}],
                  "usage": self._vllm_usage(r), "prompt_logprobs": None,
                  "kv_transfer_params": replica.pd.response_params(r)}
        return web.Response(body=_json_encode(answer), content_type="application/json")

    def _vllm_usage(self, r: SimRequest) -> dict[str, Any]:
        prompt, output = len(r.prompt_ids), len(r.output)
        usage: dict[str, Any] = {"prompt_tokens": prompt, "total_tokens": prompt + output, "completion_tokens": output}
        if self.replica.config.enable_prompt_tokens_details and r.num_cached_tokens:
            usage["prompt_tokens_details"] = {"cached_tokens": r.num_cached_tokens}
        return usage

    async def _vllm_stream(self, request: web.Request, r: SimRequest, include_usage: bool) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        async for new in self.replica.generate(r):
            finish = r.finish_reason if r.finished and r.finish_reason != "abort" else None
            chunk = {"request_id": r.request_id,
                     "choices": [{"index": 0, "logprobs": None, "finish_reason": finish, "token_ids": new}]}
            await resp.write(b"data: " + _json_encode(chunk) + b"\n\n")
        if include_usage and r.finish_reason != "abort":
            usage_chunk = {"request_id": r.request_id, "choices": [], "usage": self._vllm_usage(r)}
            await resp.write(b"data: " + _json_encode(usage_chunk) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    # -- SGLang ---------------------------------------------------------------------------------
    async def sglang_generate(self, request: web.Request) -> web.StreamResponse:
        """POST /generate: SGLang's native generation (text or input ids in; text and ids out)."""
        replica = self.replica
        try:
            body = await replica.requests.body(request)
            if body.get("input_ids") is not None:
                ids = _token_ids(body["input_ids"], "input_ids")
            elif isinstance(body.get("text"), str) and body["text"]:
                ids = replica.tokenizer.encode(body["text"])
            else:
                raise RequestError("Either 'text' (a non-empty string) or 'input_ids' (a list of token ids) is "
                                   "required; batches are not served.", param="text")
            params = _object(body, "sampling_params", required=False)
            max_new = _int_or_none(params, "max_new_tokens", "sampling_params")
            stream = body.get("stream") or False
            if not isinstance(stream, bool):
                raise RequestError("'stream' must be a boolean.", param="stream")
            rid = body.get("rid")
            r = replica.engine.new_request(
                ids, SGLANG_DEFAULT_MAX_NEW_TOKENS if max_new is None else max_new, stream=stream,
                ctx=self._context(body), natural_len=None if params.get("ignore_eos") else replica.natural_len(ids),
                request_id=rid if isinstance(rid, str) and rid else uuid.uuid4().hex)
        except RequestError as exc:
            return error_response(str(exc), exc.status, exc.err_type, exc.param)
        except EngineError as exc:
            return error_response(str(exc))
        started = time.monotonic()
        if stream:
            return await self._sglang_stream(request, r, started)
        output: list[int] = []
        async for new in replica.generate(r):
            output.extend(new)
        if r.finish_reason == "abort":
            return error_response("The request was aborted by the engine.", 503, "ServiceUnavailableError")
        return web.Response(body=_json_encode(self._sglang_answer(r, output, started)), content_type="application/json")

    def _sglang_answer(self, r: SimRequest, output: list[int], started: float) -> dict[str, Any]:
        finish: dict[str, Any] | None = None
        if r.finish_reason == "length":
            finish = {"type": "length", "length": len(output)}
        elif r.finish_reason == "stop":
            finish = {"type": "stop", "matched": self.replica.tokenizer.eos_token_id}
        return {"text": self.replica.text_of(output), "output_ids": list(output),
                "meta_info": {"id": r.request_id, "finish_reason": finish, "prompt_tokens": len(r.prompt_ids),
                              "completion_tokens": len(output), "cached_tokens": r.num_cached_tokens,
                              "e2e_latency": time.monotonic() - started}}

    async def _sglang_stream(self, request: web.Request, r: SimRequest, started: float) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        output: list[int] = []
        async for new in self.replica.generate(r):
            output.extend(new)
            await resp.write(b"data: " + _json_encode(self._sglang_answer(r, output, started)) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp
