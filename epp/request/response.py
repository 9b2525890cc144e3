"""Response-side body handling: model name rewritten back, token usage read from JSON or SSE.

Anthropic Messages responses are read too: a `message` object's usage, or in its SSE stream the
`message_delta` event's (the final count; `message_start`'s is taken before any output), with
`input_tokens` plus the cache read and written counts as the prompt tokens (`prompt_tokens`,
`completion_tokens`, `prompt_tokens_details.cached_tokens`: what the picker's accounting reads).
"""

from __future__ import annotations

import json
from typing import Any

from epp.limits import DEFAULT_MAX_JSON_DEPTH
from epp.request.jsoncheck import nesting_exceeds

# Nesting of a model server's JSON response the picker reads (an OpenAI response is under 10 deep).
MAX_RESPONSE_JSON_DEPTH = DEFAULT_MAX_JSON_DEPTH


class UnreadableBody(ValueError):
    """A response body the picker does not read: JSON nested deeper than `MAX_RESPONSE_JSON_DEPTH`."""


def _loads(data: bytes) -> Any:
    if nesting_exceeds(data, MAX_RESPONSE_JSON_DEPTH):
        raise UnreadableBody(f"JSON nested deeper than {MAX_RESPONSE_JSON_DEPTH} levels")
    return json.loads(data)


def parse_usage(body: bytes, *, sse: bool) -> dict[str, Any] | None:
    """The `usage` object of a JSON response, or of the first SSE event that carries one.

    Raises `UnreadableBody` when the body nests deeper than `MAX_RESPONSE_JSON_DEPTH`; the caller passes it on as is.
    """
    if not sse:
        try:
            parsed = _loads(body)
        except (ValueError, UnicodeDecodeError) as exc:
            if isinstance(exc, UnreadableBody):
                raise
            return None
        usage = parsed.get("usage") if isinstance(parsed, dict) else None
        if not isinstance(usage, dict):
            return None
        return _from_anthropic(usage) if parsed.get("type") == "message" else usage
    for line in body.split(b"\n"):
        line = line.strip()
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if not payload or payload == b"[DONE]" or b"usage" not in payload:
            continue
        try:
            event = _loads(payload)
        except UnreadableBody:
            raise
        except (ValueError, UnicodeDecodeError):
            continue
        if not isinstance(event, dict):
            continue
        kind = event.get("type")
        if kind == "response.completed":
            inner = event.get("response")
            usage = inner.get("usage") if isinstance(inner, dict) else None
        elif kind == "message_start":
            continue  # counted before the output: the message_delta event has the final usage
        else:
            usage = event.get("usage")
        if isinstance(usage, dict):
            return _from_anthropic(usage) if kind == "message_delta" else usage
    return None


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def _from_anthropic(usage: dict[str, Any]) -> dict[str, Any]:
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


# Anthropic stream events sent before any generated output.
_ANTHROPIC_PREAMBLE = frozenset({b"message_start", b"content_block_start", b"ping"})


def only_anthropic_preamble(chunk: bytes) -> bool:
    """Whether every SSE event of a chunk is one Anthropic sends before the first token (message_start...)."""
    if b"event:" not in chunk:
        return False
    names = [line[6:].strip() for line in chunk.split(b"\n") if line.startswith(b"event:")]
    return bool(names) and all(name in _ANTHROPIC_PREAMBLE for name in names)


class ResponseRewriter:
    """Replaces `"model":"<target>"` by `"model":"<incoming>"` in response bytes, both spacings."""

    def __init__(self, incoming: str, target: str) -> None:
        enc = lambda s: json.dumps(s, ensure_ascii=False).encode()  # noqa: E731
        self.active = incoming != target
        # Built once per request on the hot path: nothing to encode when the model is not rewritten.
        self._pairs = [] if not self.active else [
            (b'"model":' + enc(target), b'"model":' + enc(incoming)),
            (b'"model": ' + enc(target), b'"model": ' + enc(incoming)),
        ]

    def rewrite(self, chunk: bytes) -> bytes:
        if not self.active:
            return chunk
        for old, new in self._pairs:
            chunk = chunk.replace(old, new)
        return chunk
