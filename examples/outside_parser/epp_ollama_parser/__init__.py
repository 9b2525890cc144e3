"""`ollama-parser`: Ollama's `/api/generate`, read by the endpoint picker as one more request API.

A request: `model`, `prompt`, an optional `system`, `images` (base64), `stream` (true unless
false). A streamed response is newline-delimited JSON, each line a piece of `response`; the last
line has `"done": true` and the token counts (`prompt_eval_count`, `eval_count`). Errors are
`{"error": "<message>"}`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from epp.framework import (
    ErrorCode,
    InferenceError,
    InferenceRequest,
    MediaItem,
    ParsedBody,
    ParseLimits,
    Parser,
    PluginRegistry,
    decode_json_object,
    json_array_prefix,
    media_digest,
)


def _lines(body: bytes) -> list[Any]:
    """The JSON objects of an NDJSON body or chunk (lines that are not JSON are skipped)."""
    out = []
    for line in body.split(b"\n"):
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


class OllamaParser(Parser):
    """Ollama's `/api/generate`: prompt and system text, images, NDJSON streams."""

    type_name = "ollama-parser"  # the `type` configs name in `plugins` and `requestHandler.parsers`
    paths = (("/api/generate", "generate"),)  # path suffix -> the API name requests get

    def parse(self, body: bytes, *, api: str, path: str, limits: ParseLimits) -> ParsedBody:
        # On the event loop for every request on /api/generate: read the bytes once, check what routing needs.
        parsed = decode_json_object(body, limits.max_json_depth)  # 400 on bad JSON, too deep, lone surrogates
        model, prompt = parsed.get("model"), parsed.get("prompt")
        if not isinstance(model, str) or not model:
            raise InferenceError(ErrorCode.BAD_REQUEST, "model is required")
        if not isinstance(prompt, str):
            raise InferenceError(ErrorCode.BAD_REQUEST, "prompt must be a string", param="prompt")
        system = parsed.get("system") if isinstance(parsed.get("system"), str) else ""
        return ParsedBody(model=model, body=parsed, stream=parsed.get("stream") is not False,
                          prompt_chars=len(system) + len(prompt))

    # What plugins ask of a request (each computed once per request, only when a plugin asks).
    def prompt_text(self, request: InferenceRequest) -> str:
        return "\n".join(t for t in (request.body.get("system"), request.body["prompt"]) if isinstance(t, str) and t)

    def media(self, request: InferenceRequest) -> Sequence[MediaItem]:
        return [MediaItem("image", media_digest(image), 0) for image in request.body.get("images") or ()]

    def prompt_bytes(self, request: InferenceRequest, limit: int | None) -> bytes:
        # System prompt first (shared across requests), then each image's digest, then the prompt.
        items = [request.body.get("system") or "", *(m.digest for m in request.media()), request.body["prompt"]]
        data = json_array_prefix(items, limit)
        return data if limit is None else data[:limit]

    # How its responses read.
    def usage(self, request: InferenceRequest, body: bytes, *, streamed: bool) -> dict[str, Any] | None:
        if b'"done":true' not in body.replace(b" ", b""):
            return None
        for line in _lines(body):
            if isinstance(line, dict) and line.get("done") is True:
                return {"prompt_tokens": line.get("prompt_eval_count", 0),
                        "completion_tokens": line.get("eval_count", 0)}
        return None

    def carries_token(self, request: InferenceRequest, chunk: bytes) -> bool:
        return any(isinstance(line, dict) and line.get("response") for line in _lines(chunk))

    def error_body(self, err: InferenceError) -> bytes:
        return json.dumps({"error": err.body}).encode()


def register(registry: PluginRegistry) -> None:
    """Entry point of group `epp.plugins`: makes `ollama-parser` usable in configs."""
    registry.register_class(OllamaParser)
