"""prefix-cache-affinity-filter: llm-d's "sticky until saturated" gate.

Keeps only the endpoints whose prefix-cache match (matched / total blocks) reaches
`affinityThreshold` (0.80); when none does, or with probability `explorationProbability` (0),
it keeps all. Two load gates break stickiness (keep all) when the sticky endpoints are too busy
next to the others:

- TTFT (`maxTTFTPenaltyMs`, 18000; 0 = never): the best sticky endpoint's estimated TTFT exceeds
  the best non-sticky one's by more than the penalty. `ttftSource: prefillThroughput` (default)
  estimates TTFT as in-flight tokens / `peakPrefillThroughput` (15928 tokens/s) x 1000 ms;
  `ttftSource: latencyPredictor` reads llm-d's latency-predictor sidecar there, and here our own
  self-calibrating predicted TTFT (predicted-ttft-scorer's model, learned from this picker's own
  first tokens).
- In-flight tokens (`maxTokensInFlightPenalty`, 0 = never): the sticky endpoint with the fewest
  in-flight tokens has more than the penalty above the non-sticky one with the fewest (the rule
  llm-d's tests of the parameter give; its source was not public when this was written).

Without prefix match info every score is 0, so the filter keeps all; an endpoint without in-flight
counts has none (no load), so without them the throughput gates never break.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Mapping, Sequence

from prometheus_client import CollectorRegistry, Counter

from epp.framework import (
    INFLIGHT_LOAD,
    PREFIX_TIER_MATCH,
    ConfigError,
    CycleState,
    Endpoint,
    Filter,
    InferenceRequest,
    InflightLoad,
    Plugin,
    PluginContext,
    PluginParams,
    PrefixMatchInfo,
    TierMatch,
    estimate_prompt_tokens,
    once_per_registry,
)
from epp.scorers.load import inflight_source
from epp.scorers.predicted_ttft import PredictedTTFTScorer
from epp.scorers.prefix import prefix_source

log = logging.getLogger(__name__)

TTFT_SOURCES = ("prefillThroughput", "latencyPredictor")
# Qwen3-32B on 2x H100 (TP2), vLLM 0.19, one unloaded 8192-token chunk (llm-d's calibration).
DEFAULT_PEAK_PREFILL_THROUGHPUT = 15928.0
DECISIONS = ("sticky", "no_match", "load_override", "exploration", "not_applicable")


def _decisions(registry: CollectorRegistry | None) -> Counter:
    return once_per_registry(registry, "epp_prefix_affinity_decisions", lambda r: Counter(
        "epp_prefix_affinity_decisions", "prefix-cache-affinity-filter outcomes: narrowed to the sticky endpoints, "
        "no sticky endpoint, stickiness broken by a load gate, exploration, or nothing to filter.",
        ["plugin", "decision"], registry=r))


class PrefixCacheAffinityFilter(Filter):
    """Keeps the endpoints holding >= affinityThreshold of the prompt unless they are too loaded (llm-d)."""

    type_name = "prefix-cache-affinity-filter"

    def __init__(self, name: str, params: PluginParams, context: PluginContext) -> None:
        super().__init__(name)
        self.threshold = params.float("affinityThreshold", 0.80, maximum=1.0)
        self.exploration = params.float("explorationProbability", 0.0, minimum=0.0, maximum=1.0)
        self.max_ttft_penalty_ms = params.float("maxTTFTPenaltyMs", 18000.0, minimum=0.0)
        self.ttft_source = params.str("ttftSource", TTFT_SOURCES[0], choices=TTFT_SOURCES)
        self.peak_prefill = params.float("peakPrefillThroughput", DEFAULT_PEAK_PREFILL_THROUGHPUT, minimum=0.0)
        self.max_tokens_penalty = params.int("maxTokensInFlightPenalty", 0, minimum=0)
        if params.str("latencyPredictionInfoProducerName", None) is not None:
            raise ConfigError(f"plugin {name!r}: parameter 'latencyPredictionInfoProducerName' names a "
                              "predicted-latency-producer, which is not run here; ttftSource: latencyPredictor "
                              "reads this picker's own predicted TTFT")
        if self.ttft_source == "prefillThroughput" and self.max_ttft_penalty_ms > 0 and self.peak_prefill == 0:
            raise ConfigError(f"plugin {name!r}: parameter 'peakPrefillThroughput' must be > 0 when ttftSource is "
                              "prefillThroughput")
        self.prefix = prefix_source(params)
        self.inflight = inflight_source(params)
        self.predictor: PredictedTTFTScorer | None = None
        if self.ttft_source == "latencyPredictor" and self.max_ttft_penalty_ms > 0:
            # llm-d's latency-predictor sidecar is not run here: our own self-calibrating TTFT model stands in.
            self.predictor = PredictedTTFTScorer(f"{name}/ttft", PluginParams(name, {}), context)
            log.info("%s: ttftSource latencyPredictor uses this picker's own predicted TTFT (predicted-ttft-scorer's "
                     "model), not llm-d's latency-predictor sidecar", name)
        self._rng = random.Random()
        decisions = _decisions(context.metrics_registry)
        self._counted = {d: decisions.labels(plugin=name, decision=d) for d in DECISIONS}

    def describe(self) -> str:
        text = (f"affinityThreshold={self.threshold:g} explorationProbability={self.exploration:g} "
                f"maxTTFTPenaltyMs={self.max_ttft_penalty_ms:g} ttftSource={self.ttft_source}")
        if self.ttft_source == "prefillThroughput":
            text += f" peakPrefillThroughput={self.peak_prefill:g}"
        elif self.predictor is not None:
            text += " (this picker's own predicted TTFT, not llm-d's latency-predictor sidecar)"
        return text + f" maxTokensInFlightPenalty={self.max_tokens_penalty}"

    def _uses_inflight(self) -> bool:
        ttft_gate = self.max_ttft_penalty_ms > 0 and self.ttft_source == "prefillThroughput"
        return ttft_gate or self.max_tokens_penalty > 0

    def consumes(self) -> frozenset[str]:
        return frozenset({self.prefix.key, INFLIGHT_LOAD} if self._uses_inflight() else {self.prefix.key})

    def consumes_optional(self) -> frozenset[str]:
        return frozenset({PREFIX_TIER_MATCH}) if self.predictor is not None else frozenset()

    def plugin_refs(self) -> Mapping[str, str]:
        """The producers `prefixMatchInfoProducerName` and `inFlightLoadProducerName` name (resolved by the loader)."""
        return {**self.prefix.refs(), **self.inflight.refs()}

    def bind_plugins(self, plugins: Mapping[str, Plugin]) -> None:
        self.prefix.bind(self.name, plugins)
        self.inflight.bind(self.name, plugins)

    def filter(self, state: CycleState, request: InferenceRequest, endpoints: Sequence[Endpoint]) -> list[Endpoint]:
        if len(endpoints) <= 1 or self.threshold <= 0:
            self._counted["not_applicable"].inc()
            return list(endpoints)
        if self.exploration > 0 and self._rng.random() < self.exploration:
            self._counted["exploration"].inc()
            return list(endpoints)
        matches: Mapping[str, PrefixMatchInfo] = state.all_endpoint_data(self.prefix.read_key)
        sticky: list[Endpoint] = []
        others: list[Endpoint] = []
        for ep in endpoints:
            info = matches.get(ep.name)
            (sticky if info is not None and info.fraction >= self.threshold else others).append(ep)
        if not sticky:
            self._counted["no_match"].inc()
            return list(endpoints)
        if others and self._overloaded(state, request, sticky, others):
            self._counted["load_override"].inc()
            return list(endpoints)
        self._counted["sticky"].inc()
        return sticky

    def _overloaded(self, state: CycleState, request: InferenceRequest, sticky: Sequence[Endpoint],
                    others: Sequence[Endpoint]) -> bool:
        """Whether a load gate breaks stickiness: the best sticky endpoint too far behind the best other one."""
        loads: Mapping[str, InflightLoad] = state.all_endpoint_data(self.inflight.read_key)

        def tokens(ep: Endpoint) -> int:
            load = loads.get(ep.name)
            return load.tokens if load is not None else 0

        if self.max_ttft_penalty_ms > 0:
            if self.predictor is not None:
                ttft = self._predicted_ms(state, request, [*sticky, *others])
                penalty = min(ttft[ep.name] for ep in sticky) - min(ttft[ep.name] for ep in others)
            else:
                # Estimated TTFT in ms = in-flight tokens / peak prefill throughput (tokens/s) x 1000.
                penalty = (min(map(tokens, sticky)) - min(map(tokens, others))) / self.peak_prefill * 1000.0
            if penalty > self.max_ttft_penalty_ms:
                return True
        return self.max_tokens_penalty > 0 and min(map(tokens, sticky)) - min(map(tokens, others)) > \
            self.max_tokens_penalty

    def _predicted_ms(self, state: CycleState, request: InferenceRequest,
                      endpoints: Sequence[Endpoint]) -> dict[str, float]:
        """Each endpoint's predicted TTFT in ms (our model; tier matches when a producer gives them)."""
        assert self.predictor is not None
        tiers: Mapping[str, TierMatch] = state.all_endpoint_data(PREFIX_TIER_MATCH)
        matches: Mapping[str, PrefixMatchInfo] = state.all_endpoint_data(self.prefix.read_key)
        total = max((m.total_tokens for m in tiers.values()), default=0) or estimate_prompt_tokens(request)
        now = time.monotonic()
        out = {}
        for ep in endpoints:
            match = tiers.get(ep.name)
            info = matches.get(ep.name)
            if match is None and info is not None:
                cached = min(total, int(info.matched_blocks * info.block_size_tokens))
                match = TierMatch(cached, 0, 0, total)
            out[ep.name] = 1000.0 * self.predictor.predict(ep, match, total, request.target_model, now)
        return out

