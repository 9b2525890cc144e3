"""prefix-cache-scorer: the fraction of the prompt's blocks an endpoint already holds."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from epp.framework import (
    PREFIX_HOME,
    PREFIX_MATCH_INFO,
    CycleState,
    Endpoint,
    InferenceRequest,
    PluginContext,
    PluginParams,
    PrefixMatchInfo,
    Scorer,
)

# Hashing parameters that GIE v1.x configs put on the scorer; they now belong to the producer.
LEGACY_PRODUCER_PARAMETERS = ("autoTune", "blockSize", "blockSizeTokens", "hashBlockSize",
                              "maxPrefixBlocksToMatch", "maxPrefixTokensToMatch", "lruCapacityPerServer")


class PrefixCacheScorer(Scorer):
    """matchedBlocks / totalBlocks from the prefix match info; 0 when unknown; 1 on a new prefix's home."""

    type_name = "prefix-cache-scorer"

    def __init__(self, name: str, params: PluginParams, context: PluginContext) -> None:
        super().__init__(name)
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

    def default_producer_parameters(self) -> Mapping[str, Any]:
        """The legacy producer parameters given on this scorer (empty: the producer's defaults)."""
        return self._producer_parameters

    def consumes(self) -> frozenset[str]:
        return frozenset({PREFIX_MATCH_INFO})

    def score(self, state: CycleState, request: InferenceRequest,
              endpoints: Sequence[Endpoint]) -> Mapping[str, float]:
        data = state.all_endpoint_data(PREFIX_MATCH_INFO)
        out: dict[str, float] = {}
        for ep in endpoints:
            info: PrefixMatchInfo | None = data.get(ep.name)
            out[ep.name] = info.fraction if info is not None else 0.0
        if not any(out.values()):
            # No endpoint holds the prefix: its rendezvous home (if the producer named one) scores as a
            # full match, so the group's first request goes where its followers will find it.
            for name, score in state.all_endpoint_data(PREFIX_HOME).items():
                if name in out:
                    out[name] = score
        return out
