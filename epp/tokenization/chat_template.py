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
- Other APIs' bodies (Anthropic Messages) are mapped onto a chat body by their parser first
  (`RequestFormat.chat_body`), merging inline system messages into the first one when the
  template refuses a system message after the start (`ChatTemplate.accepts_inline_system`).
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
