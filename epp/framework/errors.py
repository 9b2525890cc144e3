"""Errors of the request path (mapped to HTTP by the ext_proc server) and of configuration."""

from __future__ import annotations

import enum


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


class InferenceError(Exception):
    """A request-level failure answered to the client as `inference error: <Code> - <msg>`."""

    def __init__(self, code: ErrorCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message

    @property
    def body(self) -> str:
        return f"inference error: {self.code.label} - {self.message}"


class ConfigError(ValueError):
    """Invalid EndpointPickerConfig or plugin parameters; the message names the field."""
