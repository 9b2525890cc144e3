"""Affinity scorers: session stickiness by header, and spreading of cache-cold requests (no-hit LRU)."""

from __future__ import annotations

import base64
import binascii
import itertools
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence

from prometheus_client import CollectorRegistry, Gauge

from epp.framework import (
    PREFIX_MATCH_INFO,
    SESSION,
    ConfigError,
    CycleState,
    Endpoint,
    Filter,
    InferenceRequest,
    Plugin,
    PluginContext,
    PluginParams,
    PreRequestHook,
    ResponseHeadersHook,
    ResponseInfo,
    SchedulingResult,
    Scorer,
    SessionKey,
    once_per_registry,
)
from epp.scorers.prefix import prefix_source

SESSION_HEADER = "x-session-token"
SESSION_ID_HEADER = "x-session-id"
# llm-d's agent-identity request attribute: here, the session of the SESSION data key.
AGENT_IDENTITY_ATTRIBUTE = "agent-identity"
PREFILL_PROFILE = "prefill"
STRATEGIES = ("encoded_endpoint_header", "session_id")
# Sessions a session_id scorer remembers at most (least recently used dropped first).
MAX_SESSIONS = 100_000


def session_token(endpoint_name: str) -> str:
    """The session token naming an endpoint: base64 of its `ip:port`."""
    return base64.b64encode(endpoint_name.encode()).decode()


def _sessions_gauge(registry: CollectorRegistry | None) -> Gauge:
    return once_per_registry(registry, "epp_session_affinity_sessions", lambda r: Gauge(
        "epp_session_affinity_sessions", "Session ids a session-affinity-scorer (strategy session_id) has bound "
        "to an endpoint.", ["plugin"], registry=r))


class _SessionAffinity(PreRequestHook, ResponseHeadersHook):
    """What llm-d's session-affinity scorer and filter share: the session's endpoint, bound and remembered.

    `encoded_endpoint_header` (default): the client echoes the token the previous response carried
    in `encodedEndpointHeaderConfig.header` (base64 of the endpoint). `session_id`: the session id
    (`sessionIdConfig.sources`: headers, or `attribute: agent-identity`, the session the session
    producer found) is bound to the session's last pick, forgotten after `evictionTtlSeconds` idle
    (swept every `evictionSweepSeconds`; at most 100,000 sessions, least recently used first out).
    `profileName`: whose pick is remembered (default: the primary one).
    """

    def _configure(self, name: str, params: PluginParams, context: PluginContext) -> None:
        self.strategy = params.str("strategy", STRATEGIES[0], choices=STRATEGIES)
        self.profile_name = params.str("profileName", None)
        header_config = params.mapping("encodedEndpointHeaderConfig", None) or {}
        self.header = _header_of(name, "encodedEndpointHeaderConfig", header_config, SESSION_HEADER)
        id_config = dict(params.mapping("sessionIdConfig", None) or {})
        unknown = sorted(set(id_config) - {"sources", "evictionTtlSeconds", "evictionSweepSeconds"})
        if unknown:
            raise ConfigError(f"plugin {name!r}: parameter 'sessionIdConfig': unknown field(s) {unknown}; allowed: "
                              "sources, evictionTtlSeconds, evictionSweepSeconds")
        self.id_sources = _id_sources(name, id_config.get("sources"))
        self.ttl_s = _seconds(name, "evictionTtlSeconds", id_config.get("evictionTtlSeconds"), 300)
        self.sweep_s = _seconds(name, "evictionSweepSeconds", id_config.get("evictionSweepSeconds"), 10)
        self._sessions: OrderedDict[str, tuple[str, float]] = OrderedDict()  # id -> (endpoint, last use)
        self._last_sweep = time.monotonic()
        self._gauge = _sessions_gauge(context.metrics_registry).labels(plugin=name)

    def describe(self) -> str:
        if self.strategy == "session_id":
            sources = [value if kind == "header" else f"attribute:{value}" for kind, value in self.id_sources]
            return (f"strategy=session_id sources={sources} evictionTtlSeconds={self.ttl_s:g} "
                    f"evictionSweepSeconds={self.sweep_s:g}")
        return f"strategy=encoded_endpoint_header header={self.header}"

    def debug_state(self) -> Mapping[str, object]:
        """How many sessions are bound (never their ids: clients choose them)."""
        return {"strategy": self.strategy, "sessions": len(self._sessions), "max_sessions": MAX_SESSIONS,
                "ttl_s": self.ttl_s}

    def _session_id(self, state: CycleState, request: InferenceRequest) -> str | None:
        for kind, value in self.id_sources:
            if kind == "header":
                found = request.headers.get(value, "").strip()
            else:
                session: SessionKey | None = state.get(SESSION)
                found = session.session.strip() if session is not None else ""
            if found:
                return found
        return None

    def _wanted(self, state: CycleState, request: InferenceRequest) -> str | None:
        if self.strategy == "session_id":
            session = self._session_id(state, request)
            bound = self._sessions.get(session) if session else None
            return bound[0] if bound is not None and time.monotonic() - bound[1] <= self.ttl_s else None
        token = request.headers.get(self.header)
        if not token:
            return None
        try:
            return base64.b64decode(token, validate=True).decode()
        except (binascii.Error, UnicodeDecodeError):
            return None

    def _pick(self, result: SchedulingResult) -> Endpoint | None:
        if self.profile_name is None:
            return result.targets[0] if result.targets else None
        picked = result.profile_results.get(self.profile_name)
        return picked.targets[0] if picked is not None and picked.targets else None

    def pre_request(self, state: CycleState, request: InferenceRequest, result: SchedulingResult) -> None:
        name = self.name
        target = self._pick(result)
        state.put(name, target)
        if self.strategy != "session_id" or target is None:
            return
        session = self._session_id(state, request)
        if not session:
            return
        now = time.monotonic()
        self._sessions.pop(session, None)
        self._sessions[session] = (target.name, now)
        if now - self._last_sweep >= self.sweep_s:
            self._last_sweep = now
            while self._sessions and now - next(iter(self._sessions.values()))[1] > self.ttl_s:
                self._sessions.popitem(last=False)
        while len(self._sessions) > MAX_SESSIONS:
            self._sessions.popitem(last=False)
        self._gauge.set(len(self._sessions))

    def on_response_headers(self, state: CycleState, request: InferenceRequest, response: ResponseInfo,
                            target: Endpoint | None) -> None:
        if self.strategy != "encoded_endpoint_header":
            return
        picked = state.get(self.name, target)
        if picked is not None:
            response.set_headers[self.header] = session_token(picked.name)


class SessionAffinityScorer(_SessionAffinity, Scorer):
    """1.0 for the endpoint the request's session names, 0 otherwise (llm-d's two strategies; a soft preference)."""

    type_name = "session-affinity-scorer"

    def __init__(self, name: str, params: PluginParams, context: PluginContext) -> None:
        Scorer.__init__(self, name)
        self._configure(name, params, context)

    def score(self, state: CycleState, request: InferenceRequest,
              endpoints: Sequence[Endpoint]) -> Mapping[str, float]:
        wanted = self._wanted(state, request)
        return {ep.name: 1.0 if ep.name == wanted else 0.0 for ep in endpoints}


class SessionAffinityFilter(_SessionAffinity, Filter):
    """Only the endpoint the request's session names, when it is a candidate; else all (llm-d's hard pin)."""

    type_name = "session-affinity-filter"

    def __init__(self, name: str, params: PluginParams, context: PluginContext) -> None:
        Filter.__init__(self, name)
        self._configure(name, params, context)

    def filter(self, state: CycleState, request: InferenceRequest, endpoints: Sequence[Endpoint]) -> list[Endpoint]:
        wanted = self._wanted(state, request)
        pinned = [ep for ep in endpoints if ep.name == wanted] if wanted else []
        return pinned or list(endpoints)


def _header_of(plugin: str, param: str, config: Mapping[str, object], default: str) -> str:
    unknown = sorted(set(config) - {"header"})
    if unknown:
        raise ConfigError(f"plugin {plugin!r}: parameter {param!r}: unknown field(s) {unknown}; allowed: header")
    header = config.get("header", default)
    if not isinstance(header, str) or not header:
        raise ConfigError(f"plugin {plugin!r}: parameter '{param}.header' must be a header name, got {header!r}")
    return header.lower()


def _id_sources(plugin: str, raw: object) -> tuple[tuple[str, str], ...]:
    """`sessionIdConfig.sources` in order: `("header", name)`, or `("attribute", "agent-identity")`."""
    if raw is None:
        return (("header", SESSION_ID_HEADER),)
    if not isinstance(raw, list) or not raw:
        raise ConfigError(f"plugin {plugin!r}: parameter 'sessionIdConfig.sources' must be a list of {{header}} or "
                          "{attribute}")
    sources: list[tuple[str, str]] = []
    for i, source in enumerate(raw):
        path = f"sessionIdConfig.sources[{i}]"
        if isinstance(source, dict) and "attribute" in source:
            unknown = sorted(set(source) - {"attribute", "producer"})
            if unknown:
                raise ConfigError(f"plugin {plugin!r}: parameter {path!r}: {unknown} with 'attribute'; allowed: "
                                  "attribute, producer (exactly one of header or attribute)")
            if source["attribute"] != AGENT_IDENTITY_ATTRIBUTE:
                raise ConfigError(f"plugin {plugin!r}: parameter '{path}.attribute' {source['attribute']!r} is not "
                                  f"published here; allowed: {AGENT_IDENTITY_ATTRIBUTE} (the session the session "
                                  "producer found)")
            sources.append(("attribute", AGENT_IDENTITY_ATTRIBUTE))
            continue
        sources.append(("header", _header_of(plugin, path, source if isinstance(source, dict)
                                             else {"header": source}, SESSION_ID_HEADER)))
    return tuple(sources)


def _seconds(plugin: str, key: str, value: object, default: float) -> float:
    if value is None:
        return float(default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ConfigError(f"plugin {plugin!r}: parameter 'sessionIdConfig.{key}' must be a positive number of "
                          f"seconds, got {value!r}")
    return float(value)


class NoHitLRUScorer(Scorer, PreRequestHook):
    """Cold requests (no prefix hit anywhere) go to the least recently cold-picked endpoint; warm: 0.5 all."""

    type_name = "no-hit-lru-scorer"

    def __init__(self, name: str, params: PluginParams, context: PluginContext) -> None:
        super().__init__(name)
        # Accepted for llm-d config compatibility: here the prefix data comes by data key, not plugin name.
        self.prefix_plugin_name = params.str("prefixPluginName", "prefix-cache-scorer")
        self.prefix_plugin_type = params.str("prefixPluginType", "prefix-cache-scorer")
        lru_size = params.int("lruSize", 1024)
        self.lru_size = lru_size if lru_size > 0 else 1024  # as llm-d: 0 or less is the default
        self.source = prefix_source(params)
        self._lru: OrderedDict[str, None] = OrderedDict()  # least recently cold-picked first

    def describe(self) -> str:
        return f"lruSize={self.lru_size}"

    def consumes(self) -> frozenset[str]:
        return frozenset({PREFIX_MATCH_INFO})

    def debug_state(self) -> Mapping[str, object]:
        """Cold picks remembered; the first of them are the next cold requests' last choices."""
        return {"lru_size": self.lru_size, "tracked": len(self._lru),
                "most_recent_cold_picks": list(itertools.islice(reversed(self._lru), 16))}

    def plugin_refs(self) -> Mapping[str, str]:
        """The producer `prefixMatchInfoProducerName` names (resolved by the loader)."""
        return self.source.refs()

    def bind_plugins(self, plugins: Mapping[str, Plugin]) -> None:
        self.source.bind(self.name, plugins)

    def score(self, state: CycleState, request: InferenceRequest,
              endpoints: Sequence[Endpoint]) -> Mapping[str, float]:
        data = state.all_endpoint_data(self.source.read_key)
        cold = not any(info.matched_blocks > 0 for info in data.values())
        state.put(self.name, cold)
        if not cold:
            return {ep.name: 0.5 for ep in endpoints}
        n = len(endpoints)
        if n == 1:
            return {endpoints[0].name: 1.0}
        # As llm-d: never cold-picked endpoints first, in candidate order, then the remembered ones by their
        # place among everything remembered (least recent first), so a score may skip and floors at 0.
        position = {name: i for i, name in enumerate(self._lru)}
        never = [ep.name for ep in endpoints if ep.name not in position]
        out = {name: 1.0 - rank / (n - 1) for rank, name in enumerate(never)}
        for ep in endpoints:
            if ep.name in position:
                out[ep.name] = max(0.0, 1.0 - (len(never) + position[ep.name]) / (n - 1))
        return out

    def pre_request(self, state: CycleState, request: InferenceRequest, result: SchedulingResult) -> None:
        if not state.get(self.name):
            return
        targets = list(result.targets[:1])
        prefill = result.profile_results.get(PREFILL_PROFILE)
        if prefill is not None and prefill.targets and result.primary_profile != PREFILL_PROFILE:
            targets.append(prefill.targets[0])
        for ep in targets:
            self._lru.pop(ep.name, None)
            self._lru[ep.name] = None
        while len(self._lru) > self.lru_size:
            self._lru.popitem(last=False)
