"""The scheduler: profiles of filters → weighted scorers → one picker, driven by a profile handler."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from epp.framework.errors import ErrorCode, InferenceError
from epp.framework.plugin import (
    CycleState,
    Filter,
    Picker,
    Plugin,
    ProfileHandler,
    ProfileRunResult,
    SchedulingResult,
    ScoredEndpoint,
    Scorer,
)
from epp.framework.types import Endpoint, InferenceRequest

# Called with (extension_point, plugin, seconds) after each plugin call, for latency metrics.
PluginTimer = Callable[[str, Plugin, float], None]


# Called with (profile name, its result) after each profile ran; tracing groups the profile's plugin calls by it.
ProfileObserver = Callable[[str, ProfileRunResult | None], None]


def _no_timer(_point: str, _plugin: Plugin, _seconds: float) -> None:
    return None


def _no_observer(_name: str, _result: ProfileRunResult | None) -> None:
    return None


@dataclass(frozen=True)
class WeightedScorer:
    """A scorer with its weight inside one profile."""

    scorer: Scorer
    weight: float


@dataclass(frozen=True)
class SchedulerProfile:
    """One scheduling profile: filters in order, weighted scorers, one picker."""

    name: str
    filters: tuple[Filter, ...]
    scorers: tuple[WeightedScorer, ...]
    picker: Picker

    def run(self, state: CycleState, request: InferenceRequest, candidates: Sequence[Endpoint],
            timer: PluginTimer = _no_timer) -> ProfileRunResult | None:
        """Run the profile; `None` when a filter leaves no endpoint."""
        endpoints: Sequence[Endpoint] = candidates
        for flt in self.filters:
            t0 = time.perf_counter()
            endpoints = flt.filter(state, request, endpoints)
            timer("Filter", flt, time.perf_counter() - t0)
            if not endpoints:
                return None
        totals = [0.0] * len(endpoints)
        names = [ep.name for ep in endpoints]
        for ws in self.scorers:
            t0 = time.perf_counter()
            scores = ws.scorer.score(state, request, endpoints)
            timer("Scorer", ws.scorer, time.perf_counter() - t0)
            weight, get = ws.weight, scores.get
            # clamp_score inlined: this loop runs scorers × endpoints times per request.
            for i, name in enumerate(names):
                value = get(name, 0.0)
                if not 0.0 <= value <= 1.0:
                    value = 1.0 if value > 1.0 else 0.0  # below 0, and NaN, count as 0
                totals[i] += weight * value
        scored = [ScoredEndpoint(ep, total) for ep, total in zip(endpoints, totals)]
        t0 = time.perf_counter()
        result = self.picker.pick(state, request, scored)
        timer("Picker", self.picker, time.perf_counter() - t0)
        return result if result.targets else None


class Scheduler:
    """Runs the profile handler's rounds of profiles and returns the primary targets."""

    def __init__(self, handler: ProfileHandler, profiles: Mapping[str, SchedulerProfile]) -> None:
        self.handler = handler
        self.profiles = dict(profiles)

    def schedule(self, state: CycleState, request: InferenceRequest, candidates: Sequence[Endpoint],
                 timer: PluginTimer = _no_timer, profile_done: ProfileObserver = _no_observer) -> SchedulingResult:
        """One scheduling cycle; raises `InferenceError` (429) when no endpoint can be chosen."""
        if not candidates:
            raise InferenceError(ErrorCode.SERVICE_UNAVAILABLE,
                                 "failed to find endpoint candidates for serving the request")
        results: dict[str, ProfileRunResult | None] = {}
        # A handler that never stops would hang the request; profiles can run at most once each.
        for _ in range(len(self.profiles) + 1):
            t0 = time.perf_counter()
            names = self.handler.pick_profiles(state, request, self.profiles, results)
            timer("ProfilePicker", self.handler, time.perf_counter() - t0)
            names = [n for n in names if n not in results]
            if not names:
                break
            for name in names:
                results[name] = self.profiles[name].run(state, request, candidates, timer)
                profile_done(name, results[name])
        t0 = time.perf_counter()
        outcome = self.handler.process_results(state, request, results)
        timer("ProcessProfilesResults", self.handler, time.perf_counter() - t0)
        if not outcome.targets:
            raise InferenceError(ErrorCode.RESOURCE_EXHAUSTED,
                                 "failed to find target endpoint: no endpoints available for the given request")
        return outcome
