"""The scheduler: profiles of filters → weighted scorers → one picker, driven by a profile handler."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from epp.framework.errors import DropReason, ErrorCode, InferenceError
from epp.framework.plugin import (
    PROFILE_RESULTS_STATE_KEY,
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
# Where a cycle's `ScheduleTrace` is kept in its CycleState when the scheduler records scores.
SCORE_TRACE_STATE_KEY = "epp.framework/score-trace"


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


@dataclass(slots=True)
class ProfileTrace:
    """What one profile run did: each endpoint's weighted total and the pick; `detailed`: also why.

    `scores` holds each scorer's mapping as it returned it (not copied), before clamping.
    """

    detailed: bool
    totals: Sequence[ScoredEndpoint] = ()
    picked: tuple[Endpoint, ...] = ()
    dropped: dict[str, str] = field(default_factory=dict)  # endpoint name -> the filter that dropped it
    scores: list[tuple[WeightedScorer, Mapping[str, float]]] = field(default_factory=list)

    def record_filter(self, name: str, before: Sequence[Endpoint], kept: Sequence[Endpoint]) -> None:
        """Note the endpoints the filter `name` dropped."""
        names = {ep.name for ep in kept}
        for ep in before:
            if ep.name not in names:
                self.dropped[ep.name] = name


class ScheduleTrace:
    """One cycle's scores per profile, for `--emit-endpoint-scores` and `epp explain`.

    Built only when asked (a picker that does not emit scores builds none); `detailed` also keeps
    each filter's drops and each scorer's scores, not only the weighted totals.
    """

    __slots__ = ("detailed", "profiles")

    def __init__(self, detailed: bool = False) -> None:
        self.detailed = detailed
        self.profiles: dict[str, ProfileTrace] = {}

    def profile(self, name: str) -> ProfileTrace:
        """The (new) trace of profile `name` in this cycle."""
        trace = self.profiles[name] = ProfileTrace(self.detailed)
        return trace


def score_trace(state: CycleState) -> ScheduleTrace | None:
    """The scores the scheduler recorded for this request (None unless it records them)."""
    trace: ScheduleTrace | None = state.get(SCORE_TRACE_STATE_KEY)
    return trace


@dataclass(frozen=True)
class SchedulerProfile:
    """One scheduling profile: filters in order, weighted scorers, one picker."""

    name: str
    filters: tuple[Filter, ...]
    scorers: tuple[WeightedScorer, ...]
    picker: Picker

    def run(self, state: CycleState, request: InferenceRequest, candidates: Sequence[Endpoint],
            timer: PluginTimer = _no_timer, trace: ScheduleTrace | None = None) -> ProfileRunResult | None:
        """Run the profile; `None` when a filter leaves no endpoint. `trace`: record its scores there."""
        record = trace.profile(self.name) if trace is not None else None
        endpoints: Sequence[Endpoint] = candidates
        for flt in self.filters:
            t0 = time.perf_counter()
            kept = flt.filter(state, request, endpoints)
            timer("Filter", flt, time.perf_counter() - t0)
            if record is not None and record.detailed:
                record.record_filter(flt.name, endpoints, kept)
            endpoints = kept
            if not endpoints:
                return None
        totals = [0.0] * len(endpoints)
        names = [ep.name for ep in endpoints]
        for ws in self.scorers:
            t0 = time.perf_counter()
            scores = ws.scorer.score(state, request, endpoints)
            timer("Scorer", ws.scorer, time.perf_counter() - t0)
            if record is not None and record.detailed:
                record.scores.append((ws, scores))
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
        if record is not None:
            record.totals, record.picked = scored, result.targets
        return result if result.targets else None


class Scheduler:
    """Runs the profile handler's rounds of profiles and returns the primary targets."""

    def __init__(self, handler: ProfileHandler, profiles: Mapping[str, SchedulerProfile]) -> None:
        self.handler = handler
        self.profiles = dict(profiles)
        # None: no scores kept; else whether each cycle keeps them detailed (see `record_scores`).
        self._recording: bool | None = None

    def record_scores(self, *, detailed: bool = False) -> None:
        """Keep every cycle's scores in its CycleState (`score_trace`), for `--emit-endpoint-scores`."""
        self._recording = detailed

    def schedule(self, state: CycleState, request: InferenceRequest, candidates: Sequence[Endpoint],
                 timer: PluginTimer = _no_timer, trace: ScheduleTrace | None = None,
                 profile_done: ProfileObserver = _no_observer) -> SchedulingResult:
        """One scheduling cycle; raises `InferenceError` (429) when no endpoint can be chosen.

        `trace` records the cycle's scores there (`epp explain`); without one, a scheduler told to
        `record_scores` keeps a trace in the state. `profile_done` is called after each profile ran.
        """
        if not candidates:
            raise InferenceError(ErrorCode.SERVICE_UNAVAILABLE,
                                 "failed to find endpoint candidates for serving the request",
                                 drop_reason=DropReason.NO_ENDPOINTS)
        if trace is None and self._recording is not None:
            trace = ScheduleTrace(self._recording)
            state.put(SCORE_TRACE_STATE_KEY, trace)
        results: dict[str, ProfileRunResult | None] = {}
        state.put(PROFILE_RESULTS_STATE_KEY, results)
        # A handler that never stops would hang the request; profiles can run at most once each.
        for _ in range(len(self.profiles) + 1):
            t0 = time.perf_counter()
            names = self.handler.pick_profiles(state, request, self.profiles, results)
            timer("ProfilePicker", self.handler, time.perf_counter() - t0)
            names = [n for n in names if n not in results]
            if not names:
                break
            for name in names:
                results[name] = self.profiles[name].run(state, request, candidates, timer, trace)
                profile_done(name, results[name])
        t0 = time.perf_counter()
        outcome = self.handler.process_results(state, request, results)
        timer("ProcessProfilesResults", self.handler, time.perf_counter() - t0)
        if not outcome.targets:
            raise InferenceError(ErrorCode.RESOURCE_EXHAUSTED,
                                 "failed to find target endpoint: no endpoints available for the given request",
                                 drop_reason=DropReason.NO_ENDPOINTS)
        return outcome
