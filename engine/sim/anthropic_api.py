"""Anthropic's Messages API on a simulated replica: `POST /v1/messages`, `POST /v1/messages/count_tokens`.

As vLLM serves it: the `system` text (a string, or its text blocks joined) becomes a system
message, each message's text blocks its content (`tool_result` blocks a tool message; images and
thinking are not rendered), and the chat template makes the prompt; `max_tokens` is required.
Streaming sends Anthropic's events: `message_start`, `content_block_start`, `content_block_delta`
(`text_delta`), `content_block_stop`, `message_delta` (stop reason and usage), `message_stop`.
Errors have Anthropic's shape, `{"type": "error", "error": {"type", "message"}}`.

Usage: vLLM reports `input_tokens` (the whole prompt) and `output_tokens`. With
`--enable-prompt-tokens-details` the simulator splits the prompt as Anthropic's API counts it:
`cache_read_input_tokens` (found in the prefix cache), `cache_creation_input_tokens` (full blocks
this request added to it) and `input_tokens` (the rest), so prefix-cache hits show through the
Anthropic SDK. `count_tokens` answers `{"input_tokens": N}` with vLLM's `context_management`.
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Any

import msgspec
from aiohttp import web

from epp.engine.sim.engine import EngineError, SimRequest
from epp.engine.sim.hashing import HashContext
from epp.engine.sim.request_parsing import RequestError, validate_salt

if TYPE_CHECKING:
    from epp.engine.sim.replica_api import Replica

_json_encode = msgspec.json.Encoder().encode
ROLES = ("user", "assistant", "system")
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens"}
# Anthropic's error types by HTTP status.
_ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 413: "request_too_large",
                503: "overloaded_error"}


def anthropic_error(message: str, status: int = 400) -> web.Response:
    """An error in Anthropic's shape."""
    body = {"type": "error", "error": {"type": _ERROR_TYPES.get(status, "api_error"), "message": message}}
    return web.Response(status=status, body=_json_encode(body), content_type="application/json")


def _blocks_text(blocks: list[Any], where: str) -> list[dict[str, Any]]:
    parts = []
    for i, block in enumerate(blocks):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise RequestError(f"{where}[{i}]: a content block must be an object with a 'type'.")
        if block["type"] == "text":
            text = block.get("text")
            if not isinstance(text, str):
                raise RequestError(f"{where}[{i}]: a text block needs a 'text' string.")
            parts.append({"type": "text", "text": text})
    return parts


def chat_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The chat messages of a Messages body (its `system`, then its `messages`); RequestError when malformed."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages: must be a non-empty list.")
    out: list[dict[str, Any]] = []
    system = body.get("system")
    if isinstance(system, str):
        system_text = system
    elif isinstance(system, list):
        system_text = "".join(p["text"] for p in _blocks_text(system, "system"))
    elif system is None:
        system_text = ""
    else:
        raise RequestError("system: must be a string or a list of text blocks.")
    if system_text:
        out.append({"role": "system", "content": system_text})
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise RequestError(f"{where}: must be an object whose role is one of {', '.join(ROLES)}.")
        content = message["content"] if "content" in message else None
        if isinstance(content, str):
            out.append({"role": message["role"], "content": content})
        elif isinstance(content, list):
            if not content:
                raise RequestError(f"{where}: message content must not be empty.")
            for j, block in enumerate(content):
                if isinstance(block, dict) and block.get("type") == "tool_result":
                    result = block.get("content")
                    text = result if isinstance(result, str) else "\n".join(
                        p["text"] for p in _blocks_text(result or [], f"{where}.content[{j}].content"))
                    out.append({"role": "tool", "content": text})
            text_parts = _blocks_text(content, f"{where}.content")
            if text_parts or message["role"] != "user":
                out.append({"role": message["role"], "content": text_parts})
        else:
            raise RequestError(f"{where}.content: must be a string or a list of content blocks.")
    return out


class AnthropicRoutes:
    """`POST /v1/messages` and `POST /v1/messages/count_tokens` of one replica."""

    def __init__(self, replica: Replica) -> None:
        self.replica = replica

    def attach(self, app: web.Application) -> None:
        """Add the routes to the replica's application."""
        app.router.add_post("/v1/messages", self.messages)
        app.router.add_post("/v1/messages/count_tokens", self.count_tokens)

    def _prompt(self, body: dict[str, Any]) -> list[int]:
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise RequestError("model: Field required (a non-empty string).")
        self.replica.requests.lora_for(body)
        return self.replica.requests.chat_prompt({"messages": chat_messages(body), "tools": body.get("tools"),
                                                  "chat_template_kwargs": body.get("chat_template_kwargs")})

    async def count_tokens(self, request: web.Request) -> web.Response:
        """POST /v1/messages/count_tokens: the prompt's token count, nothing generated."""
        try:
            ids = self._prompt(await self.replica.requests.body(request))
        except RequestError as exc:
            return anthropic_error(str(exc), exc.status)
        return web.json_response({"input_tokens": len(ids), "context_management": {"original_input_tokens": len(ids)}})

    async def messages(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/messages."""
        replica = self.replica
        try:
            body = await replica.requests.body(request)
            ids = self._prompt(body)
            max_tokens = body.get("max_tokens")
            if not isinstance(max_tokens, int) or isinstance(max_tokens, bool):
                raise RequestError("max_tokens: Field required (an integer).")
            if max_tokens <= 0:
                raise RequestError("max_tokens: must be positive.")
            stream = body.get("stream", False)
            if not isinstance(stream, bool):
                raise RequestError("stream: must be a boolean.")
            lora_name, lora_path = replica.requests.lora_for(body)
            ctx = HashContext(cache_salt=validate_salt(body.get("cache_salt")), lora_name=lora_name,
                              lora_path=lora_path)
            r = replica.engine.new_request(ids, max_tokens, stream=stream, ctx=ctx,
                                           natural_len=replica.natural_len(ids),
                                           request_id=f"msg_{uuid.uuid4().hex}")
            replica.pd.accept(r, body)
        except RequestError as exc:
            return anthropic_error(str(exc), exc.status)
        except EngineError as exc:
            return anthropic_error(str(exc))
        model = body["model"]
        if stream:
            return await self._stream(request, r, model)
        output: list[int] = []
        async for new in replica.generate(r):
            output.extend(new)
        if r.finish_reason == "abort":
            return anthropic_error("The request was aborted by the engine.", 503)
        answer = {"id": r.request_id, "type": "message", "role": "assistant",
                  "content": [{"type": "text", "text": replica.text_of(output)}], "model": model,
                  "stop_reason": STOP_REASONS.get(r.finish_reason or "", "end_turn"), "stop_sequence": None,
                  "usage": self._usage(r), "kv_transfer_params": replica.pd.response_params(r)}
        return web.Response(body=_json_encode(answer), content_type="application/json")

    def _usage(self, r: SimRequest, output_tokens: int | None = None) -> dict[str, Any]:
        """vLLM's usage; with prompt-token details, the prompt split as Anthropic counts it."""
        output = len(r.output) if output_tokens is None else output_tokens
        prompt = len(r.prompt_ids)
        if not self.replica.config.enable_prompt_tokens_details:
            return {"input_tokens": prompt, "output_tokens": output}
        cached, created = self.replica.cached_usage(r)
        return {"input_tokens": prompt - cached, "cache_creation_input_tokens": created,
                "cache_read_input_tokens": cached, "output_tokens": output}

    async def _stream(self, request: web.Request, r: SimRequest, model: str) -> web.StreamResponse:
        replica = self.replica
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)

        def event(kind: str, **fields: Any) -> bytes:
            return b"event: " + kind.encode() + b"\ndata: " + _json_encode({"type": kind, **fields}) + b"\n\n"

        started = False

        def start() -> list[bytes]:
            message = {"id": r.request_id, "type": "message", "role": "assistant", "content": [], "model": model,
                       "stop_reason": None, "stop_sequence": None, "usage": self._usage(r, 0)}
            return [event("message_start", message=message),
                    event("content_block_start", index=0, content_block={"type": "text", "text": ""})]

        async for new in replica.generate(r):
            parts = [] if started else start()
            started = True
            parts.extend(event("content_block_delta", index=0, delta={"type": "text_delta",
                                                                      "text": replica.text_of([t])})
                         for t in new)
            await resp.write(b"".join(parts))
        if r.finish_reason == "abort":
            await resp.write(event("error", error={"type": "overloaded_error",
                                                   "message": "The request was aborted by the engine."}))
            await resp.write_eof()
            return resp
        tail = [] if started else start()
        tail += [event("content_block_stop", index=0),
                 event("message_delta", delta={"stop_reason": STOP_REASONS.get(r.finish_reason or "", "end_turn"),
                                               "stop_sequence": None}, usage=self._usage(r)),
                 event("message_stop")]
        await resp.write(b"".join(tail))
        await resp.write_eof()
        return resp

