"""Affinity scorers: session stickiness by header, and spreading of cache-cold requests (no-hit LRU)."""

from __future__ import annotations

import base64
import binascii
from collections import OrderedDict
from collections.abc import Mapping, Sequence

from epp.framework import (
    PREFIX_MATCH_INFO,
    CycleState,
    Endpoint,
    InferenceRequest,
    PluginContext,
    PluginParams,
    PreRequestHook,
    ResponseHeadersHook,
    ResponseInfo,
    SchedulingResult,
    Scorer,
)

SESSION_HEADER = "x-session-token"
PREFILL_PROFILE = "prefill"


def session_token(endpoint_name: str) -> str:
    """The session token naming an endpoint: base64 of its `ip:port`."""
    return base64.b64encode(endpoint_name.encode()).decode()


class SessionAffinityScorer(Scorer, ResponseHeadersHook):
    """1.0 for the endpoint named by header `x-session-token`, 0 otherwise; the response carries the token."""

    type_name = "session-affinity-scorer"

    def score(self, state: CycleState, request: InferenceRequest,
              endpoints: Sequence[Endpoint]) -> Mapping[str, float]:
        token = request.headers.get(SESSION_HEADER)
        wanted = None
        if token:
            try:
                wanted = base64.b64decode(token, validate=True).decode()
            except (binascii.Error, UnicodeDecodeError):
                wanted = None
        return {ep.name: 1.0 if ep.name == wanted else 0.0 for ep in endpoints}

    def on_response_headers(self, state: CycleState, request: InferenceRequest, response: ResponseInfo,
                            target: Endpoint | None) -> None:
        if target is not None:
            response.set_headers[SESSION_HEADER] = session_token(target.name)


class NoHitLRUScorer(Scorer, PreRequestHook):
    """Cold requests (no prefix hit anywhere) go to the least recently cold-picked endpoint; warm: 0.5 all."""

    type_name = "no-hit-lru-scorer"

    def __init__(self, name: str, params: PluginParams, context: PluginContext) -> None:
        super().__init__(name)
        # Accepted for llm-d config compatibility: here the prefix data comes by data key, not plugin name.
        self.prefix_plugin_name = params.str("prefixPluginName", "prefix-cache-scorer")
        self.prefix_plugin_type = params.str("prefixPluginType", "prefix-cache-scorer")
        self.lru_size = params.int("lruSize", 1024, minimum=1)
        self._lru: OrderedDict[str, None] = OrderedDict()  # least recently cold-picked first

    def describe(self) -> str:
        return f"lruSize={self.lru_size}"

    def consumes(self) -> frozenset[str]:
        return frozenset({PREFIX_MATCH_INFO})

    def score(self, state: CycleState, request: InferenceRequest,
              endpoints: Sequence[Endpoint]) -> Mapping[str, float]:
        data = state.all_endpoint_data(PREFIX_MATCH_INFO)
        cold = not any(info.matched_blocks > 0 for info in data.values())
        state.put(self.name, cold)
        if not cold:
            return {ep.name: 0.5 for ep in endpoints}
        names = {ep.name for ep in endpoints}
        used = [name for name in self._lru if name in names]
        used_set = set(used)
        ranked = [ep.name for ep in endpoints if ep.name not in used_set] + used
        n = len(ranked)
        if n == 1:
            return {ranked[0]: 1.0}
        return {name: 1.0 - rank / (n - 1) for rank, name in enumerate(ranked)}

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
