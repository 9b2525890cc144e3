"""`agent-identity`: which agent session (program) a request belongs to, from the agents' headers and the body.

llm-d's plugin of that name reads, first match wins, the headers of `additionalSessionHeaders`
then `x-claude-code-session-id` (Claude Code), `x-session-affinity` (opencode), `session-id`
(Codex) and `session_id` (older Codex), and makes the value the request's fairness id unless
the client sent one (`x-llm-d-inference-fairness-id`). Here it also reads, after those,
`x-session-id` and the session the body names (`InferenceRequest.body_session`: OpenAI's
`prompt_cache_key`, else `user`; Anthropic's `metadata.user_id`; `bodySession: false` turns
that off), and an operator-chosen header (`parentSessionHeader`, default `x-parent-session-id`)
that links a sub-agent to the session that spawned it.

What it publishes: `SESSION` in the request's `CycleState` (a `SessionKey(session, parent,
source)`, read by the plugins that route or order by session), and the request's fairness id:
the root of its program (the top session of a sub-agent chain, else the session itself), so a
session and its sub-agents share one flow-control queue and one attained service.

Bad input has a defined outcome: a value with control characters or bytes that were not UTF-8
(Envoy's bytes decoded with replacement characters) is not a session (the next source is read;
`epp_session_identity_rejected_total{reason="invalid"}`); a value longer than
`maxSessionIdLength` (default 256 characters) stands for itself by its SHA-256 digest
(`sha256:<32 hex>`, `reason="too_long"`), so a long id keeps its session and costs no more
memory than a short one. Sub-agent links live in a bounded table (`maxSessions`, default
100,000, least recently used out; idle ones go after `sessionTtl`, default 1h): a flood of
distinct sessions costs at most that table.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter

from epp.framework import (
    FAIRNESS_ID_HEADERS,
    SESSION,
    ConfigError,
    CycleState,
    InferenceRequest,
    PluginContext,
    PluginParams,
    PluginRegistry,
    RequestPreprocessor,
    SessionKey,
    once_per_registry,
)
from epp.scorers.session_table import DEFAULT_CAPACITY, SessionTable

# llm-d's built-in agent session headers, in its order (Claude Code, opencode, Codex, older Codex).
LLMD_SESSION_HEADERS = ("x-claude-code-session-id", "x-session-affinity", "session-id", "session_id")
# Ours, read after llm-d's: the generic session header of several gateways.
SESSION_ID_HEADER = "x-session-id"
DEFAULT_PARENT_HEADER = "x-parent-session-id"
BODY_SOURCE = "body"
DEFAULT_MAX_SESSION_ID_LENGTH = 256
DEFAULT_SESSION_TTL_S = 3600.0
DIGEST_PREFIX = "sha256:"


def _metrics(registry: CollectorRegistry | None) -> tuple[Counter, Counter]:
    def build(r: CollectorRegistry | None) -> tuple[Counter, Counter]:
        return (Counter("epp_session_identity_requests", "Requests by where agent-identity read their session "
                        "(a header name, body, or none).", ["plugin", "source"], registry=r),
                Counter("epp_session_identity_rejected", "Session values agent-identity did not take as they came "
                        "(invalid: control or non-UTF-8 characters, skipped; too_long: replaced by its digest).",
                        ["plugin", "reason"], registry=r))
    return once_per_registry(registry, "epp_session_identity", build)


def is_valid_session_value(value: str) -> bool:
    """Whether a header value can name a session: printable text that arrived as UTF-8."""
    # U+FFFD is what the transport puts where a header's bytes were not UTF-8.
    return not any(ch == "\ufffd" or ord(ch) < 0x20 or ord(ch) == 0x7F for ch in value)


def bounded_session_id(value: str, max_length: int) -> str:
    """`value`, or its SHA-256 digest (`sha256:` + 32 hex characters) when it is longer than `max_length`."""
    if len(value) <= max_length:
        return value
    return DIGEST_PREFIX + hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()[:32]


class AgentIdentity(RequestPreprocessor):
    """Reads the request's agent session (headers, then body), publishes `SESSION`, sets the fairness id to its program."""

    type_name = "agent-identity"

    def __init__(self, name: str | None = None, params: PluginParams | None = None,
                 context: PluginContext | None = None) -> None:
        super().__init__(name)
        params = params if params is not None else PluginParams(self.name, None)
        extra = params.list("additionalSessionHeaders", []) or []
        if not all(isinstance(h, str) and h.strip() for h in extra):
            raise ConfigError(f"plugin {self.name!r}: parameter 'additionalSessionHeaders' must be a list of header "
                              f"names, got {extra!r}")
        # llm-d's order: the operator's headers first, then the built-in ones; ours after those.
        headers = [h.strip().lower() for h in extra] + [*LLMD_SESSION_HEADERS, SESSION_ID_HEADER]
        self.headers = tuple(dict.fromkeys(headers))
        self.body_session = params.bool("bodySession", True)
        parent = params.str("parentSessionHeader", DEFAULT_PARENT_HEADER)
        self.parent_header = parent.strip().lower() or None
        self.max_length = params.int("maxSessionIdLength", DEFAULT_MAX_SESSION_ID_LENGTH, minimum=16)
        capacity = params.int("maxSessions", DEFAULT_CAPACITY, minimum=1)
        ttl_s = params.duration("sessionTtl", DEFAULT_SESSION_TTL_S)
        registry = context.metrics_registry if context is not None else None
        # Sub-agent -> root of its program; only linked sessions are kept.
        self.links: SessionTable[str] = SessionTable(self.name, capacity=capacity, ttl_s=ttl_s, registry=registry)
        requests, rejected = _metrics(registry)
        self._by_source = {source: requests.labels(self.name, source)
                           for source in (*self.headers, BODY_SOURCE, "none")}
        self._rejected = {reason: rejected.labels(self.name, reason) for reason in ("invalid", "too_long")}

    def describe(self) -> str:
        return (f"headers={list(self.headers)} bodySession={str(self.body_session).lower()} "
                f"parentSessionHeader={self.parent_header or 'none'} maxSessionIdLength={self.max_length} "
                f"maxSessions={self.links.capacity} sessionTtl={self.links.ttl_s:g}s")

    def debug_state(self) -> Mapping[str, Any]:
        """The link table's size and bounds (never session ids)."""
        return {"links": self.links.debug_state()}

    def _clean(self, value: str | None) -> str | None:
        """A header or body value as a session id, or None when it cannot be one."""
        if value is None:
            return None
        value = value.strip()
        if not value:
            return None
        if not is_valid_session_value(value):
            self._rejected["invalid"].inc()
            return None
        if len(value) > self.max_length:
            self._rejected["too_long"].inc()
            return bounded_session_id(value, self.max_length)
        return value

    def session_of(self, request: InferenceRequest) -> SessionKey | None:
        """The request's session (first usable source) and its parent, without touching the link table."""
        session = source = None
        for header in self.headers:
            session = self._clean(request.headers.get(header))
            if session is not None:
                source = header
                break
        if session is None and self.body_session:
            session = self._clean(request.body_session)
            source = BODY_SOURCE if session is not None else None
        if session is None or source is None:
            return None
        parent = self._clean(request.headers.get(self.parent_header)) if self.parent_header else None
        return SessionKey(session, parent if parent != session else None, source)

    def program_of(self, key: SessionKey) -> str:
        """The root session of `key`'s program, remembering a sub-agent's link to it."""
        if key.parent is None:
            linked = self.links.get(key.session)
            return linked if linked is not None else key.session
        root = self.links.get(key.parent) or key.parent
        self.links.put(key.session, root)
        return root

    def preprocess(self, state: CycleState, request: InferenceRequest) -> InferenceRequest:
        key = self.session_of(request)
        self._by_source[key.source if key is not None else "none"].inc()
        if key is None:
            return request
        root = self.program_of(key)
        if key.parent is None and root != key.session:
            key = dataclasses.replace(key, parent=root)  # linked earlier: its program's root is its parent
        state.put(SESSION, key)
        if any(request.headers.get(h) for h in FAIRNESS_ID_HEADERS):
            return request  # the client's own fairness id wins (as in llm-d)
        return dataclasses.replace(request, fairness_id=root) if request.fairness_id != root else request


def register(registry: PluginRegistry) -> None:
    """Register `agent-identity`."""
    registry.register_class(AgentIdentity)
