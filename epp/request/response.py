"""Response-side body handling: model name rewritten back, token usage read from JSON or SSE."""

from __future__ import annotations

import json
from typing import Any


def parse_usage(body: bytes, *, sse: bool) -> dict[str, Any] | None:
    """The `usage` object of a JSON response, or of the first SSE event that carries one."""
    if not sse:
        try:
            parsed = json.loads(body)
        except (ValueError, UnicodeDecodeError):
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
            event = json.loads(payload)
        except (ValueError, UnicodeDecodeError):
            continue
        if not isinstance(event, dict):
            continue
        if event.get("type") == "response.completed":
            usage = (event.get("response") or {}).get("usage")
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
        self._pairs = [
            (b'"model":' + enc(target), b'"model":' + enc(incoming)),
            (b'"model": ' + enc(target), b'"model": ' + enc(incoming)),
        ]

    def rewrite(self, chunk: bytes) -> bytes:
        if not self.active:
            return chunk
        for old, new in self._pairs:
            chunk = chunk.replace(old, new)
        return chunk
