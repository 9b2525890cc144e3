"""The picker's limits on hostile or runaway input, with their defaults (docs/operations.md#limits).

Each limit reached gives a defined answer; the answers are listed next to the defaults.
"""

from __future__ import annotations

from dataclasses import dataclass

# ext_proc streams open at once; one more is answered 429 ResourceExhausted.
DEFAULT_MAX_CONCURRENT_STREAMS = 10_000
# Seconds a stream may wait for the next message of a request the picker has not answered yet
# (Envoy's own stream_idle_timeout in the config we ship is 300 s); then 408 RequestTimeout.
DEFAULT_STREAM_IDLE_TIMEOUT_S = 300.0
# Request headers (count, and names plus values in bytes); more is answered 431. Both are above
# Envoy's defaults (100 headers, 60 KiB), so behind the config we ship Envoy answers first.
DEFAULT_MAX_REQUEST_HEADERS = 200
DEFAULT_MAX_REQUEST_HEADER_BYTES = 128 * 1024
# Nesting of a request's JSON body (objects and arrays); deeper is answered 400 BadRequest.
DEFAULT_MAX_JSON_DEPTH = 128
# The most the depth limit may be set to: the parser recurses once per level, and what runs inside
# it (garbage-collector callbacks) needs stack left under the interpreter's limit of 1,000 frames.
MAX_JSON_DEPTH_CEILING = 512
# Characters of a request's prompt text (every string of its prompt, messages or input); more is
# answered 413 PayloadTooLarge before any tokenization or hashing. 4 Mi characters is about a
# million tokens, past the longest context windows served today; a prompt is walked once to count.
DEFAULT_MAX_PROMPT_CHARS = 1 << 22
# Characters of a client-chosen string used as a metric label value; longer ones are cut.
DEFAULT_MAX_LABEL_VALUE_LENGTH = 128


@dataclass(frozen=True)
class Limits:
    """The limits one picker enforces (the defaults above unless `epp serve` flags say otherwise)."""

    max_concurrent_streams: int = DEFAULT_MAX_CONCURRENT_STREAMS
    stream_idle_timeout_s: float = DEFAULT_STREAM_IDLE_TIMEOUT_S
    max_request_headers: int = DEFAULT_MAX_REQUEST_HEADERS
    max_request_header_bytes: int = DEFAULT_MAX_REQUEST_HEADER_BYTES
    max_json_depth: int = DEFAULT_MAX_JSON_DEPTH
    max_label_value_length: int = DEFAULT_MAX_LABEL_VALUE_LENGTH
    max_prompt_chars: int = DEFAULT_MAX_PROMPT_CHARS

    def __post_init__(self) -> None:
        for name in ("max_concurrent_streams", "max_request_headers", "max_request_header_bytes",
                     "max_json_depth", "max_label_value_length", "max_prompt_chars"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_json_depth > MAX_JSON_DEPTH_CEILING:
            raise ValueError(f"max_json_depth must be <= {MAX_JSON_DEPTH_CEILING}, got {self.max_json_depth}")
        if self.stream_idle_timeout_s <= 0:
            raise ValueError(f"stream_idle_timeout_s must be > 0, got {self.stream_idle_timeout_s}")
