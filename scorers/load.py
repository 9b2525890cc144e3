"""Load scorers over scraped metrics: queue depth, KV-cache use, running requests, llm-d load-aware.

Each one reads the scrape combined with the picker's own in-flight work (`PluginContext.load`,
see `epp.framework.load`): requests sent since the last scrape and requests still in prefill
count, so a burst within one scrape interval does not all land on the endpoint that looked
idle. `useInflight: false` gives GIE's scrape-only behaviour.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence

from epp.framework import (
    INFLIGHT_LOAD,
    NO_LOAD,
    CycleState,
    Endpoint,
    EndpointLoad,
    InferenceRequest,
    InflightLedger,
    InflightLoad,
    Plugin,
    PluginContext,
    PluginParams,
    Scorer,
)
from epp.scorers.prefix import ProducerSource

# Where one cycle's endpoint loads are kept in its CycleState (per ledger), shared by the load scorers.
_LOADS_STATE_KEY = "scorers.load/endpoint-loads"
# Share of queue-scorer's score that tells apart endpoints tied on whole requests (see QueueScorer).
DEFAULT_BACKLOG_TIE_BREAK = 0.3
# llm-d's token-load-scorer default: 128 requests of 32k tokens.
DEFAULT_QUEUE_THRESHOLD_TOKENS = 4_194_304


def min_max_inverted(values: Sequence[float]) -> list[float]:
    """`(max - v) / (max - min)` per value; all 1.0 when every value is equal (GIE queue-scorer)."""
    if not values:
        return []
    low, high = min(values), max(values)
    if high == low:
        return [1.0] * len(values)
    span = high - low
    return [(high - v) / span for v in values]


class _LoadReader:
    """The picker's own in-flight load per endpoint, or none when `useInflight` is off."""

    def __init__(self, params: PluginParams, context: PluginContext) -> None:
        self.ledger: InflightLedger | None = context.load if params.bool("useInflight", True) else None

    def loads(self, state: CycleState, endpoints: Sequence[Endpoint]) -> list[EndpointLoad]:
        """The endpoints' loads, read once per scheduling cycle: the load scorers of one cycle share them."""
        ledger = self.ledger
        if ledger is None:
            return [NO_LOAD] * len(endpoints)
        key = f"{_LOADS_STATE_KEY}/{id(ledger)}"
        cached: dict[str, EndpointLoad] | None = state.get(key)
        if cached is None:
            cached = {}
            state.put(key, cached)
        out = []
        now = time.monotonic()
        for ep in endpoints:
            load = cached.get(ep.name)
            if load is None:
                load = cached[ep.name] = ledger.load(ep, now)
            out.append(load)
        return out

    def describe(self) -> str:
        return f"useInflight={str(self.ledger is not None).lower()}"


class _MinMaxScorer(Scorer):
    _metric: Callable[[Endpoint, EndpointLoad], float]

    def __init__(self, name: str, params: PluginParams, context: PluginContext) -> None:
        super().__init__(name)
        self.loads = _LoadReader(params, context)

    def describe(self) -> str:
        return self.loads.describe()

    def score(self, state: CycleState, request: InferenceRequest,
              endpoints: Sequence[Endpoint]) -> Mapping[str, float]:
        metric = type(self)._metric
        scores = min_max_inverted([metric(ep, load) for ep, load in zip(endpoints, self.loads.loads(state, endpoints))])
        return {ep.name: s for ep, s in zip(endpoints, scores)}


def backlog_tie_break(scores: Sequence[float], waiting: Sequence[float], backlog: Sequence[float],
                      share: float) -> list[float]:
    """`scores` with ties on `waiting` broken by `backlog` (less scores higher), never reordering non-ties.

    Each endpoint of a tie that differs in backlog has its score mixed with its backlog rank (1 for
    the least prefill left, 0 for the most) at weight `share` divided by the span of the counts,
    so that it stays between the scores of the neighbouring counts: of endpoints tied at the
    shortest queue, the one with the least prefill left keeps 1 and the one with the most drops
    to 1 - `share`. Unchanged when no tie differs in backlog.
    """
    groups: dict[float, list[int]] = {}
    for i, w in enumerate(waiting):
        groups.setdefault(w, []).append(i)
    span = max(1.0, max(waiting) - min(waiting)) if waiting else 1.0
    out = list(scores)
    for members in groups.values():
        if len(members) < 2:
            continue
        low, high = min(backlog[i] for i in members), max(backlog[i] for i in members)
        if high <= low:
            continue
        for i in members:
            out[i] = scores[i] * (1.0 - share / span) + share / span * (high - backlog[i]) / (high - low)
    return out


class QueueScorer(Scorer):
    """Shorter waiting queue scores higher: (maxQ - q) / (maxQ - minQ), all 1 when equal.

    With the ledger, endpoints tied on whole requests are told apart by what is left of their
    prefills (`backlogTieBreak`, a share of the score; 0 gives GIE's scores exactly).
    """

    type_name = "queue-scorer"

    def __init__(self, name: str, params: PluginParams, context: PluginContext) -> None:
        super().__init__(name)
        self.loads = _LoadReader(params, context)
        self.tie_break = params.float("backlogTieBreak", DEFAULT_BACKLOG_TIE_BREAK, minimum=0.0, maximum=0.5)

    def describe(self) -> str:
        return f"{self.loads.describe()} backlogTieBreak={self.tie_break:g}"

    def score(self, state: CycleState, request: InferenceRequest,
              endpoints: Sequence[Endpoint]) -> Mapping[str, float]:
        loads = self.loads.loads(state, endpoints)
        waiting = [load.waiting_estimate(ep.metrics) for ep, load in zip(endpoints, loads)]
        scores = min_max_inverted(waiting)
        if self.tie_break > 0.0 and self.loads.ledger is not None:
            scores = backlog_tie_break(scores, waiting, [load.prefill_backlog_tokens for load in loads],
                                       self.tie_break)
        return {ep.name: s for ep, s in zip(endpoints, scores)}


class RunningRequestsSizeScorer(_MinMaxScorer):
    """Fewer running requests scores higher: min-max like queue-scorer, on running requests."""

    type_name = "running-requests-size-scorer"

    @staticmethod
    def _metric(ep: Endpoint, load: EndpointLoad) -> float:
        return load.running_estimate(ep.metrics)


class KVCacheUtilizationScorer(Scorer):
    """Free KV cache scores higher: 1 - kv_cache_usage."""

    type_name = "kv-cache-utilization-scorer"

    def __init__(self, name: str, params: PluginParams, context: PluginContext) -> None:
        super().__init__(name)
        self.loads = _LoadReader(params, context)

    def describe(self) -> str:
        return self.loads.describe()

    def score(self, state: CycleState, request: InferenceRequest,
              endpoints: Sequence[Endpoint]) -> Mapping[str, float]:
        return {ep.name: 1.0 - load.kv_usage_estimate(ep.metrics)
                for ep, load in zip(endpoints, self.loads.loads(state, endpoints))}


class LoadAwareScorer(Scorer):
    """llm-d load-aware: empty queue 0.5, else 0.5 × (1 - min(q, threshold) / threshold)."""

    type_name = "load-aware-scorer"

    def __init__(self, name: str, params: PluginParams, context: PluginContext) -> None:
        super().__init__(name)
        # As in llm-d, a threshold of 0 or less means the default.
        threshold = params.int("threshold", 128)
        self.threshold = threshold if threshold > 0 else 128
        self.loads = _LoadReader(params, context)

    def describe(self) -> str:
        return f"threshold={self.threshold} {self.loads.describe()}"

    def score(self, state: CycleState, request: InferenceRequest,
              endpoints: Sequence[Endpoint]) -> Mapping[str, float]:
        out: dict[str, float] = {}
        for ep, load in zip(endpoints, self.loads.loads(state, endpoints)):
            q = load.waiting_estimate(ep.metrics)
            out[ep.name] = 0.5 if q <= 0 else 0.5 * (1.0 - min(q, self.threshold) / self.threshold)
        return out


def inflight_source(params: PluginParams) -> ProducerSource:
    """llm-d's `inFlightLoadProducerName`: the inflight-load-producer whose counts are read (checked at load)."""
    return ProducerSource(params, "inFlightLoadProducerName", INFLIGHT_LOAD, "in-flight load",
                          "an inflight-load-producer")


class TokenLoadScorer(Scorer):
    """Fewer in-flight tokens scores higher: 1 - min(1, (tokens + the request's own) / queueThresholdTokens)."""

    type_name = "token-load-scorer"

    def __init__(self, name: str, params: PluginParams, context: PluginContext) -> None:
        super().__init__(name)
        threshold = params.int("queueThresholdTokens", DEFAULT_QUEUE_THRESHOLD_TOKENS)
        # As in llm-d, a threshold of 0 or less means the default.
        self.threshold = threshold if threshold > 0 else DEFAULT_QUEUE_THRESHOLD_TOKENS
        self.source = inflight_source(params)

    def describe(self) -> str:
        return f"queueThresholdTokens={self.threshold}"

    def consumes(self) -> frozenset[str]:
        return frozenset({INFLIGHT_LOAD})

    def plugin_refs(self) -> Mapping[str, str]:
        """The producer `inFlightLoadProducerName` names (resolved by the loader)."""
        return self.source.refs()

    def bind_plugins(self, plugins: Mapping[str, Plugin]) -> None:
        self.source.bind(self.name, plugins)

    def score(self, state: CycleState, request: InferenceRequest,
              endpoints: Sequence[Endpoint]) -> Mapping[str, float]:
        out: dict[str, float] = {}
        data: Mapping[str, InflightLoad] = state.all_endpoint_data(self.source.read_key)
        for ep in endpoints:
            load = data.get(ep.name)
            # The request's own uncached tokens count too, so a prefix hit weighs less (llm-d).
            tokens = load.tokens + load.request_tokens if load else 0
            out[ep.name] = 1.0 - min(1.0, tokens / self.threshold)
        return out
