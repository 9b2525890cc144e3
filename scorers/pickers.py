"""Pickers: max score (ties to the most free prefix cache, then random), uniform random, weighted random (A-Res)."""

from __future__ import annotations

import random
from collections.abc import Sequence

from epp.framework import (
    PREFIX_CACHE_FREE_BLOCKS,
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
    """Highest total score first; returns maxNumOfEndpoints targets.

    Equal scores go to the endpoint whose prefix cache has the most room its index knows of
    (`tieBreak: most-free-cache`, the prefix producer's `PREFIX_CACHE_FREE_BLOCKS`), then at
    random. When nothing else tells endpoints apart (an idle pool, a prompt no replica holds),
    GIE's random choice can put several new prefixes on one replica, which then evicts one of
    them while another replica's cache sits empty. Once every cache is full the room is 0
    everywhere and ties fall at random again, as GIE's do. `tieBreak: random` is GIE's behaviour.
    """

    type_name = "max-score-picker"

    def __init__(self, name: str, params: PluginParams, context: PluginContext) -> None:
        super().__init__(name, params, context)
        self.tie_break = params.str("tieBreak", "most-free-cache", choices=("most-free-cache", "random"))

    def describe(self) -> str:
        return f"{super().describe()} tieBreak={self.tie_break}"

    def pick(self, state: CycleState, request: InferenceRequest,
             scored: Sequence[ScoredEndpoint]) -> ProfileRunResult:
        if not scored:
            return ProfileRunResult(())
        rng = self._rng
        by_room = self.tie_break == "most-free-cache"

        def room(s: ScoredEndpoint) -> int:
            return state.endpoint_data(PREFIX_CACHE_FREE_BLOCKS, s.endpoint.name, 0) if by_room else 0

        if self.max_endpoints == 1:
            best = max(s.score for s in scored)
            ties = [s for s in scored if s.score == best]
            if len(ties) == 1:
                return ProfileRunResult((ties[0].endpoint,))
            if by_room:
                rooms = [room(s) for s in ties]
                most = max(rooms)
                ties = [s for s, r in zip(ties, rooms) if r == most]
            return ProfileRunResult((rng.choice(ties).endpoint,))
        # Equal scores by room (most first), then in random order (like shuffle + stable sort).
        order = sorted(scored, key=lambda s: (-s.score, -room(s), rng.random()))
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
