"""vLLM's scale-out routes (`/v1/completions/render` and the rest), off unless `--enable-scale-out`.

vLLM 0.32 registers these routes on every `vllm serve`; without `--enable-scale-out` each one
answers 403 `PermissionDeniedError` ("Scale-out endpoints are disabled..."). That matters to
routers: vllm-router (0.1.17) tokenizes for its `cache_aware` and `kv_aware` policies by POSTing
the request to `/v1/completions/render` (or `/v1/chat/completions/render`) first, falls back to
`/tokenize` only when that route is missing (404), and gives up on a 403 (its counter
`vllm_router_kv_routing_inputs_total{result="preparation_rejected"}`). A simulator that
answered 404 here would hand the router the `/tokenize` fallback a real replica never gives.

With `enable_scale_out` the two render routes answer like vLLM: a `GenerateRequest` object (a
list of one for completions) whose `token_ids` are the prompt exactly as generation would
tokenize it, and `/inference/v1/generate` (token ids in, token ids out) generates
(`token_apis.py`). The derender and messages/responses render routes are not simulated: they
answer 501 saying so.
"""

from __future__ import annotations

import uuid
from typing import Any

from aiohttp import web

from epp.engine.sim.request_parsing import RequestError, RequestReader, error_response

DISABLED_MESSAGE = "Scale-out endpoints are disabled. Restart vllm serve with --enable-scale-out to enable them."
RENDER_ROUTES = ("/v1/chat/completions/render", "/v1/messages/render", "/v1/completions/render",
                 "/v1/responses/render")
GENERATE_ROUTE = "/inference/v1/generate"  # served by token_apis.TokenRoutes when enabled
OTHER_ROUTES = ("/v1/chat/completions/derender", "/v1/completions/derender", GENERATE_ROUTE,
                "/inference/v1/abort_requests")
# vLLM's SamplingParams as /render dumps them when the request sets nothing else.
_SAMPLING_DEFAULTS: dict[str, Any] = {
    "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0, "temperature": 1.0,
    "top_p": 1.0, "min_p": 0.0,
}
_OUTPUT_KIND_DELTA, _OUTPUT_KIND_FINAL_ONLY = 1, 2  # vLLM's RequestOutputKind


def _sampling_params(body: dict[str, Any], max_tokens: int) -> dict[str, Any]:
    params = dict(_SAMPLING_DEFAULTS)
    for name in params:
        value = body.get(name)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            params[name] = float(value)
    stop = body.get("stop") or []
    params.update({
        "stop": [stop] if isinstance(stop, str) else list(stop),
        "stop_token_ids": list(body.get("stop_token_ids") or []),
        "max_tokens": max_tokens,
        "output_kind": _OUTPUT_KIND_DELTA if body.get("stream") else _OUTPUT_KIND_FINAL_ONLY,
        "skip_clone": True, "bad_words": [], "skip_reading_prefix_cache": False,
    })
    return params


def generate_request(prefix: str, model: str, token_ids: list[int], body: dict[str, Any],
                     max_tokens: int) -> dict[str, Any]:
    """The `GenerateRequest` object vLLM's /render returns for one prompt (its field order)."""
    return {
        "request_id": f"{prefix}-{uuid.uuid4().hex[:16]}", "token_ids": token_ids, "token_offsets": None,
        "features": None, "content_parts": None, "sampling_params": _sampling_params(body, max_tokens),
        "model": model, "reasoning_ended": None, "reasoning_parser_kwargs": None, "return_token_ids": None,
        "output_mode": "tokens", "stream": bool(body.get("stream", False)), "stream_options": body.get("stream_options"),
        "cache_salt": body.get("cache_salt"), "priority": int(body.get("priority") or 0),
        "kv_transfer_params": None, "ec_transfer_params": None,
    }


class ScaleOutRoutes:
    """The scale-out routes of one replica: 403 when disabled, the render routes when enabled."""

    def __init__(self, requests: RequestReader, max_model_len: int, enabled: bool) -> None:
        self.requests, self.max_model_len, self.enabled = requests, max_model_len, enabled

    def attach(self, app: web.Application) -> None:
        """Register every scale-out route vLLM registers."""
        for path in RENDER_ROUTES + OTHER_ROUTES:
            if self.enabled and path == GENERATE_ROUTE:
                continue  # the token-in/token-out route generates (token_apis.py)
            app.router.add_post(path, self._handler(path))

    def _handler(self, path: str):
        if not self.enabled:
            return self._disabled
        if path == "/v1/completions/render":
            return self.render_completion
        if path == "/v1/chat/completions/render":
            return self.render_chat
        return self._not_simulated

    async def _disabled(self, request: web.Request) -> web.Response:
        return error_response(DISABLED_MESSAGE, 403, "PermissionDeniedError")

    async def _not_simulated(self, request: web.Request) -> web.Response:
        return error_response(f"The simulator does not serve {request.path} (vLLM's scale-out API).", 501,
                              "NotImplementedError")

    async def render_completion(self, request: web.Request) -> web.Response:
        """POST /v1/completions/render: the prompt's token ids, as `[GenerateRequest]`."""
        requests = self.requests
        try:
            body = await requests.body(request)
            requests.common(body)
            ids = requests.completion_prompt(body)
            max_tokens = requests.int_field(body, "max_tokens")
        except RequestError as exc:
            return error_response(str(exc), exc.status, exc.err_type, exc.param)
        item = generate_request("cmpl", body.get("model") or requests.config.model, ids, body,
                                16 if max_tokens is None else max_tokens)
        return web.json_response([item])

    async def render_chat(self, request: web.Request) -> web.Response:
        """POST /v1/chat/completions/render: the templated prompt's token ids, as a `GenerateRequest`."""
        requests = self.requests
        try:
            body = await requests.body(request)
            requests.common(body)
            ids = requests.chat_prompt(body)
            max_tokens = requests.int_field(body, "max_completion_tokens", "max_tokens")
        except RequestError as exc:
            return error_response(str(exc), exc.status, exc.err_type, exc.param)
        room = self.max_model_len - len(ids)  # vLLM's default: whatever the context leaves
        item = generate_request("chatcmpl", body.get("model") or requests.config.model, ids, body,
                                room if max_tokens is None else max_tokens)
        return web.json_response(item)


__all__ = ["DISABLED_MESSAGE", "GENERATE_ROUTE", "OTHER_ROUTES", "RENDER_ROUTES", "ScaleOutRoutes", "generate_request"]
