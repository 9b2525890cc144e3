"""Read a buffered request into an `InferenceRequest`: its parser (by path) reads the body, the headers the rest.

The parsers are plugins (`epp.framework.Parser`, one per API format: epp.scorers.parsers and any
outside package's), in the order of the config's `requestHandler.parsers`: a path goes to the
first parser that claims it, else to the first fallback (a parser that claims no path,
`passthrough-parser`). What the headers say is the same for every API: the objective and its
priority, the fairness id, the model rewrite, the latency objectives.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from epp.framework.errors import ErrorCode, InferenceError
from epp.framework.headers import (
    FAIRNESS_ID_HEADERS,
    MODEL_REWRITE_HEADERS,
    OBJECTIVE_HEADERS,
    SLO_TPOT_MS_HEADERS,
    SLO_TTFT_MS_HEADERS,
    header_value,
)
from epp.framework.parsing import DEFAULT_PARSER_TYPES, ParseLimits, Parser
from epp.framework.plugin import PluginContext
from epp.framework.registry import PluginRegistry, default_registry
from epp.framework.types import InferenceRequest, openai_error_body
from epp.limits import DEFAULT_MAX_JSON_DEPTH, DEFAULT_MAX_PROMPT_CHARS

DEFAULT_FAIRNESS_ID = "default-flow"
# An SLO header past this (about 11.6 days) is not a latency objective; it is refused.
MAX_SLO_MS = 1e9
DEFAULT_PATH = "/v1/completions"
# The API a fallback parser's requests are named by.
PASSTHROUGH_API = "passthrough"


def request_path(headers: Mapping[str, str]) -> str:
    """The request's path: `:path`, else `x-original-path`, else `x-forwarded-path`, else `/v1/completions`."""
    return headers.get(":path") or headers.get("x-original-path") or headers.get("x-forwarded-path") \
        or DEFAULT_PATH


def bare_path(path: str) -> str:
    """A path as parsers match it: without its query string and trailing slash."""
    return path.split("?", 1)[0].rstrip("/")


def _bad(message: str) -> InferenceError:
    return InferenceError(ErrorCode.BAD_REQUEST, message)


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


def default_parsers(registry: PluginRegistry | None = None,
                    context: PluginContext | None = None) -> tuple[Parser, ...]:
    """llm-d's default parser chain (`DEFAULT_PARSER_TYPES`), built from the registry."""
    registry = registry or default_registry()
    context = context or PluginContext()
    parsers = []
    for type_name in DEFAULT_PARSER_TYPES:
        plugin = registry.build(type_name, type_name, None, context)
        if not isinstance(plugin, Parser):
            raise TypeError(f"plugin type {type_name} is not a Parser")
        parsers.append(plugin)
    return tuple(parsers)


class RequestParser:
    """Turns a request's headers and body into an `InferenceRequest` and the body to send on.

    `parsers`: the chain, in order (default: llm-d's default chain from the installed plugins).
    A path that no parser claims, with no fallback in the chain, is answered 404.
    """

    def __init__(self, objective_priorities: Mapping[str, int] | None = None, *,
                 parsers: Sequence[Parser] | None = None,
                 max_json_depth: int = DEFAULT_MAX_JSON_DEPTH, max_prompt_chars: int = DEFAULT_MAX_PROMPT_CHARS) -> None:
        self.objective_priorities = dict(objective_priorities or {})
        self.parsers = tuple(parsers) if parsers else default_parsers()
        self.fallback = next((p for p in self.parsers if p.fallback), None)
        # The bounds every parser applies, the same for every request.
        self.limits = ParseLimits(max_json_depth, max_prompt_chars)

    def parser_for(self, path: str) -> tuple[Parser, str] | None:
        """The parser that reads `path` and the API it names, or None when none claims it and there is no fallback."""
        # A few suffix comparisons per parser: cheaper than any cache of paths would be to bound.
        bare = bare_path(path)
        for parser in self.parsers:
            api = parser.api_for(bare)
            if api is not None:
                return parser, api
        return (self.fallback, PASSTHROUGH_API) if self.fallback is not None else None

    def path_affinity(self, path: str) -> str | None:
        """The endpoint a request without a body must go to, when a parser says its path names stored state."""
        bare = bare_path(path)
        for parser in self.parsers:
            endpoint = parser.path_affinity(bare)
            if endpoint is not None:
                return endpoint
        return None

    def error_body(self, err: InferenceError, path: str | None) -> bytes:
        """The body of an error answer in the shape the path's API's clients read (OpenAI's when none claims it)."""
        found = self.parser_for(path) if path else None
        return found[0].error_body(err) if found is not None else openai_error_body(err)

    def parse(self, *, request_id: str, headers: Mapping[str, str], body: bytes,
              subset_hint: tuple[str, ...] | None) -> tuple[InferenceRequest, bytes]:
        """Parse and validate; returns the request and the body to forward (rewritten if needed)."""
        path = request_path(headers)
        found = self.parser_for(path)
        if found is None:
            raise InferenceError(ErrorCode.NOT_FOUND, f"no parser of this picker reads path {bare_path(path)!r} "
                                 f"(requestHandler.parsers: {', '.join(p.name for p in self.parsers)})")
        parser, api = found
        limits = self.limits
        parsed = parser.parse(body, api=api, path=path, limits=limits)
        # Counted once by the parser for every plugin that reads it, and bounded: tokenizing and
        # hashing a prompt cost in proportion to it (one past the limit is enough to know).
        if parsed.prompt_chars is not None and parsed.prompt_chars > limits.max_prompt_chars:
            raise InferenceError(ErrorCode.PAYLOAD_TOO_LARGE,
                                 f"prompt exceeds the limit of {limits.max_prompt_chars} characters "
                                 "(epp serve --max-prompt-chars)")
        model = parsed.model
        target_model = header_value(headers, MODEL_REWRITE_HEADERS) or model
        content, forwarded = parsed.body, body
        if target_model != model:
            rewritten = parser.with_model(parsed, target_model)
            if rewritten is None:
                target_model = model  # a format whose bodies go on as they came
            else:
                content, forwarded = rewritten
        objective = header_value(headers, OBJECTIVE_HEADERS)
        request = InferenceRequest(
            request_id=request_id,
            api=api,
            model=model,
            target_model=target_model,
            body=content,
            headers=headers,
            stream=parsed.stream,
            cache_salt=parsed.cache_salt,
            priority=self.objective_priorities.get(objective, 0) if objective else 0,
            objective=objective,
            fairness_id=header_value(headers, FAIRNESS_ID_HEADERS) or DEFAULT_FAIRNESS_ID,
            subset_hint=subset_hint,
            path=path,
            slo_ttft_ms=slo_ms(headers, SLO_TTFT_MS_HEADERS),
            slo_tpot_ms=slo_ms(headers, SLO_TPOT_MS_HEADERS),
            prompt_chars=parsed.prompt_chars,
            body_session=parsed.session,
            format=parser,
            pinned_endpoint=parsed.pinned_endpoint,
        )
        return request, forwarded
