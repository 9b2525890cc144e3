"""`concurrency-detector`: saturation as the requests (or tokens) this picker has in flight, over the pool's capacity.

llm-d's semantics. Each endpoint is worth `maxConcurrency` requests (`maxTokenConcurrency`
tokens); the detector counts what the picker sent to each endpoint and has not seen finish
(counted when the request is placed, released when its response ends or its stream dies), so it
reacts at once, with no scrape in between:

    requests (default)   saturation = in-flight requests on the pool / (endpoints x maxConcurrency)
    tokens               saturation = in-flight tokens on the pool / (endpoints x maxTokenConcurrency)
    hybrid               the mean over endpoints of max(requests / maxConcurrency, tokens / maxTokenConcurrency)

As `flowControl.saturationDetector` it gates dispatch (the pool is full at 1.0). In a
scheduling profile it is also a filter: it keeps the endpoints whose in-flight count is below
`maxConcurrency x (1 + headroom)` (tokens likewise in `tokens` and `hybrid` mode), so affinity
may burst an endpoint past its share by the headroom and no further.

A request's tokens are its prompt tokens (the token producer's exact count when it ran, else
the picker's estimate from the prompt's characters). Requests flow control let through but not
yet placed count too (spread over the pool), so one dispatch cycle cannot let a whole queue pass.
`inFlightLoadProducerName` is accepted (it must name an `inflight-load-producer`); the counts
are this detector's own, which release at the end of the response.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from epp.framework.datakeys import INFLIGHT_LOAD, PROMPT_TOKENS
from epp.framework.errors import ConfigError
from epp.framework.load import estimate_prompt_tokens
from epp.framework.params import PluginParams
from epp.framework.plugin import (
    CycleState,
    DataProducer,
    Filter,
    Plugin,
    PluginContext,
    PreRequestHook,
    ResponseCompleteHook,
    SaturationDetector,
    SchedulingResult,
)
from epp.framework.types import Endpoint, InferenceRequest, ResponseInfo

MODES = ("requests", "tokens", "hybrid")


class ConcurrencyDetector(SaturationDetector, Filter, PreRequestHook, ResponseCompleteHook):
    """Pool saturation = in-flight requests (or tokens) over the endpoints' summed capacity; filters full endpoints."""

    type_name = "concurrency-detector"

    def __init__(self, name: str | None = None, params: PluginParams | None = None,
                 context: PluginContext | None = None, *, max_concurrency: int = 100,
                 max_token_concurrency: int = 1_000_000, headroom: float = 0.0, mode: str = "requests") -> None:
        super().__init__(name)
        producer = None
        if params is not None:
            max_concurrency = params.int("maxConcurrency", max_concurrency)
            max_token_concurrency = params.int("maxTokenConcurrency", max_token_concurrency)
            headroom = params.float("headroom", headroom)
            mode = params.str("concurrencyMode", mode, choices=MODES)
            producer = params.str("inFlightLoadProducerName", None)
        if max_concurrency <= 0:
            raise ConfigError(f"plugin {self.name!r}: parameter 'maxConcurrency' must be > 0, got {max_concurrency}")
        if max_token_concurrency <= 0:
            raise ConfigError(f"plugin {self.name!r}: parameter 'maxTokenConcurrency' must be > 0, got "
                              f"{max_token_concurrency}")
        if headroom < 0:
            raise ConfigError(f"plugin {self.name!r}: parameter 'headroom' must be >= 0, got {headroom:g}")
        if mode not in MODES:
            raise ConfigError(f"plugin {self.name!r}: concurrencyMode must be one of {', '.join(MODES)}, got {mode!r}")
        self.max_concurrency = max_concurrency
        self.max_token_concurrency = max_token_concurrency
        self.headroom = headroom
        self.mode = mode
        self.refs = {"inFlightLoadProducerName": producer} if producer else {}
        self.requests: dict[str, int] = {}
        self.tokens: dict[str, int] = {}
        self._mean_tokens = 0.0  # of placed requests, for requests flow control let through but not yet placed
        self._placed = 0

    def describe(self) -> str:
        return (f"concurrencyMode={self.mode} maxConcurrency={self.max_concurrency} "
                f"maxTokenConcurrency={self.max_token_concurrency} headroom={self.headroom:g}")

    def debug_state(self) -> Mapping[str, Any]:
        """In-flight totals (the per-endpoint counts are in the endpoint metrics)."""
        return {"mode": self.mode, "inflight_requests": sum(self.requests.values()),
                "inflight_tokens": sum(self.tokens.values()), "endpoints": len(self.requests)}

    def plugin_refs(self) -> Mapping[str, str]:
        """The producer `inFlightLoadProducerName` names (resolved by the loader)."""
        return self.refs

    def bind_plugins(self, plugins: Mapping[str, Plugin]) -> None:
        """Check that the named plugin is an in-flight load producer."""
        for param, producer in plugins.items():
            if not isinstance(producer, DataProducer) or INFLIGHT_LOAD not in producer.produces():
                raise ConfigError(f"plugin {self.name!r}: parameter {param!r} names {producer.name!r} (type "
                                  f"{producer.type_name}), which does not produce in-flight load; name an "
                                  "inflight-load-producer")

    # -- counting -----------------------------------------------------------------------------

    def pre_request(self, state: CycleState, request: InferenceRequest, result: SchedulingResult) -> None:
        if not result.targets:
            return
        endpoint = result.targets[0].name
        tokens_data = state.get(PROMPT_TOKENS)
        tokens = len(tokens_data.token_ids) if tokens_data is not None else estimate_prompt_tokens(request)
        self.requests[endpoint] = self.requests.get(endpoint, 0) + 1
        self.tokens[endpoint] = self.tokens.get(endpoint, 0) + tokens
        self._placed += 1
        self._mean_tokens += (tokens - self._mean_tokens) / min(self._placed, 1000)
        state.put(self.name, (endpoint, tokens))

    def on_response_complete(self, state: CycleState, request: InferenceRequest, response: ResponseInfo,
                             target: Endpoint | None) -> None:
        counted = state.get(self.name)
        if counted is None:
            return
        state.put(self.name, None)  # released once
        endpoint, tokens = counted
        left = self.requests.get(endpoint, 0) - 1
        if left > 0:
            self.requests[endpoint] = left
            self.tokens[endpoint] = max(0, self.tokens.get(endpoint, 0) - tokens)
        else:  # nothing left there: forget the endpoint (the maps hold only endpoints with work in flight)
            self.requests.pop(endpoint, None)
            self.tokens.pop(endpoint, None)

    # -- saturation and filter ----------------------------------------------------------------

    def saturation(self, endpoints: Sequence[Endpoint]) -> float:
        return self.saturation_with_pending(endpoints, 0)

    def saturation_with_pending(self, endpoints: Sequence[Endpoint], pending: int) -> float:
        """Saturation counting `pending` requests let through but not placed yet (spread over the endpoints)."""
        n = len(endpoints)
        if n == 0:
            return 1.0
        share = pending / n
        if self.mode == "hybrid":
            total = 0.0
            for ep in endpoints:
                requests = self.requests.get(ep.name, 0) + share
                tokens = self.tokens.get(ep.name, 0) + share * self._mean_tokens
                total += max(requests / self.max_concurrency, tokens / self.max_token_concurrency)
            return total / n
        if self.mode == "tokens":
            tokens = sum(self.tokens.get(ep.name, 0) for ep in endpoints) + pending * self._mean_tokens
            return tokens / (n * self.max_token_concurrency)
        requests = sum(self.requests.get(ep.name, 0) for ep in endpoints) + pending
        return requests / (n * self.max_concurrency)

    def filter(self, state: CycleState, request: InferenceRequest, endpoints: Sequence[Endpoint]) -> list[Endpoint]:
        request_limit = self.max_concurrency * (1.0 + self.headroom)
        token_limit = self.max_token_concurrency * (1.0 + self.headroom)
        kept = []
        for ep in endpoints:
            requests_ok = self.requests.get(ep.name, 0) < request_limit
            tokens_ok = self.tokens.get(ep.name, 0) < token_limit
            if (self.mode == "requests" and requests_ok) or (self.mode == "tokens" and tokens_ok) or (
                    self.mode == "hybrid" and requests_ok and tokens_ok):
                kept.append(ep)
        return kept
