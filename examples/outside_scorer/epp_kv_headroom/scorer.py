"""`kv-headroom-scorer`: how far each endpoint's KV-cache use is below a threshold."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from epp.framework import (
    CycleState,
    Endpoint,
    InferenceRequest,
    PluginContext,
    PluginParams,
    Scorer,
    ScorerCategory,
    clamp_score,
)


class KVHeadroomScorer(Scorer):
    """(threshold - kv_usage) / threshold: 1 for an empty cache, 0 at or above the threshold."""

    type_name = "kv-headroom-scorer"          # the `type:` used in EndpointPickerConfig
    category = ScorerCategory.DISTRIBUTION

    def __init__(self, name: str, params: PluginParams, context: PluginContext) -> None:
        super().__init__(name)
        # Parameters are read through PluginParams: wrong types, out-of-range values and unknown
        # keys fail at start-up with a message naming the plugin and the parameter.
        self.threshold = params.float("threshold", 0.8, minimum=0.01, maximum=1.0)

    def score(self, state: CycleState, request: InferenceRequest,
              endpoints: Sequence[Endpoint]) -> Mapping[str, float]:
        # Called on the event loop for every request: plain arithmetic over the metrics snapshot, no I/O.
        return {ep.name: clamp_score((self.threshold - ep.metrics.kv_cache_usage) / self.threshold)
                for ep in endpoints}
