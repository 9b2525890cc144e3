"""`program-aware-fairness`: least attained service (LAS) or turn priority across programs, with aging.

A program is a flow: the fairness id, which `agent-identity` sets to the agent session (the root
session of a sub-agent chain). llm-d's semantics (`strategy: las`):

    service(p)   attained service: input tokens + 2 x output tokens of p's finished requests,
                 decayed in wall-clock time with half-life `lasHalfLifeSeconds` (default 60 s;
                 0 = no decay)
    wait(p)      how long the head request of p's queue has waited
    score(p)     = lasWeightService x (1 - norm(service)) + lasWeightHeadWait x norm(wait)
                   (norm: min-max over the programs with queued requests; all equal -> 0.5)

and the highest score is served next (ties: the oldest head). The older llm-d parameter
`lasDecayFactor` (in (0, 1], the agentic guide's 0.99997) is still taken: without
`lasHalfLifeSeconds` it multiplies the service of every idle program (nothing queued, nothing
in flight) by the factor once per dispatch decision, as llm-d did before the half-life replaced it
(a warning names the replacement).

**Turn priority** (llm-d's `strategy: turn-priority`): the deepest session goes first, since its
prefix is the likeliest still resident in the KV cache and finishing it frees its slot sooner:

    turn(p)      requests dispatched for p so far + 1 (the waiting one); 1 again when p had nothing in
                 flight and its head arrived more than `turnPriorityInactivitySeconds` (120; 0 = never)
                 after p's last completion: a session dormant that long has lost its prefix, so it
                 competes from turn one and earns its depth again (its count restarts at that dispatch)
    score(p)     = turn(p) + turnPriorityTimeWeight (0.05) x head wait in seconds

The highest score goes next (ties: the oldest head). A newcomer overtakes a session D turns deeper
after waiting D / turnPriorityTimeWeight seconds, so with the band's `defaultRequestTTL` the most it
can overcome is the weight x the TTL (llm-d's guide sets 9000 s on its session band: 450 turns);
past that sustained contention sheds new sessions (503, `rejected-ttl-expired`), as in llm-d. It
wants one fairness id per session (`agent-identity`): requests without one share `default-flow`.

**Aging** (ours, `agingWindow`, default 60 s with LAS; off with turn-priority unless given, since
turn priority bounds waits by its own weight): a program whose head request has waited
`agingWindow` or longer is served before any LAS choice, the oldest such head first. So no
request is overtaken by one that arrived more than `agingWindow` after it (with the band's
default FCFS ordering inside a flow): however much less service a stream of newer programs has,
a heavy program waits at most for what arrived up to `agingWindow` after its request. The hard
bound on a wait stays `defaultRequestTTL`.

**Continuations** (ours): the next turn of a session after a tool call or a person's reply is
the same program, not a new one: it keeps the program's attained service (a session cannot
reset its share by pausing), decayed over the pause (60 s half-life: after a 5 s tool call it
keeps 94 %, after a 10 min human pause 0.1 %: it comes back as nearly new). What a turn is
charged is what the pool spent on it: the prompt tokens it had to compute plus twice its output;
its cached prefix, a context the program already paid for, is charged `cachedTokenWeight`
(default 0; 1 gives llm-d's charge of the whole prompt). Without that, every long agent session
would sink behind new ones only because its context is long, though its turns cost little.

Bounded: program state lives in a session table (`maxPrograms`, default 100,000, least recently
used out; a program unused for `evictionTtlSeconds`, default 3600 s, is dropped;
`evictionSweepSeconds` is accepted for llm-d's configs: the sweep here runs on every write).
Metrics: `epp_program_aware_jains_fairness_index{plugin}` (Jain's index over the programs' mean
queue waits), `epp_program_aware_aged_dispatches_total{plugin}` (choices made by the aging
bound), and the table's `epp_session_table_*{table=<plugin>}`.
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from epp.flowcontrol.fairness import FairnessPolicy, FlowT, ServiceUsage
from epp.flowcontrol.ordering import OrderingPolicy, QueuedRequest
from epp.framework.errors import ConfigError
from epp.framework.metrics import once_per_registry
from epp.framework.params import PluginParams
from epp.framework.plugin import PluginContext
from epp.scorers.session_table import DEFAULT_CAPACITY, SessionTable

log = logging.getLogger(__name__)

INPUT_TOKEN_WEIGHT = 1.0
OUTPUT_TOKEN_WEIGHT = 2.0  # llm-d: output tokens cost about twice input tokens
DEFAULT_AGING_WINDOW_S = 60.0
STRATEGIES = ("las", "turn-priority")
DEFAULT_TURN_TIME_WEIGHT = 0.05  # turns a second of head wait is worth (llm-d's default)
DEFAULT_TURN_INACTIVITY_S = 120.0


class ProgramState:
    """One program's attained service and activity."""

    __slots__ = ("service", "anchor", "idle_since_pick", "queued", "inflight", "waits", "mean_wait", "dispatched",
                 "last_completion")

    def __init__(self, now: float, picks: int) -> None:
        self.service = 0.0
        self.anchor = now  # the time up to which decay is folded into `service`
        self.idle_since_pick: int | None = picks  # the dispatch decision since which it is idle (None: active)
        self.queued = 0
        self.inflight = 0
        self.waits = 0
        self.mean_wait = 0.0
        self.dispatched = 0  # requests dispatched since the program (re)started: turn priority's depth
        self.last_completion: float | None = None

    @property
    def idle(self) -> bool:
        return self.queued <= 0 and self.inflight <= 0


def _metrics(registry: CollectorRegistry | None) -> tuple[Gauge, Counter]:
    def build(r: CollectorRegistry | None) -> tuple[Gauge, Counter]:
        return (Gauge("epp_program_aware_jains_fairness_index", "Jain's fairness index over the mean queue wait "
                      "of each program (1 = equal waits).", ["plugin"], registry=r),
                Counter("epp_program_aware_aged_dispatches", "Dispatch choices program-aware-fairness made by its "
                        "aging bound (a head request waited agingWindow or longer).", ["plugin"], registry=r))
    return once_per_registry(registry, "epp_program_aware", build)


def _normalize(value: float, low: float, high: float) -> float:
    return 0.5 if high == low else (value - low) / (high - low)


class ProgramAwareFairness(FairnessPolicy):
    """Programs ordered by least attained service (llm-d's LAS) or session depth (turn-priority), with aging."""

    type_name = "program-aware-fairness"

    def __init__(self, name: str | None = None, params: PluginParams | None = None,
                 context: PluginContext | None = None) -> None:
        super().__init__(name)
        p = params if params is not None else PluginParams(self.name, None)
        strategy = p.str("strategy", "las")
        if strategy not in STRATEGIES:
            raise ConfigError(f"plugin {self.name!r}: unknown scoring strategy {strategy!r}: allowed: "
                              f"{', '.join(STRATEGIES)} (llm-d's drr and rr are not implemented)")
        self.strategy = strategy
        self.turn_time_weight = p.float("turnPriorityTimeWeight", DEFAULT_TURN_TIME_WEIGHT, minimum=0.0)
        self.turn_inactivity_s = p.float("turnPriorityInactivitySeconds", DEFAULT_TURN_INACTIVITY_S, minimum=0.0)
        self.weight_service = p.float("lasWeightService", 0.8, minimum=0.0)
        self.weight_wait = p.float("lasWeightHeadWait", 0.2, minimum=0.0)
        half_life = p.float("lasHalfLifeSeconds", math.nan, minimum=0.0)
        factor = p.float("lasDecayFactor", math.nan)
        if not math.isnan(factor) and not 0 < factor <= 1:
            raise ConfigError(f"plugin {self.name!r}: parameter 'lasDecayFactor' must be in (0, 1], got {factor:g}")
        if math.isnan(half_life):
            half_life = 0.0 if not math.isnan(factor) else 60.0
        self.half_life_s = half_life
        # The older per-decision decay applies only where llm-d applied it: no half-life.
        self.decay_factor = factor if not math.isnan(factor) and half_life == 0 else None
        if not math.isnan(factor):
            log.warning("plugin %r: lasDecayFactor is llm-d's older per-dispatch decay of idle programs (%s); its "
                        "replacement is lasHalfLifeSeconds", self.name,
                        "used, since lasHalfLifeSeconds is not set" if self.decay_factor is not None
                        else "ignored, since lasHalfLifeSeconds is set")
        ttl = p.float("evictionTtlSeconds", 3600.0, minimum=0.0)
        # llm-d's sweep period, checked as llm-d does; here every write sweeps the expired programs.
        if p.float("evictionSweepSeconds", 300.0) <= 0:
            raise ConfigError(f"plugin {self.name!r}: parameter 'evictionSweepSeconds' must be > 0")
        aging = p.duration("agingWindow", math.nan)
        if not math.isnan(aging) and not (0 < aging < math.inf):
            raise ConfigError(f"plugin {self.name!r}: parameter 'agingWindow' must be a duration > 0")
        # Turn priority bounds waits by its own weight: our aging bound only when asked for.
        self.aging_window_s: float | None = (aging if not math.isnan(aging)
                                             else DEFAULT_AGING_WINDOW_S if strategy == "las" else None)
        self.cached_token_weight = p.float("cachedTokenWeight", 0.0, minimum=0.0, maximum=1.0)
        capacity = p.int("maxPrograms", DEFAULT_CAPACITY, minimum=1)
        registry = context.metrics_registry if context is not None else None
        self.programs: SessionTable[ProgramState] = SessionTable(
            self.name, capacity=capacity, ttl_s=ttl, registry=registry, on_evict=self._forget)
        jain, aged = _metrics(registry)
        self._jain = jain.labels(self.name)
        self._aged = aged.labels(self.name)
        self._jain.set(1.0)
        self.aged_dispatches = 0
        self._picks = 0
        # Jain's index over the programs' mean waits, kept as running sums (no walk over the table).
        self._wait_n = 0
        self._wait_sum = 0.0
        self._wait_sq = 0.0

    def describe(self) -> str:
        aging = f"{self.aging_window_s:g}s" if self.aging_window_s is not None else "off"
        if self.strategy == "turn-priority":
            return (f"strategy=turn-priority turnPriorityTimeWeight={self.turn_time_weight:g} "
                    f"turnPriorityInactivitySeconds={self.turn_inactivity_s:g} agingWindow={aging} "
                    f"maxPrograms={self.programs.capacity} evictionTtlSeconds={self.programs.ttl_s:g}")
        decay = (f"lasDecayFactor={self.decay_factor:g} (per dispatch, idle programs)" if self.decay_factor is not None
                 else f"lasHalfLifeSeconds={self.half_life_s:g}")
        return (f"strategy=las lasWeightService={self.weight_service:g} lasWeightHeadWait={self.weight_wait:g} "
                f"{decay} agingWindow={aging} cachedTokenWeight={self.cached_token_weight:g} "
                f"maxPrograms={self.programs.capacity} evictionTtlSeconds={self.programs.ttl_s:g}")

    def debug_state(self) -> Mapping[str, Any]:
        """Programs tracked, the fairness index and the aging bound's use (never program ids)."""
        return {"strategy": self.strategy, "programs": self.programs.debug_state(),
                "jains_fairness_index": self.fairness_index(), "aged_dispatches": self.aged_dispatches,
                "aging_window_s": self.aging_window_s}

    # -- attained service ---------------------------------------------------------------------

    def _state(self, program: str, now: float) -> ProgramState:
        return self.programs.setdefault(program, lambda: ProgramState(now, self._picks), now)

    def _fold(self, state: ProgramState, now: float) -> None:
        """Apply the decay accrued since the state was last read."""
        if self.half_life_s > 0:
            elapsed = now - state.anchor
            if elapsed > 0:
                state.service *= math.exp2(-elapsed / self.half_life_s)
        elif self.decay_factor is not None and state.idle_since_pick is not None:
            state.service *= self.decay_factor ** (self._picks - state.idle_since_pick)
            state.idle_since_pick = self._picks
        state.anchor = max(state.anchor, now)

    def _activity(self, state: ProgramState) -> None:
        """Record whether the program is idle now (the per-decision decay runs only while it is)."""
        if state.idle:
            if state.idle_since_pick is None:
                state.idle_since_pick = self._picks
        else:
            state.idle_since_pick = None

    def service(self, program: str, now: float) -> float:
        """The program's attained service now, in weighted tokens (0 for a program not tracked)."""
        state = self.programs.get(program, now, touch=False)
        if state is None:
            return 0.0
        self._fold(state, now)
        return state.service

    def charge(self, usage: ServiceUsage) -> float:
        """Weighted tokens a finished request adds: computed prompt + cachedTokenWeight x cached + 2 x output."""
        cached = min(max(0, usage.cached_tokens), max(0, usage.prompt_tokens))
        computed = max(0, usage.prompt_tokens) - cached
        return (INPUT_TOKEN_WEIGHT * (computed + self.cached_token_weight * cached)
                + OUTPUT_TOKEN_WEIGHT * max(0, usage.completion_tokens))

    # -- the controller's events --------------------------------------------------------------

    def on_enqueue(self, item: QueuedRequest, now: float) -> None:
        state = self._state(item.fairness_id, now)
        self._fold(state, now)
        state.queued += 1
        self._activity(state)

    def on_leave(self, item: QueuedRequest, now: float) -> None:
        state = self._state(item.fairness_id, now)
        self._fold(state, now)
        state.queued = max(0, state.queued - 1)
        self._activity(state)

    def on_dispatch(self, item: QueuedRequest, now: float) -> None:
        state = self._state(item.fairness_id, now)
        self._fold(state, now)
        if self._dormant(state, item):
            state.dispatched = 0  # it was scored as turn one: its depth is earned again from here
        state.dispatched += 1
        state.queued = max(0, state.queued - 1)
        state.inflight += 1
        self._activity(state)
        self._record_wait(state, max(0.0, now - item.enqueued))

    def on_complete(self, item: QueuedRequest, usage: ServiceUsage | None, now: float) -> None:
        state = self._state(item.fairness_id, now)
        self._fold(state, now)
        state.inflight = max(0, state.inflight - 1)
        state.last_completion = now
        if usage is not None:
            state.service += self.charge(usage)
        self._activity(state)

    # -- turn priority ------------------------------------------------------------------------

    def _dormant(self, state: ProgramState, head: QueuedRequest) -> bool:
        """Whether the program was idle longer than turnPriorityInactivitySeconds before `head` arrived."""
        return (self.turn_inactivity_s > 0 and state.inflight <= 0 and state.last_completion is not None
                and head.enqueued - state.last_completion > self.turn_inactivity_s)

    def turn(self, program: str, head: QueuedRequest, now: float) -> int:
        """The turn number of `program`'s head request: dispatched so far + 1, or 1 after a dormant spell."""
        state = self.programs.get(program, now, touch=False)
        if state is None or self._dormant(state, head):
            return 1
        return int(state.dispatched) + 1

    # -- choice -------------------------------------------------------------------------------

    def pick(self, flows: OrderedDict[str, FlowT], ordering: OrderingPolicy, now: float = 0.0) -> FlowT | None:
        self._picks += 1
        aged: tuple[float, int, FlowT] | None = None
        candidates: list[tuple[FlowT, QueuedRequest, float, float]] = []
        for program, flow in flows.items():
            head = flow.head()
            if head is None:
                continue
            wait = now - head.enqueued
            if (self.aging_window_s is not None and wait >= self.aging_window_s
                    and (aged is None or (head.enqueued, head.sequence) < aged[:2])):
                aged = (head.enqueued, head.sequence, flow)
            if aged is None:
                if self.strategy == "turn-priority":
                    candidates.append((flow, head, float(self.turn(program, head, now)), wait))
                    continue
                state = self._state(program, now)
                self._fold(state, now)
                candidates.append((flow, head, state.service, wait))
        if aged is not None:
            self.aged_dispatches += 1
            self._aged.inc()
            return aged[2]
        if not candidates:
            return None
        if self.strategy == "turn-priority":
            return self._deepest(candidates)
        low_s = min(c[2] for c in candidates)
        high_s = max(c[2] for c in candidates)
        low_w = min(c[3] for c in candidates)
        high_w = max(c[3] for c in candidates)
        best: tuple[float, float, int] | None = None
        chosen: FlowT | None = None
        for flow, head, service, wait in candidates:
            score = (self.weight_service * (1.0 - _normalize(service, low_s, high_s))
                     + self.weight_wait * _normalize(wait, low_w, high_w))
            key = (-score, head.enqueued, head.sequence)  # highest score; ties: the oldest head
            if best is None or key < best:
                best, chosen = key, flow
        return chosen

    def _deepest(self, candidates: list[tuple[FlowT, QueuedRequest, float, float]]) -> FlowT:
        """Turn priority's choice: the highest turn + weight x head wait; ties: the oldest head."""
        best: tuple[float, float, int] | None = None
        chosen = candidates[0][0]
        for flow, head, turn, wait in candidates:
            key = (-(turn + self.turn_time_weight * max(0.0, wait)), head.enqueued, head.sequence)
            if best is None or key < best:
                best, chosen = key, flow
        return chosen

    # -- fairness index -----------------------------------------------------------------------

    def _record_wait(self, state: ProgramState, wait: float) -> None:
        if state.waits:
            self._wait_sum -= state.mean_wait
            self._wait_sq -= state.mean_wait * state.mean_wait
        else:
            self._wait_n += 1
        state.waits += 1
        state.mean_wait += (wait - state.mean_wait) / state.waits
        self._wait_sum += state.mean_wait
        self._wait_sq += state.mean_wait * state.mean_wait
        self._jain.set(self.fairness_index())

    def _forget(self, program: str, state: ProgramState) -> None:
        """A program left the table: its mean wait leaves the fairness index."""
        if state.waits:
            self._wait_n -= 1
            self._wait_sum -= state.mean_wait
            self._wait_sq -= state.mean_wait * state.mean_wait

    def fairness_index(self) -> float:
        """Jain's index over the programs' mean queue waits: 1 when fewer than two have waited or all waited alike."""
        if self._wait_n <= 1 or self._wait_sq <= 1e-12:
            return 1.0
        return min(1.0, (self._wait_sum * self._wait_sum) / (self._wait_n * self._wait_sq))
