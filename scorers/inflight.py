"""Scorers and producers that count what the picker itself has in flight per endpoint."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from epp.framework import (
    INFLIGHT_LOAD,
    PROMPT_TOKENS,
    ConfigError,
    CycleState,
    DataProducer,
    Endpoint,
    FirstTokenHook,
    InferenceRequest,
    InflightLoad,
    Plugin,
    PluginContext,
    PluginParams,
    PrefixMatchInfo,
    PreRequestHook,
    PromptTokens,
    ResponseCompleteHook,
    ResponseInfo,
    SchedulingResult,
    Scorer,
    estimate_prompt_tokens,
)
from epp.scorers.inflight_tracker import InflightTracker, LoadBook, tracked_requests_gauge
from epp.scorers.prefix import ProducerSource, prefix_source

# llm-d's estimated output per prompt token (`outputRatio`).
OUTPUT_TO_INPUT_RATIO = 1.5
PREFILL_PROFILE = "prefill"
# The body fields a client caps its output with: OpenAI's current and legacy ones, the Responses API's.
MAX_OUTPUT_FIELDS = ("max_completion_tokens", "max_tokens", "max_output_tokens")


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
        self.source = ProducerSource(params, "inFlightLoadProducerName", INFLIGHT_LOAD, "in-flight load",
                                     "an inflight-load-producer")
        self.refs = self.source.refs()

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
        self.source.bind(self.name, plugins)

    def _counts(self, state: CycleState, endpoints: Sequence[Endpoint]) -> list[int]:
        if self.refs:
            loads: Mapping[str, InflightLoad] = state.all_endpoint_data(self.source.read_key)
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


def client_max_output_tokens(request: InferenceRequest) -> int | None:
    """The output cap the request's body sets (`max_tokens`, `max_completion_tokens`, `max_output_tokens`), if any."""
    for field in MAX_OUTPUT_FIELDS:
        value = request.body.get(field)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
    return None


def uncached_tokens(info: PrefixMatchInfo | None, input_tokens: int) -> int:
    """Prompt tokens an endpoint must compute: the blocks it misses, plus any tail beyond what the index hashed."""
    if info is None or info.block_size_tokens <= 0:
        return max(0, input_tokens)
    indexed = info.total_blocks * info.block_size_tokens
    missed = max(0.0, (info.total_blocks - info.matched_blocks) * info.block_size_tokens)
    return int(missed) + max(0, input_tokens - indexed)


class InflightLoadProducer(DataProducer, PreRequestHook, FirstTokenHook, ResponseCompleteHook):
    """llm-d's in-flight load per endpoint (INFLIGHT_LOAD): requests, and the uncached prompt tokens still to
    prefill (plus estimated output with `addEstimatedOutputTokens`), released at a stream's first token.

    A pick counts the prompt tokens the endpoint's prefix match says it lacks (`prefixMatchInfoProducerName`
    names the prefix producer; by default the one writing the plain key; with none, the whole prompt). The
    prompt's tokens are the token-producer's when one ran, else its characters / 4. With
    `addEstimatedOutputTokens`, round(prompt x `outputRatio`) more, capped by `maxEstimatedOutputTokens`
    and by the request's own `max_tokens` / `max_completion_tokens` / `max_output_tokens`. Every profile's
    pick is counted. At a streamed response's first token the prefill pick is released whole and, without
    output estimates, every other pick's tokens; the rest when the response ends (a whole response: at its
    end). `InflightLoad.request_tokens` is the request's own tokens on each endpoint, which
    token-load-scorer adds (llm-d's UncachedRequestTokens).
    """

    type_name = "inflight-load-producer"

    def __init__(self, name: str, params: PluginParams, context: PluginContext) -> None:
        super().__init__(name)
        timeout = params.duration("requestTimeout", 300.0)
        if timeout <= 0:
            raise ConfigError(f"plugin {name!r}: parameter 'requestTimeout' must be positive, got {timeout}s")
        self.add_output = params.bool("addEstimatedOutputTokens", False)
        self.output_ratio = params.float("outputRatio", OUTPUT_TO_INPUT_RATIO, minimum=0.0)
        self.max_output = params.int("maxEstimatedOutputTokens", None, minimum=0)
        # llm-d shares the counts between its replicas; this picker's are its own (no effect here).
        self.sync_cross_replica = params.bool("syncCrossReplicaState", True)
        self.prefix = prefix_source(params)
        gauge = tracked_requests_gauge(context.metrics_registry).labels(plugin=name)
        self.tracker = LoadBook(timeout, gauge=gauge)
        self._key = INFLIGHT_LOAD
        if context.endpoints is not None:
            context.endpoints.add_listener(self._on_endpoints_changed)

    def describe(self) -> str:
        parts = [f"addEstimatedOutputTokens={str(self.add_output).lower()}"]
        if self.add_output:
            parts += [f"outputRatio={self.output_ratio:g}", f"maxEstimatedOutputTokens={self.max_output}"]
        if self.prefix.name:
            parts.append(f"prefixMatchInfoProducerName={self.prefix.name}")
        parts.append(f"requestTimeout={self.tracker.timeout_s:g}s")
        return " ".join(parts)

    def produces(self) -> frozenset[str]:
        return frozenset({self._key})

    def publish_under(self, keys: Mapping[str, str]) -> bool:
        self._key = keys.get(INFLIGHT_LOAD, self._key)
        return True

    def output_key(self, key: str) -> str:
        return self._key if key == INFLIGHT_LOAD else key

    def consumes_optional(self) -> frozenset[str]:
        return frozenset({self.prefix.key, PROMPT_TOKENS})

    def plugin_refs(self) -> Mapping[str, str]:
        """The producer `prefixMatchInfoProducerName` names (resolved by the loader)."""
        return self.prefix.refs()

    def bind_plugins(self, plugins: Mapping[str, Plugin]) -> None:
        self.prefix.bind(self.name, plugins)

    def debug_state(self) -> Mapping[str, object]:
        return self.tracker.debug_state()

    def _on_endpoints_changed(self, added: tuple[Endpoint, ...], removed: tuple[Endpoint, ...]) -> None:
        for ep in removed:
            self.tracker.remove_endpoint(ep.name)

    def input_tokens(self, state: CycleState, request: InferenceRequest) -> int:
        """The prompt's tokens: the token-producer's when it ran, else its characters / 4."""
        tokens: PromptTokens | None = state.get(PROMPT_TOKENS)
        return len(tokens.token_ids) if tokens is not None else estimate_prompt_tokens(request)

    def output_tokens(self, request: InferenceRequest, input_tokens: int) -> int:
        """Estimated output tokens (0 unless `addEstimatedOutputTokens`): against the whole prompt, capped."""
        if not self.add_output or input_tokens <= 0:
            return 0
        estimate = round(input_tokens * self.output_ratio)
        for cap in (client_max_output_tokens(request), self.max_output):
            if cap is not None and cap < estimate:
                estimate = cap
        return estimate

    def request_tokens(self, state: CycleState, endpoint: str, input_tokens: int, output_tokens: int) -> int:
        """What a pick of `endpoint` adds: its uncached prompt tokens and the output estimate."""
        info: PrefixMatchInfo | None = state.endpoint_data(self.prefix.read_key, endpoint)
        return uncached_tokens(info, input_tokens) + output_tokens

    async def prepare(self, state: CycleState, request: InferenceRequest,
                      endpoints: Sequence[Endpoint]) -> None:
        book = self.tracker
        book.expire()
        input_tokens = self.input_tokens(state, request)
        output_tokens = self.output_tokens(request, input_tokens)
        for ep in endpoints:
            own = self.request_tokens(state, ep.name, input_tokens, output_tokens)
            state.put_endpoint_data(self._key, ep.name, InflightLoad(book.requests(ep.name), book.tokens(ep.name), own))

    def pre_request(self, state: CycleState, request: InferenceRequest, result: SchedulingResult) -> None:
        input_tokens = self.input_tokens(state, request)
        output_tokens = self.output_tokens(request, input_tokens)
        picks = []
        for profile, run in result.profile_results.items():
            if run is not None and run.targets:
                name = run.targets[0].name
                picks.append((profile, name, self.request_tokens(state, name, input_tokens, output_tokens)))
        state.put(self.name, self.tracker.start(picks))

    def on_first_token(self, state: CycleState, request: InferenceRequest, target: Endpoint | None) -> None:
        # The prefill is done on every pick, and the prefill pick's request with it (handed off to decode);
        # estimated output tokens stay counted until the response ends.
        self.tracker.release(state.get(self.name), whole=(PREFILL_PROFILE,), all_tokens=not self.add_output)

    def on_response_complete(self, state: CycleState, request: InferenceRequest, response: ResponseInfo,
                             target: Endpoint | None) -> None:
        self.tracker.finish(state.get(self.name))
        state.put(self.name, None)
