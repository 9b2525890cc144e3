"""LoRA affinity: prefer endpoints where the target adapter is loaded, or can be."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from epp.framework import CycleState, Endpoint, InferenceRequest, Scorer


def lora_affinity(ep: Endpoint, target_model: str) -> float:
    """1.0 active; 0.8 when a slot is free; 0.6 waiting; else 0 (GIE lora-affinity-scorer)."""
    m = ep.metrics
    if target_model in m.active_models:
        return 1.0
    if len(m.active_models) + len(m.waiting_models) < m.max_active_models:
        return 0.8
    if target_model in m.waiting_models:
        return 0.6
    return 0.0


class LoraAffinityScorer(Scorer):
    """Adapter already active 1.0, free adapter slot 0.8, adapter waiting 0.6, otherwise 0."""

    type_name = "lora-affinity-scorer"

    def score(self, state: CycleState, request: InferenceRequest,
              endpoints: Sequence[Endpoint]) -> Mapping[str, float]:
        target = request.target_model
        return {ep.name: lora_affinity(ep, target) for ep in endpoints}
