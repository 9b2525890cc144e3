"""The JSON body of the picker's own error answers, in the shape client libraries read.

OpenAI's shape on every path (`{"error": {"message", "type", "param", "code"}}`), Anthropic's on
the Messages API (`{"type": "error", "error": {"type", "message"}}`). The message is the GIE text
(`inference error: <Code> - <msg>`), so logs and scripts that matched it still do; `code` is the
GIE code (`BadRequest`, `ResourceExhausted`...).
"""

from __future__ import annotations

import json

from epp.framework.errors import ErrorCode, InferenceError

# Per code: the OpenAI error type, then Anthropic's (its documented `error.type` values).
_TYPES: dict[ErrorCode, tuple[str, str]] = {
    ErrorCode.BAD_REQUEST: ("invalid_request_error", "invalid_request_error"),
    ErrorCode.UNAUTHORIZED: ("authentication_error", "authentication_error"),
    ErrorCode.FORBIDDEN: ("permission_error", "permission_error"),
    ErrorCode.NOT_FOUND: ("not_found_error", "not_found_error"),
    ErrorCode.REQUEST_TIMEOUT: ("timeout_error", "timeout_error"),
    ErrorCode.PAYLOAD_TOO_LARGE: ("invalid_request_error", "request_too_large"),
    ErrorCode.HEADERS_TOO_LARGE: ("invalid_request_error", "invalid_request_error"),
    ErrorCode.RESOURCE_EXHAUSTED: ("rate_limit_error", "rate_limit_error"),
    ErrorCode.INTERNAL: ("server_error", "api_error"),
    ErrorCode.SERVICE_UNAVAILABLE: ("service_unavailable_error", "overloaded_error"),
}
# Paths of Anthropic's Messages API (query string and trailing slash ignored).
_ANTHROPIC_SUFFIXES = ("/messages", "/messages/count_tokens")


def is_anthropic_path(path: str | None) -> bool:
    """Whether a request path belongs to Anthropic's Messages API (its clients read Anthropic's error shape)."""
    return bool(path) and path.split("?", 1)[0].rstrip("/").endswith(_ANTHROPIC_SUFFIXES)


def error_body(err: InferenceError, *, anthropic: bool = False) -> bytes:
    """The JSON error body of `err`: Anthropic's shape when `anthropic`, else OpenAI's."""
    openai_type, anthropic_type = _TYPES.get(err.code, ("server_error", "api_error"))
    if anthropic:
        value: dict[str, object] = {"type": "error", "error": {"type": anthropic_type, "message": err.body}}
    else:
        value = {"error": {"message": err.body, "type": openai_type, "param": None, "code": err.code.label}}
    return json.dumps(value, ensure_ascii=False).encode("utf-8", "surrogatepass")
