"""`sglanghttp-parser`: SGLang's native `/generate`.

The path is `/generate` itself (vLLM's `/inference/v1/generate` also ends in `/generate`, and is
not this one). What it reads of a body: the prompt as `input_ids` (token ids, or a batch of
them: the first routes) or `text` (a string, or a batch: the first routes), `extra_key` (SGLang's
cache isolation key, read as the cache salt), `stream`, `image_data` (images by URL or data, the
request's media) and `model` when present (SGLang serves one model and does not ask for it).
Token ids are hashed directly (4 bytes a token); SGLang's body does not say where in the prompt
an image sits, so the media digests come first in the prefix bytes: the same images share
prefix credit, other images none. Usage is read from `meta_info` (`prompt_tokens`,
`completion_tokens`, `cached_tokens`); in a stream, from the chunk whose `finish_reason` is set.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from epp.framework import (
    InferenceRequest,
    MediaItem,
    ParsedBody,
    ParseLimits,
    Parser,
    decode_json_object,
    media_digest,
    read_json_or_none,
)
from epp.scorers.parsers.tokens import MEDIA_MARK, bad, check_token_ids, token_prefix_bytes

GENERATE = "generate"


def _first(value: Any) -> Any:
    """A batch's first prompt (SGLang takes a list of prompts); a single prompt as it is."""
    if isinstance(value, list) and value and isinstance(value[0], (list, str)):
        return value[0]
    return value


def _meta_usage(event: Any) -> dict[str, Any] | None:
    meta = event.get("meta_info") if isinstance(event, dict) else None
    if not isinstance(meta, dict) or ("prompt_tokens" not in meta and "completion_tokens" not in meta):
        return None
    usage: dict[str, Any] = {"prompt_tokens": meta.get("prompt_tokens", 0),
                             "completion_tokens": meta.get("completion_tokens", 0)}
    if isinstance(meta.get("cached_tokens"), int):
        usage["prompt_tokens_details"] = {"cached_tokens": meta["cached_tokens"]}
    return usage


class SGLangHttpParser(Parser):
    """SGLang's native `/generate` (token ids or text, `extra_key`, images)."""

    type_name = "sglanghttp-parser"
    paths = (("/generate", GENERATE),)

    def api_for(self, path: str) -> str | None:
        # Only the path itself: `/inference/v1/generate` is vLLM's.
        return GENERATE if path == "/generate" else None

    def parse(self, body: bytes, *, api: str, path: str, limits: ParseLimits) -> ParsedBody:
        parsed = decode_json_object(body, limits.max_json_depth)
        ids, text = parsed.get("input_ids"), parsed.get("text")
        if ids is not None:
            first = _first(ids)
            check_token_ids(first, "input_ids", "generate")
            chars = 4 * len(first)
        elif isinstance(_first(text), str) and _first(text):
            chars = min(len(_first(text)), limits.max_prompt_chars + 1)
        else:
            raise bad("invalid generate request: must have input_ids (token ids) or text", "input_ids")
        salt = parsed.get("extra_key")
        if salt is not None and not isinstance(salt, str):
            raise bad("invalid generate request: extra_key must be a string", "extra_key")
        images = parsed.get("image_data")
        if images is not None and not isinstance(images, (str, list)):
            raise bad("invalid generate request: image_data must be a string or a list", "image_data")
        model = parsed.get("model")
        return ParsedBody(model=model if isinstance(model, str) else "", body=parsed,
                          stream=parsed.get("stream") is True, cache_salt=salt or None, prompt_chars=chars)

    def prompt_items(self, request: InferenceRequest) -> Sequence[Any]:
        body = request.body
        return [_first(body["input_ids"]) if body.get("input_ids") is not None else _first(body.get("text"))]

    def prompt_text(self, request: InferenceRequest) -> str:
        text = _first(request.body.get("text"))
        return text if isinstance(text, str) and request.body.get("input_ids") is None else ""

    def token_ids(self, request: InferenceRequest) -> Sequence[int] | None:
        ids = request.body.get("input_ids")
        return list(_first(ids)) if ids is not None else None

    def media(self, request: InferenceRequest) -> Sequence[MediaItem]:
        images = request.body.get("image_data")
        if isinstance(images, str):
            images = [images]
        return [MediaItem("image", media_digest(image), 0) for image in images or () if image]

    def prompt_bytes(self, request: InferenceRequest, limit: int | None) -> bytes:
        head = b"".join(MEDIA_MARK + m.digest.encode() + MEDIA_MARK for m in request.media())
        ids = self.token_ids(request)
        if ids is not None:
            data = head + token_prefix_bytes(ids, (), limit)
        else:
            text = self.prompt_text(request)
            data = head + (text if limit is None else text[:limit]).encode("utf-8", "surrogatepass")
        return data if limit is None else data[:limit]

    def operation(self, request: InferenceRequest) -> str | None:
        return "text_completion"

    def usage(self, request: InferenceRequest, body: bytes, *, streamed: bool) -> dict[str, Any] | None:
        if not streamed:
            return _meta_usage(read_json_or_none(body))
        if b"finish_reason" not in body:
            return None
        for line in body.split(b"\n"):
            line = line.strip()
            if not line.startswith(b"data:") or b"meta_info" not in line:
                continue
            event = read_json_or_none(line[5:].strip())
            meta = event.get("meta_info") if isinstance(event, dict) else None
            # Only the last chunk of a stream has its finish_reason set, with the final counts.
            if isinstance(meta, Mapping) and meta.get("finish_reason") is not None:
                return _meta_usage(event)
        return None
