"""prefix-cache-scorer: the fraction of the prompt's blocks an endpoint already holds, optionally
mixed with the absolute length of the match (llm-d's `matchLengthWeight`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from epp.framework import (
    PREFIX_HOME,
    PREFIX_MATCH_INFO,
    ConfigError,
    CycleState,
    DataProducer,
    Endpoint,
    InferenceRequest,
    Plugin,
    PluginContext,
    PluginParams,
    PrefixMatchInfo,
    Scorer,
)

# Hashing parameters that GIE v1.x configs put on the scorer; they now belong to the producer.
LEGACY_PRODUCER_PARAMETERS = ("autoTune", "blockSize", "blockSizeTokens", "hashBlockSize",
                              "maxPrefixBlocksToMatch", "maxPrefixTokensToMatch", "lruCapacityPerServer")


class ProducerSource:
    """Where a consumer reads a data key: the producer a parameter names (llm-d's `prefixMatchInfoProducerName`,
    `inFlightLoadProducerName`), checked at load, else the key's default producer."""

    def __init__(self, params: PluginParams, param: str, key: str, what: str, hint: str) -> None:
        self.param, self.key, self.what, self.hint = param, key, what, hint
        self.name = params.str(param, None)
        self.producer: DataProducer | None = None
        self.read_key = key  # where the bound producer writes the key (its own name when several do)

    def refs(self) -> dict[str, str]:
        """`{param: producer name}` when the parameter is set."""
        return {self.param: self.name} if self.name else {}

    def bind(self, plugin_name: str, found: Mapping[str, Plugin]) -> None:
        """Take the named producer; `ConfigError` when it does not produce the key."""
        producer = found.get(self.param)
        if producer is None:
            return
        if not isinstance(producer, DataProducer) or producer.output_key(self.key) not in producer.produces():
            raise ConfigError(f"plugin {plugin_name!r}: parameter {self.param!r} names {producer.name!r} (type "
                              f"{producer.type_name}), which does not produce {self.what}; name {self.hint}")
        self.producer = producer
        self.read_key = producer.output_key(self.key)

    def key_of(self, key: str) -> str:
        """Where the bound producer writes another of its keys (the key itself without one)."""
        return self.producer.output_key(key) if self.producer is not None else key


def prefix_source(params: PluginParams) -> ProducerSource:
    """llm-d's `prefixMatchInfoProducerName`: the producer whose prefix match info is read (checked at load)."""
    return ProducerSource(params, "prefixMatchInfoProducerName", PREFIX_MATCH_INFO, "the prefix match info",
                          "a prefix producer (approx- or precise-prefix-cache-producer)")


class PrefixCacheScorer(Scorer):
    """(1 - w) x matchedBlocks / totalBlocks + w x min(1, matched tokens / scale)^2, w = `matchLengthWeight`
    (default 0); 0 when unknown; 1 on a new prefix's home."""

    type_name = "prefix-cache-scorer"

    def __init__(self, name: str, params: PluginParams, context: PluginContext) -> None:
        super().__init__(name)
        self.source = prefix_source(params)
        # llm-d: the absolute match length counts too (quadratic, as attention cost grows with length).
        self.match_length_weight = params.float("matchLengthWeight", 0.0, minimum=0.0, maximum=1.0)
        self.match_length_scale = params.int("matchLengthScaleTokens", 8192, minimum=1)
        legacy: dict[str, Any] = {}
        for key in LEGACY_PRODUCER_PARAMETERS:
            value = params.bool(key, None) if key == "autoTune" else params.int(key, None)
            if value is not None:
                legacy[key] = value
        # v1.0 `hashBlockSize` counted characters; the producer counts tokens of 4 characters.
        if "hashBlockSize" in legacy:
            chars = legacy.pop("hashBlockSize")
            legacy.setdefault("blockSizeTokens", max(1, int(chars) // 4))
        if "blockSize" in legacy and "blockSizeTokens" not in legacy:
            legacy["blockSizeTokens"] = max(1, int(legacy.pop("blockSize")) // 4)
        self._producer_parameters: Mapping[str, Any] = legacy

    def plugin_refs(self) -> Mapping[str, str]:
        """The producer `prefixMatchInfoProducerName` names (resolved by the loader)."""
        return self.source.refs()

    def bind_plugins(self, plugins: Mapping[str, Plugin]) -> None:
        self.source.bind(self.name, plugins)

    def default_producer_parameters(self) -> Mapping[str, Any]:
        """The legacy producer parameters given on this scorer (empty: the producer's defaults)."""
        return self._producer_parameters

    def consumes(self) -> frozenset[str]:
        return frozenset({PREFIX_MATCH_INFO})

    def score(self, state: CycleState, request: InferenceRequest,
              endpoints: Sequence[Endpoint]) -> Mapping[str, float]:
        data: Mapping[str, PrefixMatchInfo] = state.all_endpoint_data(self.source.read_key)
        out: dict[str, float] = {}
        weight, scale = self.match_length_weight, self.match_length_scale
        for ep in endpoints:
            info: PrefixMatchInfo | None = data.get(ep.name)
            if info is None:
                out[ep.name] = 0.0
            elif weight:
                length = min(1.0, info.matched_blocks * info.block_size_tokens / scale) if info.total_blocks else 0.0
                out[ep.name] = (1.0 - weight) * info.fraction + weight * length * length
            else:
                out[ep.name] = info.fraction
        if not any(out.values()):
            # No endpoint holds the prefix: its rendezvous home (if the producer named one) scores as a
            # full match, so the group's first request goes where its followers will find it.
            for name, score in state.all_endpoint_data(self.source.key_of(PREFIX_HOME)).items():
                if name in out:
                    out[name] = score
        return out
