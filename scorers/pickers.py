"""Pickers: max score (ties to the least-written cache, or random), uniform random, and weighted random (A-Res)."""

from __future__ import annotations

import random
import time
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
    """Highest total score first; returns maxNumOfEndpoints targets.

    Equal scores go to the endpoint this picker sent the fewest uncached prompt tokens lately
    (`tieBreak: fewest-cache-writes`, the ledger's `cache_writes`), then at random. When nothing
    tells endpoints apart (an idle pool, a prompt no replica holds) GIE's random choice lets
    several new prefixes land on one replica, which then evicts one of them while another replica
    sits empty; sending each to where the fewest new prefixes went lately spreads them over the
    fleet's cache. `tieBreak: random` is GIE's behaviour.
    """

    type_name = "max-score-picker"

    def __init__(self, name: str, params: PluginParams, context: PluginContext) -> None:
        super().__init__(name, params, context)
        tie_break = params.str("tieBreak", "fewest-cache-writes", choices=("fewest-cache-writes", "random"))
        self.ledger = context.load if tie_break == "fewest-cache-writes" else None

    def describe(self) -> str:
        tie_break = "random" if self.ledger is None else "fewest-cache-writes"
        return f"{super().describe()} tieBreak={tie_break}"

    def pick(self, state: CycleState, request: InferenceRequest,
             scored: Sequence[ScoredEndpoint]) -> ProfileRunResult:
        if not scored:
            return ProfileRunResult(())
        rng, ledger = self._rng, self.ledger
        if self.max_endpoints == 1:
            best = max(s.score for s in scored)
            ties = [s for s in scored if s.score == best]
            if len(ties) == 1:
                return ProfileRunResult((ties[0].endpoint,))
            if ledger is not None:
                now = time.monotonic()
                writes = [ledger.cache_writes(s.endpoint.name, now) for s in ties]
                least = min(writes)
                ties = [s for s, w in zip(ties, writes) if w == least]
            return ProfileRunResult((rng.choice(ties).endpoint,))
        # Equal scores in cache-write order, then in random order (like shuffle + stable sort).
        now = time.monotonic()

        def writes(s: ScoredEndpoint) -> float:
            return 0.0 if ledger is None else ledger.cache_writes(s.endpoint.name, now)

        order = sorted(scored, key=lambda s: (-s.score, writes(s), rng.random()))
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
