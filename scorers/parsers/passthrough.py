"""`passthrough-parser`: the fallback for paths no other parser claims; the body goes on as it came, unread.

Its `model` is read when the body is a JSON object naming one (model filters and metrics need
it); otherwise it is "". There is no prompt to score: any endpoint the filters keep may be
chosen, by load. Responses are read for an OpenAI-style `usage` object, as most servers send.
"""

from __future__ import annotations

import json
from typing import Any

from epp.framework import (
    InferenceRequest,
    ParsedBody,
    ParseLimits,
    Parser,
    has_lone_surrogate,
    nesting_exceeds,
)
from epp.scorers.parsers.openai import json_usage, sse_events

PASSTHROUGH = "passthrough"


class PassthroughParser(Parser):
    """Requests on paths no parser claims pass through, their body unread, to an endpoint chosen by load."""

    type_name = "passthrough-parser"
    paths = ()  # a fallback: it claims what the parsers before it did not

    def parse(self, body: bytes, *, api: str, path: str, limits: ParseLimits) -> ParsedBody:
        model = ""
        if body[:64].lstrip()[:1] == b"{" and not nesting_exceeds(body, limits.max_json_depth):
            try:
                parsed = json.loads(body)
            except (ValueError, UnicodeDecodeError):
                parsed = None
            # A name holding a lone surrogate is no model (and could not be hashed): read as none.
            if isinstance(parsed, dict) and isinstance(parsed.get("model"), str) \
                    and not has_lone_surrogate(parsed["model"]):
                model = parsed["model"]
        return ParsedBody(model=model, body={})

    def with_model(self, parsed: ParsedBody, model: str) -> None:
        return None  # the body goes on as it came: a model rewrite does not apply

    def usage(self, request: InferenceRequest, body: bytes, *, streamed: bool) -> dict[str, Any] | None:
        if not streamed:
            return json_usage(body)[1]
        if b"usage" not in body:
            return None
        for event in sse_events(body, b"usage"):
            usage = event.get("usage") if isinstance(event, dict) else None
            if isinstance(usage, dict):
                return usage
        return None
