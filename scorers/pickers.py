"""Pickers: max score with random tie-break, uniform random, and weighted random (A-Res)."""

from __future__ import annotations

import random
from collections.abc import Sequence

from epp.framework import (
    CycleState,
    InferenceRequest,
    Picker,
    PluginContext,
    PluginParams,
    ProfileRunResult,
    ScoredEndpoint,
)


class _CountedPicker(Picker):
    def __init__(self, name: str, params: PluginParams, context: PluginContext) -> None:
        super().__init__(name)
        self.max_endpoints = params.int("maxNumOfEndpoints", 1, minimum=1)
        self._rng = random.Random()

    def describe(self) -> str:
        return f"maxNumOfEndpoints={self.max_endpoints}"


class MaxScorePicker(_CountedPicker):
    """Highest total score first (ties broken at random); returns maxNumOfEndpoints targets."""

    type_name = "max-score-picker"

    def pick(self, state: CycleState, request: InferenceRequest,
             scored: Sequence[ScoredEndpoint]) -> ProfileRunResult:
        if not scored:
            return ProfileRunResult(())
        rng = self._rng
        if self.max_endpoints == 1:
            best = max(s.score for s in scored)
            ties = [s for s in scored if s.score == best]
            return ProfileRunResult((ties[0].endpoint if len(ties) == 1 else rng.choice(ties).endpoint,))
        # A random secondary key puts equal scores in random order (like shuffle + stable sort).
        order = sorted(scored, key=lambda s: (-s.score, rng.random()))
        return ProfileRunResult(tuple(s.endpoint for s in order[: self.max_endpoints]))


class RandomPicker(_CountedPicker):
    """Uniformly random endpoints, ignoring scores."""

    type_name = "random-picker"

    def pick(self, state: CycleState, request: InferenceRequest,
             scored: Sequence[ScoredEndpoint]) -> ProfileRunResult:
        count = min(self.max_endpoints, len(scored))
        return ProfileRunResult(tuple(s.endpoint for s in self._rng.sample(list(scored), count)))


class WeightedRandomPicker(_CountedPicker):
    """Random in proportion to score (A-Res: key = U^(1/score)); uniform when no score is positive."""

    type_name = "weighted-random-picker"

    def pick(self, state: CycleState, request: InferenceRequest,
             scored: Sequence[ScoredEndpoint]) -> ProfileRunResult:
        rng = self._rng
        if not any(s.score > 0 for s in scored):
            count = min(self.max_endpoints, len(scored))
            return ProfileRunResult(tuple(s.endpoint for s in rng.sample(list(scored), count)))
        # Non-positive scores get keys below every positive one, so they only fill leftover slots.
        keyed = [((rng.random() ** (1.0 / s.score)) if s.score > 0 else -rng.random(), s) for s in scored]
        keyed.sort(key=lambda pair: pair[0], reverse=True)
        return ProfileRunResult(tuple(s.endpoint for _, s in keyed[: self.max_endpoints]))
