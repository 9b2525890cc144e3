"""`vllmhttp-parser`: vLLM's token-in `/inference/v1/generate`, and every path `openai-parser` reads.

`/inference/v1/generate` (the API llm-d's coordinator and P/D sidecars speak) takes the prompt
as token ids: `token_ids` (required), `features` (multimodal items: `mm_hashes` and
`mm_placeholders` by modality, each placeholder an `{offset, length}` in the token ids),
`cache_salt`, `stream`, `sampling_params`, and optionally `model`. Nothing is tokenized: prefix
hashing reads the ids themselves (4 bytes a token, each media item's hash at its first
placeholder), and the precise prefix index keys them directly, with each media item's hash
where vLLM's block hashing puts it. Responses carry OpenAI's usage. Every other path is read as
`openai-parser` reads it, so one parser serves a route that takes both.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from epp.framework import (
    InferenceRequest,
    MediaItem,
    ParsedBody,
    ParseLimits,
    RenderRequest,
    decode_json_object,
    session_name,
)
from epp.scorers.parsers.openai import OpenAIParser
from epp.scorers.parsers.tokens import bad, check_token_ids, engine_features, token_prefix_bytes

GENERATE = "generate"
GENERATE_PATH = "/inference/v1/generate"


class VllmHttpParser(OpenAIParser):
    """vLLM's `/inference/v1/generate` (token ids, multimodal features), then the OpenAI paths."""

    type_name = "vllmhttp-parser"
    paths = ((GENERATE_PATH, GENERATE), *OpenAIParser.paths)

    def parse(self, body: bytes, *, api: str, path: str, limits: ParseLimits) -> ParsedBody:
        if api != GENERATE:
            return super().parse(body, api=api, path=path, limits=limits)
        parsed = decode_json_object(body, limits.max_json_depth)
        ids = check_token_ids(parsed.get("token_ids"), "token_ids", "generate")
        engine_features(parsed.get("features"), len(ids), "generate")  # checked here: 400 for a bad one
        model = parsed.get("model")
        if model is not None and not isinstance(model, str):
            raise bad("invalid generate request: model must be a string", "model")
        salt = parsed.get("cache_salt")
        if salt is not None and not isinstance(salt, str):
            raise bad("invalid generate request: cache_salt must be a string", "cache_salt")
        return ParsedBody(model=model or "", body=parsed, stream=parsed.get("stream") is True,
                          cache_salt=salt or None, session=session_name(parsed.get("user")),
                          prompt_chars=4 * len(ids))

    def prompt_items(self, request: InferenceRequest) -> Sequence[Any]:
        if request.api != GENERATE:
            return super().prompt_items(request)
        return [request.body["token_ids"]]

    def prompt_text(self, request: InferenceRequest) -> str:
        return "" if request.api == GENERATE else super().prompt_text(request)

    def token_ids(self, request: InferenceRequest) -> Sequence[int] | None:
        if request.api != GENERATE:
            return super().token_ids(request)
        ids: list[int] = request.body["token_ids"]
        return ids

    def media(self, request: InferenceRequest) -> Sequence[MediaItem]:
        if request.api != GENERATE:
            return super().media(request)
        return engine_features(request.body.get("features"), len(request.body["token_ids"]), "generate")

    def prompt_bytes(self, request: InferenceRequest, limit: int | None) -> bytes:
        if request.api != GENERATE:
            return super().prompt_bytes(request, limit)
        return token_prefix_bytes(request.body["token_ids"], request.media(), limit)

    def render_request(self, request: InferenceRequest, *, prefill_only: bool = False) -> RenderRequest | None:
        return None if request.api == GENERATE else super().render_request(request, prefill_only=prefill_only)

    def operation(self, request: InferenceRequest) -> str | None:
        return "text_completion" if request.api == GENERATE else super().operation(request)
