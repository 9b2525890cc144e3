"""Errors of the request path (mapped to HTTP by the ext_proc server) and of configuration."""

from __future__ import annotations

import enum
import re


class ErrorCode(enum.Enum):
    """GIE error codes and the HTTP status each maps to."""

    BAD_REQUEST = ("BadRequest", 400)
    UNAUTHORIZED = ("Unauthorized", 401)
    FORBIDDEN = ("Forbidden", 403)
    NOT_FOUND = ("NotFound", 404)
    REQUEST_TIMEOUT = ("RequestTimeout", 408)
    PAYLOAD_TOO_LARGE = ("PayloadTooLarge", 413)
    HEADERS_TOO_LARGE = ("RequestHeaderFieldsTooLarge", 431)
    RESOURCE_EXHAUSTED = ("ResourceExhausted", 429)
    INTERNAL = ("Internal", 500)
    SERVICE_UNAVAILABLE = ("ServiceUnavailable", 503)

    @property
    def label(self) -> str:
        return self.value[0]

    @property
    def http_status(self) -> int:
        return self.value[1]


# The response header that tells a client why the picker dropped its request (llm-d's name).
DROP_REASON_HEADER = "x-llm-d-request-dropped-reason"


class DropReason(enum.StrEnum):
    """llm-d's values of `x-llm-d-request-dropped-reason`: `rejected-*` never reached a model server."""

    SATURATED = "rejected-saturated"
    NO_ENDPOINTS = "rejected-no-endpoints"
    TTL_EXPIRED = "rejected-ttl-expired"
    CONTEXT_CANCELLED = "rejected-context-cancelled"
    SHUTTING_DOWN = "rejected-shutting-down"
    EVICTED = "evicted"
    EVICTED_QUEUE_PRESSURE = "evicted-queue-pressure"
    EVICTED_PRIORITY = "evicted-priority"


# The reason a 429 or 503 carries when its raiser named none.
DEFAULT_DROP_REASONS: dict[ErrorCode, DropReason] = {
    ErrorCode.RESOURCE_EXHAUSTED: DropReason.SATURATED,
    ErrorCode.SERVICE_UNAVAILABLE: DropReason.NO_ENDPOINTS,
}
# llm-d's words: `rejected-...` or `evicted[-...]`, lower case (a header value, read by clients).
_DROP_REASON_FORM = re.compile(r"(rejected|evicted)(-[a-z0-9]+)*")


class InferenceError(Exception):
    """A request-level failure answered to the client; its text is `inference error: <Code> - <msg>`.

    `drop_reason` (a `DropReason`, or another word of llm-d's form) says why a request was
    dropped; a 429 or 503 without one gets its code's default (`DEFAULT_DROP_REASONS`). `param`
    names the body field the error is about, when one is (OpenAI's error shape carries it).
    """

    def __init__(self, code: ErrorCode, message: str, *, drop_reason: str | None = None,
                 param: str | None = None):
        super().__init__(message)
        if drop_reason is not None and not _DROP_REASON_FORM.fullmatch(drop_reason):
            raise ValueError(f"drop reason {drop_reason!r} is not of llm-d's form rejected-<word> or evicted[-<word>]")
        self.code = code
        self.message = message
        self.param = param
        self._drop_reason = drop_reason

    @property
    def body(self) -> str:
        return f"inference error: {self.code.label} - {self.message}"

    @property
    def drop_reason(self) -> str | None:
        """Why the request was dropped (the raiser's reason, else the code's default; None: not a drop)."""
        if self._drop_reason is not None:
            return self._drop_reason
        return DEFAULT_DROP_REASONS.get(self.code)


class ConfigError(ValueError):
    """Invalid EndpointPickerConfig or plugin parameters; the message names the field."""
