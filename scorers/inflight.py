"""Scorers and producers that count what the picker itself has in flight per endpoint."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from epp.framework import (
    INFLIGHT_LOAD,
    ConfigError,
    CycleState,
    DataProducer,
    Endpoint,
    InferenceRequest,
    InflightLoad,
    Plugin,
    PluginContext,
    PluginParams,
    PreRequestHook,
    ResponseCompleteHook,
    ResponseInfo,
    SchedulingResult,
    Scorer,
)
from epp.scorers.inflight_tracker import InflightTracker, tracked_requests_gauge
from epp.scorers.prompt_text import user_input_length

CHARACTERS_PER_TOKEN = 4
OUTPUT_TO_INPUT_RATIO = 1.5


def estimate_tokens(request: InferenceRequest) -> int:
    """Input tokens at 4 characters each, plus 1.5× that for the output (GIE token estimator)."""
    input_tokens = user_input_length(request) / CHARACTERS_PER_TOKEN
    return int(input_tokens * (1.0 + OUTPUT_TO_INPUT_RATIO))


def _tracker(params: PluginParams, context: PluginContext, default_timeout_s: float) -> InflightTracker:
    timeout = params.duration("requestTimeout", default_timeout_s)
    if timeout <= 0:
        raise ConfigError(f"plugin {params.plugin_name!r}: parameter 'requestTimeout' must be positive, got {timeout}s")
    gauge = tracked_requests_gauge(context.metrics_registry).labels(plugin=params.plugin_name)
    return InflightTracker(timeout, gauge=gauge)


class ActiveRequestScorer(Scorer, PreRequestHook, ResponseCompleteHook):
    """Fewer requests in flight from this picker scores higher: 1 at or under `idleThreshold`, else
    (max - n) / max x `maxBusyScore` (llm-d's gap between idle and busy endpoints)."""

    type_name = "active-request-scorer"

    def __init__(self, name: str, params: PluginParams, context: PluginContext) -> None:
        super().__init__(name)
        self.tracker = _tracker(params, context, 120.0)
        self.idle_threshold = params.int("idleThreshold", 0, minimum=0)
        self.max_busy_score = params.float("maxBusyScore", 1.0, minimum=0.0, maximum=1.0)
        # llm-d reads the counts of an inflight-load-producer; named, the same counts come from it.
        producer = params.str("inFlightLoadProducerName", None)
        self.refs = {"inFlightLoadProducerName": producer} if producer else {}

    def describe(self) -> str:
        source = (f"inFlightLoadProducerName={self.refs['inFlightLoadProducerName']}" if self.refs
                  else f"requestTimeout={self.tracker.timeout_s:g}s")
        return f"idleThreshold={self.idle_threshold} maxBusyScore={self.max_busy_score:g} {source}"

    def consumes(self) -> frozenset[str]:
        return frozenset({INFLIGHT_LOAD}) if self.refs else frozenset()

    def debug_state(self) -> Mapping[str, object]:
        return self.tracker.debug_state()

    def plugin_refs(self) -> Mapping[str, str]:
        """The producer `inFlightLoadProducerName` names (resolved by the loader)."""
        return self.refs

    def bind_plugins(self, plugins: Mapping[str, Plugin]) -> None:
        for param, producer in plugins.items():
            if not isinstance(producer, DataProducer) or INFLIGHT_LOAD not in producer.produces():
                raise ConfigError(f"plugin {self.name!r}: parameter {param!r} names {producer.name!r} (type "
                                  f"{producer.type_name}), which does not produce in-flight load; name an "
                                  "inflight-load-producer")

    def _counts(self, state: CycleState, endpoints: Sequence[Endpoint]) -> list[int]:
        if self.refs:
            loads = state.all_endpoint_data(INFLIGHT_LOAD)
            return [loads[ep.name].requests if ep.name in loads else 0 for ep in endpoints]
        self.tracker.expire()
        return [self.tracker.requests(ep.name) for ep in endpoints]

    def score(self, state: CycleState, request: InferenceRequest,
              endpoints: Sequence[Endpoint]) -> Mapping[str, float]:
        counts = self._counts(state, endpoints)
        top = max(counts, default=0)
        idle, busy = self.idle_threshold, self.max_busy_score
        return {ep.name: 1.0 if c <= idle else (top - c) / top * busy for ep, c in zip(endpoints, counts)}

    def pre_request(self, state: CycleState, request: InferenceRequest, result: SchedulingResult) -> None:
        if self.refs:
            return  # the named producer counts
        targets = [r.targets[0].name for r in result.profile_results.values() if r is not None and r.targets]
        if targets:
            state.put(self.name, self.tracker.start(targets))

    def on_response_complete(self, state: CycleState, request: InferenceRequest, response: ResponseInfo,
                             target: Endpoint | None) -> None:
        self.tracker.finish(state.get(self.name))
        state.put(self.name, None)


class InflightLoadProducer(DataProducer, PreRequestHook, ResponseCompleteHook):
    """Publishes in-flight requests and estimated tokens per endpoint (INFLIGHT_LOAD)."""

    type_name = "inflight-load-producer"

    def __init__(self, name: str, params: PluginParams, context: PluginContext) -> None:
        super().__init__(name)
        self.tracker = _tracker(params, context, 300.0)

    def describe(self) -> str:
        return f"requestTimeout={self.tracker.timeout_s:g}s"

    def produces(self) -> frozenset[str]:
        return frozenset({INFLIGHT_LOAD})

    def debug_state(self) -> Mapping[str, object]:
        return self.tracker.debug_state()

    async def prepare(self, state: CycleState, request: InferenceRequest,
                      endpoints: Sequence[Endpoint]) -> None:
        tracker = self.tracker
        tracker.expire()
        for ep in endpoints:
            state.put_endpoint_data(INFLIGHT_LOAD, ep.name,
                                    InflightLoad(tracker.requests(ep.name), tracker.tokens(ep.name)))

    def pre_request(self, state: CycleState, request: InferenceRequest, result: SchedulingResult) -> None:
        if result.targets:
            state.put(self.name, self.tracker.start([result.targets[0].name], estimate_tokens(request)))

    def on_response_complete(self, state: CycleState, request: InferenceRequest, response: ResponseInfo,
                             target: Endpoint | None) -> None:
        self.tracker.finish(state.get(self.name))
        state.put(self.name, None)
