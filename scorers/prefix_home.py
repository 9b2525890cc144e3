"""prefix-home-scorer: a stable home endpoint per prompt prefix, by rendezvous hashing.

When no endpoint holds a prompt's prefix (first sight, or evicted everywhere under cache
pressure), cache-affinity scorers have nothing to say and load balancing scatters requests of
the same prefix over the fleet, so every replica ends up caching every prefix and caches thrash.
This scorer gives each prefix a home: the endpoint with the highest `xxh64(prefix ‖ endpoint)`
among the candidates scores 1, the others 0. The home of a prefix only moves when its endpoint
leaves (rendezvous hashing), and different prefixes spread evenly. Give it a small weight next
to a prefix-cache scorer: it breaks ties towards a stable partition without overriding load.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import xxhash

from epp.framework import CycleState, Endpoint, InferenceRequest, PluginContext, PluginParams, PluginRegistry, Scorer
from epp.scorers.prompt_text import user_input_bytes


class PrefixHomeScorer(Scorer):
    """Scores 1 for the rendezvous-hash home of the request's prompt prefix, 0 elsewhere."""

    type_name = "prefix-home-scorer"

    def __init__(self, name: str, params: PluginParams, context: PluginContext) -> None:
        super().__init__(name)
        # Enough of the prompt to tell shared system prompts apart, short enough to be cheap.
        self.prefix_bytes = params.int("prefixBytes", 256, minimum=1)

    def score(self, state: CycleState, request: InferenceRequest,
              endpoints: Sequence[Endpoint]) -> Mapping[str, float]:
        prefix = request.target_model.encode() + b"\0" + user_input_bytes(request, self.prefix_bytes)
        if request.cache_salt:
            prefix += b"\0" + request.cache_salt.encode()
        home = max(endpoints, key=lambda ep: xxhash.xxh64_intdigest(prefix + ep.name.encode()))
        return {home.name: 1.0}


def register(registry: PluginRegistry) -> None:
    """Register prefix-home-scorer."""
    registry.register_class(PrefixHomeScorer)
