"""Response-side body handling: model name rewritten back, token usage read from JSON or SSE."""

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
        return usage if isinstance(usage, dict) else None
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
        if event.get("type") == "response.completed":
            inner = event.get("response")
            usage = inner.get("usage") if isinstance(inner, dict) else None
        else:
            usage = event.get("usage")
        if isinstance(usage, dict):
            return usage
    return None


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
