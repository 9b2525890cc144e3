"""`kv-headroom-scorer`: prefers endpoints whose KV cache is furthest below a threshold."""

from collections.abc import Mapping, Sequence

from epp.framework import (
    CycleState,
    Endpoint,
    InferenceRequest,
    PluginContext,
    PluginParams,
    PluginRegistry,
    Scorer,
    clamp_score,
)


class KVHeadroomScorer(Scorer):
    """(threshold - kv_usage) / threshold: 1 for an empty cache, 0 at or above the threshold."""

    type_name = "kv-headroom-scorer"  # the `type:` in EndpointPickerConfig

    def __init__(self, name: str, params: PluginParams, context: PluginContext) -> None:
        super().__init__(name, params, context)
        # Checked at start-up: a wrong type, a value out of range or an unknown key names the plugin.
        self.threshold = params.float("threshold", 0.8, minimum=0.01, maximum=1.0)

    def score(self, state: CycleState, request: InferenceRequest,
              endpoints: Sequence[Endpoint]) -> Mapping[str, float]:
        # On the event loop for every request: arithmetic over the metrics snapshot, no I/O.
        return {ep.name: clamp_score((self.threshold - ep.metrics.kv_cache_usage) / self.threshold)
                for ep in endpoints}


def register(registry: PluginRegistry) -> None:
    """Entry point of group `epp.plugins`: makes `kv-headroom-scorer` usable in configs."""
    registry.register_class(KVHeadroomScorer)
