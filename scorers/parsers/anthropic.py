"""`anthropic-parser`: Anthropic's Messages API (`/v1/messages`) and its token count (`/v1/messages/count_tokens`).

What it reads of a body: `model` (required), `system` (a string or a list of content blocks),
`messages` (each a `role` and a `content` that is a string or a list of content blocks: `text`,
`image`, `tool_use`, `tool_result`, `document`, `thinking`...), `tools`, `stream`, `cache_salt`
and the session `metadata.user_id`. The blocks' own fields are the model server's to check
(vLLM answers 400 for what it does not accept). `image` and `document` blocks are the request's
media (the digest of their `source`).

`count_tokens` is routed like a message (same prompt, so the same replica's tokenizer state is
as good as any), but it runs no model: no prefix is recorded for it and it books no prefill.
Errors are answered in Anthropic's shape (`{"type": "error", "error": {"type", "message"}}`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from epp.framework import (
    ErrorCode,
    InferenceError,
    InferenceRequest,
    MediaItem,
    ParsedBody,
    ParseLimits,
    Parser,
    RenderRequest,
    body_prompt_characters,
    decode_json_object,
    json_array_prefix,
    media_digest,
    read_json_or_none,
    session_name,
)

MESSAGES = "messages"
COUNT_TOKENS = "messages/count_tokens"
RENDER_PATH = "/v1/messages/render"
PROMPT_FIELDS = ("system", "messages")
# vLLM's Messages endpoint takes these roles (Anthropic's API itself only user and assistant).
ROLES = ("user", "assistant", "system")
# Claude Code's first system block carries a per-request hash; vLLM drops it from the prompt (so the
# rest stays cacheable), and so do the prefix bytes and the chat body here.
ANTHROPIC_BILLING_HEADER = "x-anthropic-billing-header"
# Content blocks whose `source` (base64 data, a URL, a file id) stands for the content, by modality.
SOURCE_BLOCKS = {"image": "image", "document": "file"}
# Anthropic stream events sent before any generated output.
PREAMBLE_EVENTS = frozenset({b"message_start", b"content_block_start", b"ping"})
# Anthropic's documented `error.type` per GIE code.
ERROR_TYPES: dict[ErrorCode, str] = {
    ErrorCode.BAD_REQUEST: "invalid_request_error",
    ErrorCode.UNAUTHORIZED: "authentication_error",
    ErrorCode.FORBIDDEN: "permission_error",
    ErrorCode.NOT_FOUND: "not_found_error",
    ErrorCode.REQUEST_TIMEOUT: "timeout_error",
    ErrorCode.PAYLOAD_TOO_LARGE: "request_too_large",
    ErrorCode.HEADERS_TOO_LARGE: "invalid_request_error",
    ErrorCode.RESOURCE_EXHAUSTED: "rate_limit_error",
    ErrorCode.INTERNAL: "api_error",
    ErrorCode.SERVICE_UNAVAILABLE: "overloaded_error",
}


# -- checks -----------------------------------------------------------------------------------------

def _blocks_problem(blocks: list[Any], where: str) -> str | None:
    for i, block in enumerate(blocks):
        if not isinstance(block, Mapping) or not isinstance(block.get("type"), str):
            return f"{where}[{i}] is not a content block (an object with a string type)"
    return None


def _message_problem(message: Any, where: str) -> str | None:
    if not isinstance(message, Mapping):
        return f"{where} is not an object"
    role = message.get("role")
    if role not in ROLES:
        return f"{where}.role must be one of {', '.join(ROLES)}"
    content = message.get("content")
    if isinstance(content, str):
        return None
    if isinstance(content, list):
        return _blocks_problem(content, f"{where}.content")
    return f"{where}.content must be a string or a list of content blocks"


def messages_body_problem(body: Mapping[str, Any]) -> str | None:
    """What is wrong with the `system` and `messages` of a Messages body, or None."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return "must have valid messages field"
    for i, message in enumerate(messages):
        problem = _message_problem(message, f"messages[{i}]")
        if problem is not None:
            return f"must have valid messages field: {problem}"
    system = body.get("system")
    if system is None or isinstance(system, str):
        return None
    if isinstance(system, list):
        problem = _blocks_problem(system, "system")
        return None if problem is None else f"must have valid system field: {problem}"
    return "must have valid system field: a string or a list of text blocks"


# -- the prompt as prefix hashing reads it ------------------------------------------------------------

def _identity_block(block: Any) -> Any:
    """A content block as it identifies the prompt: its source digested, prompt-caching marks left out.

    A base64 image or document is megabytes that would use up the prefix budget and say no more
    than its digest does; `cache_control` marks move from turn to turn without changing the prompt.
    """
    if not isinstance(block, Mapping):
        return block
    out = {key: value for key, value in block.items() if key != "cache_control"}
    if block.get("type") in SOURCE_BLOCKS and "source" in out:
        out["source"] = {"digest": media_digest(out["source"])}
    content = out.get("content")
    if isinstance(content, list):  # a tool_result's blocks
        out["content"] = [_identity_block(b) for b in content]
    return out


def _identity_system(system: Any) -> Any:
    if isinstance(system, str) and system.startswith(ANTHROPIC_BILLING_HEADER):
        return system.partition("\n")[2]
    if not isinstance(system, list):
        return system
    return [_identity_block(b) for b in system
            if not (isinstance(b, Mapping) and isinstance(b.get("text"), str)
                    and b["text"].startswith(ANTHROPIC_BILLING_HEADER))]


def identity_items(body: Mapping[str, Any]) -> Iterator[Any]:
    """A Messages body in prompt order: system, tools, then each message; made lazily (long chats stay cheap)."""
    yield {"system": _identity_system(body.get("system"))}
    tools = body.get("tools")
    yield {"tools": [_identity_block(t) for t in tools] if isinstance(tools, list) else tools}
    messages = body.get("messages")
    for message in messages if isinstance(messages, list) else ():
        if not isinstance(message, Mapping):
            yield message
            continue
        content = message.get("content")
        yield {"role": message.get("role"),
               "content": [_identity_block(b) for b in content] if isinstance(content, list) else content}


# -- the chat body vLLM renders ------------------------------------------------------------------------

def _without_billing_line(text: str) -> str:
    """A system text without its first line when that is Claude Code's billing header (vLLM drops it)."""
    return text.partition("\n")[2] if text.startswith(ANTHROPIC_BILLING_HEADER) else text


def _system_text(content: Any) -> str:
    """A system message's text: the string, or its text blocks joined (billing blocks left out)."""
    if isinstance(content, str):
        return content
    texts = [b.get("text") for b in content or () if isinstance(b, Mapping) and b.get("type") == "text"]
    return "".join(t for t in texts if isinstance(t, str) and t and not t.startswith(ANTHROPIC_BILLING_HEADER))


def _image_url(source: Any) -> str:
    source = source if isinstance(source, Mapping) else {}
    if source.get("type") == "url":
        return str(source.get("url", ""))
    return f"data:{source.get('media_type', 'image/jpeg')};base64,{source.get('data', '')}"


def _tool_result_messages(block: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A user's tool_result: a `tool` message with its text, then a user message with its images, if any."""
    content = block.get("content")
    images: list[str] = []
    if isinstance(content, list):
        texts = []
        for item in content:
            if isinstance(item, Mapping) and item.get("type") == "text":
                texts.append(str(item.get("text", "")))
            elif isinstance(item, Mapping) and item.get("type") == "image":
                images.append(_image_url(item.get("source")))
        content = "\n".join(texts)
    out: list[dict[str, Any]] = [{"role": "tool", "tool_call_id": block.get("tool_use_id") or "",
                                  "content": content if isinstance(content, str) else ""}]
    if images:
        out.append({"role": "user", "content": [{"type": "image_url", "image_url": {"url": u}} for u in images]})
    return out


def _chat_message(message: Mapping[str, Any], out: list[dict[str, Any]]) -> None:
    """Append one user or assistant message (and the tool messages its tool_result blocks become)."""
    role = message.get("role")
    content = message.get("content")
    msg: dict[str, Any] = {"role": role}
    if isinstance(content, str):
        msg["content"] = content
    else:
        parts: list[dict[str, Any]] = []
        tool_calls: list[dict[str, Any]] = []
        reasoning: list[str] = []
        for block in content if isinstance(content, list) else ():
            kind = block.get("type") if isinstance(block, Mapping) else None
            if kind == "text" and block.get("text"):
                parts.append({"type": "text", "text": block["text"]})
            elif kind == "image" and block.get("source"):
                parts.append({"type": "image_url", "image_url": {"url": _image_url(block["source"])}})
            elif kind == "thinking" and isinstance(block.get("thinking"), str):
                reasoning.append(block["thinking"])
            elif kind == "tool_use":
                tool_calls.append({"id": block.get("id") or "", "type": "function", "function": {
                    "name": block.get("name") or "", "arguments": json.dumps(block.get("input") or {})}})
            elif kind == "tool_result" and role == "user":
                out.extend(_tool_result_messages(block))
            elif kind == "tool_result":
                text = str(block.get("content")) if block.get("content") else ""
                parts.append({"type": "text", "text": f"Tool result: {text}"})
            # redacted_thinking, tool_reference, document and other blocks add nothing to vLLM's prompt.
        if reasoning:
            msg["reasoning"] = msg["reasoning_content"] = "".join(reasoning)
        if tool_calls:
            msg["tool_calls"] = tool_calls
        if len(parts) == 1 and parts[0]["type"] == "text":
            msg["content"] = parts[0]["text"]
        elif parts:
            msg["content"] = parts
    if role == "user" and "content" not in msg:
        return
    out.append(msg)


def _function_tool(tool: Mapping[str, Any]) -> dict[str, Any]:
    schema = dict(tool.get("input_schema") or {})
    schema.setdefault("type", "object")  # as vLLM completes a schema without one
    return {"type": "function", "function": {"name": tool.get("name"), "description": tool.get("description"),
                                             "parameters": schema}}


def anthropic_chat_body(body: Mapping[str, Any], *, merge_inline_system: bool = False) -> dict[str, Any]:
    """The chat body vLLM's `/v1/messages` renders for an Anthropic Messages body.

    The system prompt (its text blocks joined) becomes the first message; with
    `merge_inline_system` (templates that refuse a later system message) the text of system
    messages in `messages` is appended to it. Images become `image_url` parts, `tool_use` blocks
    an assistant's `tool_calls`, a user's `tool_result` blocks `tool` messages, `thinking` the
    assistant's `reasoning`; `tools` become function tools; `chat_template_kwargs` pass through.
    """
    raw_messages = body.get("messages")
    messages_in = [m for m in raw_messages if isinstance(m, Mapping)] if isinstance(raw_messages, list) else []
    system = body.get("system")
    system_parts = [_system_text(system)] if system else []
    if merge_inline_system:
        system_parts.extend(_system_text(m.get("content")) for m in messages_in if m.get("role") == "system")
    out: list[dict[str, Any]] = []
    if "".join(system_parts):
        out.append({"role": "system", "content": _without_billing_line("".join(system_parts))})
    for message in messages_in:
        if message.get("role") == "system":
            text = "" if merge_inline_system else _system_text(message.get("content"))
            if text:
                out.append({"role": "system", "content": _without_billing_line(text)})
        else:
            _chat_message(message, out)
    chat: dict[str, Any] = {"model": body.get("model"), "messages": out}
    tools = body.get("tools")
    if isinstance(tools, list):
        chat["tools"] = [_function_tool(t) for t in tools if isinstance(t, Mapping)]
    kwargs = body.get("chat_template_kwargs")
    if isinstance(kwargs, Mapping):
        chat["chat_template_kwargs"] = dict(kwargs)
    return chat


# -- usage --------------------------------------------------------------------------------------------

def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def openai_usage(usage: dict[str, Any]) -> dict[str, Any]:
    """Anthropic usage with OpenAI's names added (`input_tokens` leave out the tokens read from or written to cache)."""
    cached = _count(usage.get("cache_read_input_tokens"))
    out = dict(usage)
    if "input_tokens" in usage:
        out["prompt_tokens"] = _count(usage["input_tokens"]) + cached + _count(usage.get("cache_creation_input_tokens"))
    if "output_tokens" in usage:
        out["completion_tokens"] = _count(usage["output_tokens"])
    if "cache_read_input_tokens" in usage:
        out["prompt_tokens_details"] = {"cached_tokens": cached}
    return out


def only_preamble(chunk: bytes) -> bool:
    """Whether every SSE event of a chunk is one Anthropic sends before the first token (message_start...)."""
    if b"event:" not in chunk:
        return False
    names = [line[6:].strip() for line in chunk.split(b"\n") if line.startswith(b"event:")]
    return bool(names) and all(name in PREAMBLE_EVENTS for name in names)


class AnthropicParser(Parser):
    """Anthropic Messages (`/v1/messages`: system, messages of content blocks) and `/v1/messages/count_tokens`."""

    type_name = "anthropic-parser"
    paths = (("/messages/count_tokens", COUNT_TOKENS), ("/messages", MESSAGES))

    def parse(self, body: bytes, *, api: str, path: str, limits: ParseLimits) -> ParsedBody:
        parsed = decode_json_object(body, limits.max_json_depth)
        problem = messages_body_problem(parsed)
        if problem is not None:
            what = "count_tokens" if api == COUNT_TOKENS else "messages"
            raise InferenceError(ErrorCode.BAD_REQUEST, f"invalid {what} request: {problem}")
        model = parsed.get("model")
        if not isinstance(model, str) or not model:
            raise InferenceError(ErrorCode.BAD_REQUEST, "model not found in request body")
        salt = parsed.get("cache_salt")
        metadata = parsed.get("metadata")
        return ParsedBody(
            model=model, body=parsed, stream=parsed.get("stream") is True,
            cache_salt=salt if isinstance(salt, str) and salt else None,
            session=session_name(metadata.get("user_id") if isinstance(metadata, Mapping) else None),
            prompt_chars=body_prompt_characters(parsed, limits.max_prompt_chars + 1, PROMPT_FIELDS))

    # -- normalised views -----------------------------------------------------------------------

    def prompt_items(self, request: InferenceRequest) -> Sequence[Any]:
        system = request.body.get("system")
        messages = request.body.get("messages") or []
        return [{"role": "system", "content": system}, *messages] if system else messages

    def prompt_text(self, request: InferenceRequest) -> str:
        texts = []
        for item in self.prompt_items(request):
            content = item.get("content") if isinstance(item, Mapping) else None
            if isinstance(content, str):
                texts.append(content)
            elif isinstance(content, list):
                texts.extend(b["text"] for b in content if isinstance(b, Mapping) and isinstance(b.get("text"), str))
        return "\n".join(texts)

    def media(self, request: InferenceRequest) -> Sequence[MediaItem]:
        out = []
        for i, item in enumerate(self.prompt_items(request)):
            content = item.get("content") if isinstance(item, Mapping) else None
            for block in content if isinstance(content, list) else ():
                kind = block.get("type") if isinstance(block, Mapping) else None
                modality = SOURCE_BLOCKS.get(kind) if isinstance(kind, str) else None
                if modality is not None and "source" in block:
                    source = block["source"]
                    inline = source.get("data") if isinstance(source, Mapping) and source.get("type") == "base64" else None
                    out.append(MediaItem(modality, media_digest(source), i,
                                         inline=inline if isinstance(inline, str) else None))
        return out

    def prompt_bytes(self, request: InferenceRequest, limit: int | None) -> bytes:
        data = json_array_prefix(identity_items(request.body), limit)
        return data if limit is None else data[:limit]

    def generates(self, request: InferenceRequest) -> bool:
        return request.api != COUNT_TOKENS

    def chat_body(self, request: InferenceRequest, *, merge_inline_system: bool = False) -> Mapping[str, Any] | None:
        return anthropic_chat_body(request.body, merge_inline_system=merge_inline_system)

    def render_request(self, request: InferenceRequest, *, prefill_only: bool = False) -> RenderRequest | None:
        if request.api != MESSAGES:
            return None  # vLLM renders messages; a token count is a different body
        body = dict(request.body)
        if prefill_only:
            body["max_tokens"] = 1
        return RenderRequest(RENDER_PATH, body, chat=True)

    def operation(self, request: InferenceRequest) -> str | None:
        return "chat" if request.api == MESSAGES else None

    # -- responses ------------------------------------------------------------------------------

    def usage(self, request: InferenceRequest, body: bytes, *, streamed: bool) -> dict[str, Any] | None:
        if not streamed:
            parsed = read_json_or_none(body)
            usage = parsed.get("usage") if isinstance(parsed, dict) else None
            if not isinstance(usage, dict):
                return None
            return openai_usage(usage) if parsed.get("type") == "message" else usage
        if b"usage" not in body:
            return None
        for line in body.split(b"\n"):
            line = line.strip()
            if not line.startswith(b"data:") or b"usage" not in line:
                continue
            event = read_json_or_none(line[5:].strip())
            if not isinstance(event, dict):
                continue
            kind = event.get("type")
            if kind == "message_start":
                continue  # counted before the output: the message_delta event has the final usage
            usage = event.get("usage")
            if isinstance(usage, dict):
                return openai_usage(usage) if kind == "message_delta" else usage
        return None

    def carries_token(self, request: InferenceRequest, chunk: bytes) -> bool:
        # Anthropic streams open with message_start and content_block_start events: not output.
        return bool(chunk.strip()) and not only_preamble(chunk)

    def error_body(self, err: InferenceError) -> bytes:
        value = {"type": "error", "error": {"type": ERROR_TYPES.get(err.code, "api_error"), "message": err.body}}
        return json.dumps(value, ensure_ascii=False).encode("utf-8", "surrogatepass")
