"""OpenAI's Responses API on a simulated replica: `POST /v1/responses`, `GET /v1/responses/{id}`.

As vLLM serves it: the input (a string, or message items whose content is a string or
`input_text`/`output_text` parts) becomes chat messages, after the `instructions` as a system
message; with `previous_response_id` the messages of that earlier response and its output come
first, so a follow-up's prompt extends the previous one's and finds it in the prefix cache of the
replica that answered it. Each replica keeps only the responses it produced (`store`, default
true), bounded: the least recently used is dropped past `max_stored_responses`. An id it does not
hold is answered as vLLM answers it, 404 `Response with id '<id>' not found.`, so a follow-up sent to
the wrong replica is visible. Streaming sends the Responses events (`response.created` ...
`response.completed`) as `event:`/`data:` pairs.

Usage: `input_tokens`, `input_tokens_details.cached_tokens` (the prompt tokens the prefix cache
held), `output_tokens`, `output_tokens_details.reasoning_tokens` (0), `total_tokens`.
"""

from __future__ import annotations

import collections
import time
import uuid
from typing import TYPE_CHECKING, Any

import msgspec
from aiohttp import web

from epp.engine.sim.engine import EngineError, SimRequest
from epp.engine.sim.hashing import HashContext
from epp.engine.sim.request_parsing import RequestError, error_response, validate_salt

if TYPE_CHECKING:
    from epp.engine.sim.replica_api import Replica

_json_encode = msgspec.json.Encoder().encode
# Content part types whose text enters the prompt (images and files are not rendered by the simulator).
_TEXT_PARTS = frozenset({"input_text", "output_text", "text"})


class ResponseStore:
    """The responses one replica produced, by id, least recently used dropped past `capacity`."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"the response store needs a capacity of at least 1, got {capacity}")
        self.capacity = capacity
        self._entries: collections.OrderedDict[str, tuple[list[dict[str, Any]], dict[str, Any]]] = \
            collections.OrderedDict()
        self.evicted = 0
        self.not_found = 0

    def put(self, response_id: str, messages: list[dict[str, Any]], response: dict[str, Any]) -> None:
        """Keep a response and the messages its prompt was made of."""
        self._entries[response_id] = (messages, response)
        self._entries.move_to_end(response_id)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)
            self.evicted += 1

    def get(self, response_id: str) -> tuple[list[dict[str, Any]], dict[str, Any]] | None:
        """The messages and response stored under `response_id` (None, counted, when not held)."""
        entry = self._entries.get(response_id)
        if entry is None:
            self.not_found += 1
            return None
        self._entries.move_to_end(response_id)
        return entry

    def state(self) -> dict[str, int]:
        """Counts for `/sim/state`."""
        return {"stored": len(self._entries), "capacity": self.capacity, "evicted": self.evicted,
                "not_found": self.not_found}


def not_found(response_id: str) -> web.Response:
    """vLLM's answer for a response id this server does not hold."""
    return error_response(f"Response with id '{response_id}' not found.", 404, "invalid_request_error",
                          "response_id")


def _content(content: Any, param: str) -> str | list[dict[str, Any]]:
    """A message's content for the chat template: a string, or its text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"'{param}.content' must be a string or a list of content parts.", param=param)
    parts = []
    for part in content:
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise RequestError(f"Each part of '{param}.content' must be an object with a 'type'.", param=param)
        if part["type"] in _TEXT_PARTS:
            text = part.get("text")
            if not isinstance(text, str):
                raise RequestError(f"A '{part['type']}' part of '{param}.content' needs a 'text' string.",
                                   param=param)
            parts.append({"type": "text", "text": text})
    return parts


def input_messages(value: Any) -> list[dict[str, Any]]:
    """The chat messages of a Responses `input` (a string, or a list of items)."""
    if isinstance(value, str):
        if not value:
            raise RequestError("'input' must not be empty.", param="input")
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise RequestError("'input' must be a string or a non-empty list of items.", param="input")
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        param = f"input[{i}]"
        if not isinstance(item, dict):
            raise RequestError(f"'{param}' must be an object.", param="input")
        kind = item.get("type", "message")
        if kind == "message" and isinstance(item.get("role"), str):
            messages.append({"role": item["role"], "content": _content(item.get("content"), param)})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "content": output if isinstance(output, str) else _json_text(output)})
        elif kind == "function_call":
            messages.append({"role": "assistant",
                             "content": f"{item.get('name', '')}({item.get('arguments', '')})"})
        elif kind == "message":
            raise RequestError(f"'{param}' is a message without a 'role'.", param="input")
        # Other items (reasoning, ...) carry nothing the prompt renders.
    if not messages:
        raise RequestError("'input' holds no message.", param="input")
    return messages


def _json_text(value: Any) -> str:
    return _json_encode(value).decode()


class ResponsesRoutes:
    """`POST /v1/responses` and `GET /v1/responses/{response_id}` of one replica."""

    def __init__(self, replica: Replica, capacity: int) -> None:
        self.replica = replica
        self.store = ResponseStore(capacity)

    def attach(self, app: web.Application) -> None:
        """Add the routes to the replica's application."""
        app.router.add_post("/v1/responses", self.create)
        app.router.add_get("/v1/responses/{response_id}", self.retrieve)

    async def retrieve(self, request: web.Request) -> web.Response:
        """GET /v1/responses/{id}: a stored response."""
        response_id = request.match_info["response_id"]
        if not response_id.startswith("resp"):
            return error_response(f"Invalid 'response_id': '{response_id}'. Expected an ID that begins with 'resp'.",
                                  400, "invalid_request_error", "response_id")
        entry = self.store.get(response_id)
        if entry is None:
            return not_found(response_id)
        return web.Response(body=_json_encode(entry[1]), content_type="application/json")

    async def create(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/responses."""
        replica = self.replica
        reader = replica.requests
        try:
            body = await reader.body(request)
            lora_name, lora_path = reader.lora_for(body)
            ctx = HashContext(cache_salt=validate_salt(body.get("cache_salt")), lora_name=lora_name,
                              lora_path=lora_path)
            stream = body.get("stream", False)
            if not isinstance(stream, bool):
                raise RequestError("'stream' must be a boolean.", param="stream")
            store = body.get("store", True)
            if not isinstance(store, bool):
                raise RequestError("'store' must be a boolean.", param="store")
            messages: list[dict[str, Any]] = []
            instructions = body.get("instructions")
            if instructions is not None:
                if not isinstance(instructions, str):
                    raise RequestError("'instructions' must be a string.", param="instructions")
                messages.append({"role": "system", "content": instructions})
            previous_id = body.get("previous_response_id")
            if previous_id is not None:
                if not isinstance(previous_id, str) or not previous_id:
                    raise RequestError("'previous_response_id' must be a non-empty string.",
                                       param="previous_response_id")
                previous = self.store.get(previous_id)
                if previous is None:
                    return not_found(previous_id)
                messages.extend(previous[0])
                messages.extend({"role": "assistant", "content": text} for text in _output_texts(previous[1]))
            messages.extend(input_messages(body.get("input")))
            ids = reader.chat_prompt({"messages": messages, "tools": body.get("tools"),
                                      "chat_template_kwargs": body.get("chat_template_kwargs")})
            max_tokens = reader.int_field(body, "max_output_tokens")
            response_id = f"resp_{uuid.uuid4().hex}"
            r = replica.engine.new_request(ids, max_tokens, stream=stream, ctx=ctx,
                                           natural_len=replica.natural_len(ids), request_id=response_id)
            replica.pd.accept(r, body)
        except RequestError as exc:
            return error_response(str(exc), exc.status, exc.err_type, exc.param)
        except EngineError as exc:
            return error_response(str(exc))
        head = {"id": response_id, "object": "response", "created_at": int(time.time()),
                "model": body.get("model") or replica.config.model,
                "instructions": instructions, "max_output_tokens": max_tokens,
                "previous_response_id": previous_id, "store": store, "metadata": body.get("metadata") or {},
                "parallel_tool_calls": True, "tool_choice": body.get("tool_choice", "auto"),
                "tools": body.get("tools") or [], "temperature": body.get("temperature"),
                "top_p": body.get("top_p"), "truncation": "disabled", "user": body.get("user"),
                "text": {"format": {"type": "text"}}, "reasoning": None, "background": False,
                "error": None, "incomplete_details": None}
        item_id = f"msg_{uuid.uuid4().hex}"
        if stream:
            return await self._stream(request, r, head, item_id, messages)
        text_ids: list[int] = []
        async for new in replica.generate(r):
            text_ids.extend(new)
        if r.finish_reason == "abort":
            return error_response("The request was aborted by the engine.", 503, "ServiceUnavailableError")
        response = self._final(r, head, item_id, replica.text_of(text_ids))
        if store:
            self.store.put(response_id, messages, response)
        return web.Response(body=_json_encode(response), content_type="application/json")

    def _usage(self, r: SimRequest) -> dict[str, Any]:
        cached, _ = self.replica.cached_usage(r)
        prompt, output = len(r.prompt_ids), len(r.output)
        return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached},
                "output_tokens": output, "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": prompt + output}

    def _final(self, r: SimRequest, head: dict[str, Any], item_id: str, text: str) -> dict[str, Any]:
        """The whole response object once generation ended."""
        incomplete = r.finish_reason == "length"
        return {**head, "status": "incomplete" if incomplete else "completed",
                "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
                "output": [_message_item(item_id, text, "incomplete" if incomplete else "completed")],
                "usage": self._usage(r)}

    async def _stream(self, request: web.Request, r: SimRequest, head: dict[str, Any], item_id: str,
                      messages: list[dict[str, Any]]) -> web.StreamResponse:
        replica = self.replica
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        sequence = 0

        def event(kind: str, **fields: Any) -> bytes:
            nonlocal sequence
            data = {"type": kind, "sequence_number": sequence, **fields}
            sequence += 1
            return b"event: " + kind.encode() + b"\ndata: " + _json_encode(data) + b"\n\n"

        started = {**head, "status": "in_progress", "output": [], "usage": None}
        place = {"item_id": item_id, "output_index": 0, "content_index": 0}
        await resp.write(event("response.created", response=started)
                         + event("response.in_progress", response=started))
        text_ids: list[int] = []
        opened = False
        async for new in replica.generate(r):
            parts = []
            if not opened:
                opened = True
                parts.append(event("response.output_item.added", output_index=0,
                                   item=_message_item(item_id, None, "in_progress")))
                parts.append(event("response.content_part.added", **place, part=_text_part("")))
            for token in new:
                parts.append(event("response.output_text.delta", **place, delta=replica.text_of([token]),
                                   logprobs=[]))
            text_ids.extend(new)
            await resp.write(b"".join(parts))
        if r.finish_reason == "abort":
            await resp.write(event("response.failed", response={**started, "status": "failed", "error": {
                "code": "server_error", "message": "The request was aborted by the engine."}}))
            await resp.write_eof()
            return resp
        text = replica.text_of(text_ids)
        final = self._final(r, head, item_id, text)
        tail = [event("response.output_text.done", **place, text=text, logprobs=[]),
                event("response.content_part.done", **place, part=_text_part(text)),
                event("response.output_item.done", output_index=0, item=final["output"][0]),
                # vLLM ends every stream with response.completed, its response "incomplete" when cut short.
                event("response.completed", response=final)]
        if not opened:  # nothing generated: the item still opens before it closes
            tail[:0] = [event("response.output_item.added", output_index=0,
                              item=_message_item(item_id, None, "in_progress")),
                        event("response.content_part.added", **place, part=_text_part(""))]
        await resp.write(b"".join(tail))
        await resp.write_eof()
        if head["store"]:
            self.store.put(head["id"], messages, final)
        return resp


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "message", "status": status, "role": "assistant",
            "content": [] if text is None else [_text_part(text)]}


def _output_texts(response: dict[str, Any]) -> list[str]:
    """The text of each output message of a stored response (what a follow-up's prompt continues)."""
    texts = []
    for item in response.get("output") or []:
        if item.get("type") == "message":
            texts.extend(part["text"] for part in item.get("content") or [] if part.get("type") == "output_text")
    return texts
