"""served-model-filter: keep the endpoints that serve the request's model (several models, one pool)."""

from __future__ import annotations

from collections.abc import Sequence

from epp.framework import PluginParams
from epp.framework.plugin import CycleState, Filter, PluginContext
from epp.framework.types import Endpoint, InferenceRequest


class ServedModelFilter(Filter):
    """Endpoints whose `modelLabel` label equals the request's target model; unlabeled ones pass."""

    type_name = "served-model-filter"

    def __init__(self, name: str, params: PluginParams, context: PluginContext) -> None:
        super().__init__(name)
        self.label = params.str("modelLabel", "model") or "model"

    def filter(self, state: CycleState, request: InferenceRequest,
               endpoints: Sequence[Endpoint]) -> list[Endpoint]:
        model = request.target_model
        return [ep for ep in endpoints if ep.labels.get(self.label, model) == model]
