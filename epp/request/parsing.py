"""Parse a buffered request body into an `InferenceRequest` (OpenAI completions, chat, responses, Anthropic
messages, rerank…; a path no parser reads passes through)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import msgspec

from epp.framework.errors import ErrorCode, InferenceError
from epp.framework.headers import (
    FAIRNESS_ID_HEADERS,
    MODEL_REWRITE_HEADERS,
    OBJECTIVE_HEADERS,
    SLO_TPOT_MS_HEADERS,
    SLO_TTFT_MS_HEADERS,
    header_value,
)
from epp.framework.load import body_prompt_characters
from epp.framework.types import ApiKind, InferenceRequest
from epp.limits import DEFAULT_MAX_JSON_DEPTH, DEFAULT_MAX_PROMPT_CHARS
from epp.request.anthropic import messages_body_problem
from epp.request.jsoncheck import has_lone_surrogate, nesting_exceeds

DEFAULT_FAIRNESS_ID = "default-flow"
# An SLO header past this (about 11.6 days) is not a latency objective; it is refused.
MAX_SLO_MS = 1e9

# Matched in this order, as the GIE parser does (a `/chat/completions` path also ends in `/completions`).
_SUFFIXES: tuple[tuple[str, ApiKind], ...] = (
    ("/conversations", ApiKind.CONVERSATIONS),
    ("/responses", ApiKind.RESPONSES),
    ("/chat/completions", ApiKind.CHAT_COMPLETIONS),
    ("/completions", ApiKind.COMPLETIONS),
    ("/embeddings", ApiKind.EMBEDDINGS),
    ("/messages", ApiKind.MESSAGES),
    ("/rerank", ApiKind.RERANK),
)
DEFAULT_PATH = "/v1/completions"


def api_kind_for_path(path: str) -> ApiKind:
    """The API a path names by its suffix (query string ignored); any other path passes through."""
    path = path.split("?", 1)[0].rstrip("/")
    for suffix, kind in _SUFFIXES:
        if path.endswith(suffix):
            return kind
    return ApiKind.PASSTHROUGH


def request_path(headers: Mapping[str, str]) -> str:
    """The request's path: `:path`, else `x-original-path`, else `x-forwarded-path`, else `/v1/completions`."""
    return headers.get(":path") or headers.get("x-original-path") or headers.get("x-forwarded-path") \
        or DEFAULT_PATH


# msgspec decodes JSON to the same Python values as json.loads about twice as fast, and refuses
# more (NaN and Infinity, numbers out of a float's range, lone surrogates, UTF-16/32, a BOM):
# what it refuses is handed to json.loads, so every body gets the answer it got before.
_strict_decode = msgspec.json.Decoder().decode


def _loads(body: bytes) -> tuple[Any, bool]:
    """The parsed body, and whether the strict decoder read it (then no string holds a lone surrogate)."""
    try:
        return _strict_decode(body), True
    except msgspec.DecodeError:  # ValidationError (a number out of range) is one too
        pass
    try:
        return json.loads(body), False
    except (ValueError, UnicodeDecodeError) as exc:
        raise _bad(f"error unmarshaling request bodyMap: {exc}") from None


def _bad(message: str) -> InferenceError:
    return InferenceError(ErrorCode.BAD_REQUEST, message)


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value)


def _valid_prompt(prompt: Any) -> bool:
    if isinstance(prompt, str):
        return bool(prompt)
    if not isinstance(prompt, list) or not prompt:
        return False
    if all(isinstance(p, str) for p in prompt):
        return True
    return _is_token_ids(prompt) or all(_is_token_ids(p) for p in prompt)


def _valid_messages(messages: Any) -> bool:
    if not isinstance(messages, list) or not messages:
        return False
    for message in messages:
        if not isinstance(message, dict):
            return False
        content = message.get("content")
        if content is not None and not isinstance(content, (str, list)):
            return False
        if isinstance(content, list) and not all(isinstance(part, dict) for part in content):
            return False
    return True


def _validate_api_fields(api: ApiKind, body: Mapping[str, Any]) -> None:
    if api is ApiKind.CHAT_COMPLETIONS:
        if not _valid_messages(body.get("messages")):
            raise _bad("invalid chat completions request: must have valid messages field")
    elif api is ApiKind.COMPLETIONS:
        if not _valid_prompt(body.get("prompt")):
            raise _bad("invalid completions request: must have valid prompt field")
    elif api is ApiKind.RESPONSES:
        if body.get("input") in (None, "", []):
            raise _bad("invalid responses request: must have input field")
    elif api is ApiKind.CONVERSATIONS:
        items = body.get("items")
        if not isinstance(items, list) or not items:
            raise _bad("invalid conversations request: must have items field")
    elif api is ApiKind.EMBEDDINGS:
        if body.get("input") in (None, "", []):
            raise _bad("invalid embeddings request: must have input field")
    elif api is ApiKind.MESSAGES:
        problem = messages_body_problem(body)
        if problem is not None:
            raise _bad(f"invalid messages request: {problem}")
    elif api is ApiKind.RERANK:
        if body.get("query") in (None, "", []) or body.get("documents") in (None, "", []):
            raise _bad("invalid rerank request: must have query and documents fields")


# A session named in a body longer than this is not an identifier: it is cut (the session plugins bound it too).
MAX_SESSION_CHARS = 256


def _body_session(api: ApiKind, body: Mapping[str, Any]) -> str | None:
    """The session a body names: Anthropic's `metadata.user_id`, else OpenAI's `prompt_cache_key`, then `user`."""
    if api is ApiKind.MESSAGES:
        metadata = body.get("metadata")
        value = metadata.get("user_id") if isinstance(metadata, Mapping) else None
    else:
        value = body.get("prompt_cache_key") or body.get("user")
    return value[:MAX_SESSION_CHARS] if isinstance(value, str) and value else None


def slo_ms(headers: Mapping[str, str], names: tuple[str, ...]) -> float | None:
    """A latency objective in milliseconds from a header (current name, then aliases); 400 when malformed."""
    text = header_value(headers, names)
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value <= MAX_SLO_MS:  # also refuses nan and inf
        raise _bad(f"header {names[0]}: {text[:40]!r} is not a latency objective in milliseconds "
                   f"(a number in (0, {MAX_SLO_MS:.0f}])")
    return value


def go_json(value: Any) -> bytes:
    """Serialise like Go's json.Marshal of a map: compact, keys sorted, HTML characters escaped."""
    text = json.dumps(value, separators=(",", ":"), sort_keys=True, ensure_ascii=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026").encode()


class RequestParser:
    """Turns a request's headers and body into an `InferenceRequest` and the body to send on."""

    def __init__(self, objective_priorities: Mapping[str, int] | None = None, *,
                 max_json_depth: int = DEFAULT_MAX_JSON_DEPTH, max_prompt_chars: int = DEFAULT_MAX_PROMPT_CHARS) -> None:
        self.objective_priorities = dict(objective_priorities or {})
        self.max_json_depth = max_json_depth
        self.max_prompt_chars = max_prompt_chars

    def parse(self, *, request_id: str, headers: Mapping[str, str], body: bytes,
              subset_hint: tuple[str, ...] | None) -> tuple[InferenceRequest, bytes]:
        """Parse and validate; returns the request and the body to forward (rewritten if needed)."""
        path = request_path(headers)
        api = api_kind_for_path(path)
        if api is ApiKind.PASSTHROUGH:
            return self._passthrough(request_id, headers, body, subset_hint, path), body
        if nesting_exceeds(body, self.max_json_depth):
            raise _bad(f"request body nests objects/arrays deeper than {self.max_json_depth} levels")
        parsed, strict = _loads(body)
        if not isinstance(parsed, dict):
            raise _bad("error unmarshaling request bodyMap: request body must be a JSON object")
        if not strict and has_lone_surrogate(parsed):
            raise _bad("request body holds a lone UTF-16 surrogate escape (\\ud800-\\udfff without its pair), "
                       "which is not valid Unicode")
        _validate_api_fields(api, parsed)
        model = parsed.get("model")
        if not isinstance(model, str) or not model:
            raise _bad("model not found in request body")
        # Counted once here for every plugin that reads it, and bounded: tokenizing and hashing a
        # prompt cost in proportion to it (one past the limit is enough to know it is too long).
        prompt_chars = body_prompt_characters(parsed, self.max_prompt_chars + 1)
        if prompt_chars > self.max_prompt_chars:
            raise InferenceError(ErrorCode.PAYLOAD_TOO_LARGE,
                                 f"prompt exceeds the limit of {self.max_prompt_chars} characters "
                                 "(epp serve --max-prompt-chars)")
        target_model = header_value(headers, MODEL_REWRITE_HEADERS) or model
        forwarded = body
        if target_model != model:
            parsed["model"] = target_model
            forwarded = go_json(parsed)
        objective = header_value(headers, OBJECTIVE_HEADERS)
        salt = parsed.get("cache_salt")
        request = InferenceRequest(
            request_id=request_id,
            api=api,
            model=model,
            target_model=target_model,
            body=parsed,
            headers=headers,
            stream=parsed.get("stream") is True,
            cache_salt=salt if isinstance(salt, str) and salt else None,
            priority=self.objective_priorities.get(objective, 0) if objective else 0,
            objective=objective,
            fairness_id=header_value(headers, FAIRNESS_ID_HEADERS) or DEFAULT_FAIRNESS_ID,
            subset_hint=subset_hint,
            path=path,
            slo_ttft_ms=slo_ms(headers, SLO_TTFT_MS_HEADERS),
            slo_tpot_ms=slo_ms(headers, SLO_TPOT_MS_HEADERS),
            prompt_chars=prompt_chars,
            body_session=_body_session(api, parsed),
        )
        return request, forwarded

    def _passthrough(self, request_id: str, headers: Mapping[str, str], body: bytes,
                     subset_hint: tuple[str, ...] | None, path: str) -> InferenceRequest:
        """A request on a path no parser reads: its body goes on as it came, unchecked (llm-d's passthrough-parser).

        Its `model` is read when the body is a JSON object naming one (model filters and metrics
        need it); otherwise it is "". There is no prompt to score: any endpoint the filters keep
        may be chosen, by load.
        """
        model = ""
        if body[:64].lstrip()[:1] == b"{" and not nesting_exceeds(body, self.max_json_depth):
            try:
                parsed = json.loads(body)
            except (ValueError, UnicodeDecodeError):
                parsed = None
            # A name holding a lone surrogate is no model (and could not be hashed): read as none.
            if isinstance(parsed, dict) and isinstance(parsed.get("model"), str) \
                    and not has_lone_surrogate(parsed["model"]):
                model = parsed["model"]
        objective = header_value(headers, OBJECTIVE_HEADERS)
        return InferenceRequest(
            request_id=request_id, api=ApiKind.PASSTHROUGH, model=model, target_model=model, body={},
            headers=headers, priority=self.objective_priorities.get(objective, 0) if objective else 0,
            objective=objective, fairness_id=header_value(headers, FAIRNESS_ID_HEADERS) or DEFAULT_FAIRNESS_ID,
            subset_hint=subset_hint, path=path, slo_ttft_ms=slo_ms(headers, SLO_TTFT_MS_HEADERS),
            slo_tpot_ms=slo_ms(headers, SLO_TPOT_MS_HEADERS))
