"""Render chat messages with a model's Jinja chat template, the way vLLM / HF apply_chat_template do.

- Sandboxed Jinja with `trim_blocks` and `lstrip_blocks`, `loopcontrols`, a `tojson` filter that
  keeps non-ASCII, and the `raise_exception` / `strftime_now` globals HF provides.
- Variables: `messages`, `add_generation_prompt` (True unless told), `tools`, `documents`, the
  special tokens (`bos_token`, `eos_token`, ...) and any `chat_template_kwargs`.
- Content parts: vLLM detects whether a template iterates over `message['content']` ("openai"
  format: parts are passed as a list of `{"type": "text", "text": ...}`) or not ("string"
  format: the text parts are joined with newlines before rendering).
- `continue_final_message`: the text is cut right after the final message's content.
- An assistant's `tool_calls` reach the template with `arguments` as an object, as vLLM passes
  them (a JSON string is decoded; anything else that is not an object becomes `{}`).
- Anthropic Messages bodies are first mapped onto chat messages as vLLM's `/v1/messages` does
  (`anthropic_chat_body`), merging inline system messages into the first one when the template
  refuses a system message after the start (`ChatTemplate.accepts_inline_system`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

_OPENAI_FORMAT = re.compile(r"for\s+\w+\s+in\s+[\w.]+(\[['\"]content['\"]\]|\.content\b)")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def detect_content_format(template_source: str) -> str:
    """'openai' when the template loops over a message's content parts, else 'string'."""
    return "openai" if _OPENAI_FORMAT.search(template_source) else "string"


def _arguments_object(arguments: Any) -> dict[str, Any]:
    if isinstance(arguments, str) and arguments:
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return {}
    return arguments if isinstance(arguments, dict) else {}


def _decode_tool_calls(msg: dict[str, Any]) -> None:
    """An assistant message's tool calls with object `arguments` (copies: the request body is not changed)."""
    calls = []
    for call in msg["tool_calls"]:
        function = call.get("function") if isinstance(call, Mapping) else None
        if isinstance(function, Mapping):
            call = {**call, "function": {**function, "arguments": _arguments_object(function.get("arguments"))}}
        calls.append(call)
    if calls:
        msg["tool_calls"] = calls
    else:
        del msg["tool_calls"]  # as vLLM: an empty list would send templates down the tool-call path


class ChatTemplate:
    """A compiled chat template with the special-token variables of its tokenizer."""

    def __init__(self, source: str, special_tokens: Mapping[str, str] | None = None) -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        self.source = source
        self.template = env.from_string(source)
        self.special_tokens = dict(special_tokens or {})
        self.content_format = detect_content_format(source)
        self._accepts_inline_system: bool | None = None

    @property
    def accepts_inline_system(self) -> bool:
        """Whether the template renders a system message after the first turn (vLLM probes the same way)."""
        if self._accepts_inline_system is None:
            probe = [{"role": "system", "content": "t"}, {"role": "user", "content": "t"},
                     {"role": "system", "content": "t"}, {"role": "user", "content": "t"}]
            try:
                self.template.render(**self.special_tokens, messages=probe, add_generation_prompt=False)
                self._accepts_inline_system = True
            except jinja2.TemplateError:
                self._accepts_inline_system = False
        return self._accepts_inline_system

    def _normalise(self, messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        out = []
        for message in messages:
            msg = dict(message)
            if msg.get("role") == "assistant" and isinstance(msg.get("tool_calls"), list):
                _decode_tool_calls(msg)
            content = msg.get("content")
            if isinstance(content, list):
                texts = [p.get("text", "") for p in content
                         if isinstance(p, Mapping) and p.get("type") in ("text", "input_text", None)
                         and isinstance(p.get("text"), str)]
                if self.content_format == "string":
                    msg["content"] = "\n".join(texts)
                else:
                    msg["content"] = [{"type": "text", "text": t} for t in texts]
            out.append(msg)
        return out

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
               continue_final_message: bool = False, tools: Any = None, documents: Any = None,
               chat_template_kwargs: Mapping[str, Any] | None = None) -> str:
        """The prompt text vLLM would tokenize for these messages."""
        msgs = self._normalise(messages)
        variables: dict[str, Any] = dict(self.special_tokens)
        variables.update(chat_template_kwargs or {})
        variables.update(messages=msgs, tools=tools, documents=documents,
                         add_generation_prompt=add_generation_prompt and not continue_final_message)
        text = self.template.render(**variables)
        if continue_final_message and msgs:
            final = msgs[-1].get("content")
            if isinstance(final, list):
                final = final[-1].get("text", "") if final else ""
            if isinstance(final, str) and final.strip():
                cut = text.rfind(final.strip())
                if cut >= 0:
                    text = text[: cut + len(final.strip())]
        return text


# Claude Code's per-request system block (its text starts so); vLLM leaves it out of the prompt.
ANTHROPIC_BILLING_HEADER = "x-anthropic-billing-header"


def _without_billing_line(text: str) -> str:
    """A system text without its first line when that is Claude Code's billing header (vLLM drops it)."""
    return text.partition("\n")[2] if text.startswith(ANTHROPIC_BILLING_HEADER) else text


def _anthropic_text(content: Any) -> str:
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


def _anthropic_message(message: Mapping[str, Any], out: list[dict[str, Any]]) -> None:
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
    system_parts = [_anthropic_text(system)] if system else []
    if merge_inline_system:
        system_parts.extend(_anthropic_text(m.get("content")) for m in messages_in if m.get("role") == "system")
    out: list[dict[str, Any]] = []
    if "".join(system_parts):
        out.append({"role": "system", "content": _without_billing_line("".join(system_parts))})
    for message in messages_in:
        if message.get("role") == "system":
            text = "" if merge_inline_system else _anthropic_text(message.get("content"))
            if text:
                out.append({"role": "system", "content": _without_billing_line(text)})
        else:
            _anthropic_message(message, out)
    chat: dict[str, Any] = {"model": body.get("model"), "messages": out}
    tools = body.get("tools")
    if isinstance(tools, list):
        chat["tools"] = [_function_tool(t) for t in tools if isinstance(t, Mapping)]
    kwargs = body.get("chat_template_kwargs")
    if isinstance(kwargs, Mapping):
        chat["chat_template_kwargs"] = dict(kwargs)
    return chat
