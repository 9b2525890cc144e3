"""Request control: from a parsed request to the picked endpoints, and the response hooks after."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from epp import tracing
from epp.datalayer.freshness import prefer_fresh
from epp.datalayer.registry import EndpointRegistry
from epp.framework.datakeys import PREFIX_MATCH_INFO, PREFIX_TIER_MATCH, PrefixMatchInfo, TierMatch
from epp.framework.errors import DropReason, ErrorCode, InferenceError
from epp.framework.load import (
    CHARACTERS_PER_TOKEN,
    Booking,
    InflightLedger,
    estimate_prompt_tokens,
    prompt_characters,
)
from epp.framework.plugin import (
    Admitter,
    CycleState,
    FirstTokenHook,
    Plugin,
    ProfileRunResult,
    RequestPreprocessor,
    ResponseCompleteHook,
    SchedulingResult,
)
from epp.framework.scheduler import PluginTimer, ProfileObserver, ScheduleTrace
from epp.framework.types import Endpoint, InferenceRequest, ResponseInfo
from epp.logutil import log_failure
from epp.metrics import EppMetrics
from epp.requestcontrol.pipeline import LoadedConfig

if TYPE_CHECKING:
    from epp.flowcontrol.controller import Dispatch, PredictedLatency

log = logging.getLogger(__name__)

# GIE bounds all data producers of one request by this deadline; a slow producer is skipped.
PREPARE_DATA_TIMEOUT_S = 0.4
# Where the director keeps a request's in-flight booking in its CycleState.
BOOKING_STATE_KEY = "epp.requestcontrol/inflight-booking"
# Set in a CycleState once its request went through the preprocessors (they run once per request).
PREPROCESSED_STATE_KEY = "epp.requestcontrol/preprocessed"


def _no_timer(_point: str, _plugin: Plugin, _seconds: float) -> None:
    return None


def _no_observer(_name: str, _result: ProfileRunResult | None) -> None:
    return None


def match_subset(endpoints: Sequence[Endpoint], hint: Sequence[str]) -> list[Endpoint]:
    """Endpoints named by a subset hint: `ip:port` matches exactly, a bare IP any port of it."""
    exact: set[str] = set()
    hosts: set[str] = set()
    for entry in hint:
        entry = entry.strip()
        if not entry:
            continue
        host, sep, port = entry.rpartition(":")
        if sep and port.isdigit() and host and (host.startswith("[") or ":" not in host):
            exact.add(entry)
        else:
            hosts.add(entry.strip("[]"))
    return [ep for ep in endpoints if ep.hostport in exact or ep.address in hosts]


def _pinned(endpoints: Sequence[Endpoint], name: str) -> list[Endpoint]:
    """The one endpoint a request is pinned to (its parser said it holds the state the request continues)."""
    found = [ep for ep in endpoints if ep.name == name]
    if not found:
        raise InferenceError(ErrorCode.SERVICE_UNAVAILABLE,
                             f"the request continues state held only by replica {name}, which is not ready to serve "
                             "(unhealthy or asleep); retry later", drop_reason=DropReason.NO_ENDPOINTS)
    return found


@dataclass(frozen=True, slots=True)
class Stage:
    """One step of the director's pipeline; `side_effects` says what it changes beyond the request (None: nothing).

    `epp explain` runs the same stages as a real request, in the same order, except those with
    side effects, which it names as skipped.
    """

    name: str
    side_effects: str | None
    # Whether the director awaits the stage (it may suspend); the others are called directly.
    awaits: bool
    run: Callable[[Director, StageRun], Awaitable[None] | None]


class StageObserver:
    """What a dry run (`epp explain`) is told: each stage as it starts or is skipped, each plugin's outcome.

    A real request has none. The base class records nothing and stops at the first refusal, as a real request does.
    """

    def stage(self, stage: Stage, *, skipped: bool) -> None:
        """`stage` starts (or is skipped: it has side effects)."""

    def plugin(self, stage: Stage, plugin: Plugin, outcome: str, seconds: float | None) -> None:
        """A plugin of `stage` ran: "ok", "admitted", "refused: ...", "failed: <type>", "timed out ...", "skipped: ..."."""

    def goes_on_after(self, refusal: InferenceError) -> bool:
        """Whether the run goes on after an admitter refused (a dry run does, to show where the request would go)."""
        return False


class StageRun:
    """One request's pass through the stages: what they hand each other and how this pass runs them."""

    __slots__ = ("state", "request", "size_bytes", "timer", "side_effects", "observer", "candidates", "result",
                 "dispatch", "started", "schedule_trace", "profile_done", "refusal")

    def __init__(self, state: CycleState, request: InferenceRequest, *, size_bytes: int = 0,
                 timer: PluginTimer = _no_timer, side_effects: bool = True, observer: StageObserver | None = None,
                 schedule_trace: ScheduleTrace | None = None, profile_done: ProfileObserver = _no_observer) -> None:
        self.state = state
        self.request = request
        self.size_bytes = size_bytes
        self.timer = timer
        # False: the stages with side effects are skipped (a dry run).
        self.side_effects = side_effects
        self.observer = observer
        self.schedule_trace = schedule_trace
        self.profile_done = profile_done
        self.candidates: list[Endpoint] = []
        self.result: SchedulingResult | None = None
        self.dispatch: Dispatch | None = None  # flow control's admission, told where the request went
        self.started: float | None = None  # when scheduling began (after flow control)
        self.refusal: InferenceError | None = None  # the first refusal a dry run went on after


class Director:
    """Runs the stages of `STAGES` for each request (admission, candidates, producers, scheduling, hooks)."""

    def __init__(self, pipeline: LoadedConfig, endpoints: EndpointRegistry, metrics: EppMetrics, *,
                 server_hooks: Sequence[ResponseCompleteHook] = (), use_subset_hint: bool = True,
                 metrics_freshness_s: float | None = None,
                 ledger: InflightLedger | None = None) -> None:
        self.pipeline = pipeline
        # The server's own completion hooks (token accounting), run after the configured ones.
        self.response_complete_hooks = (*pipeline.response_complete_hooks, *server_hooks)
        # Admitters that read no producer data refuse before the producers run (tokenization costs).
        self.admitters_before_data = tuple(a for a in pipeline.admitters if not a.consumes())
        self.admitters_after_data = tuple(a for a in pipeline.admitters if a.consumes())
        self._first_token_hooks = pipeline.plugins_of(FirstTokenHook)
        # Every pick is booked here so that load-aware scorers see work the scrape cannot show yet.
        self.ledger = ledger if ledger is not None else InflightLedger()
        self.endpoints = endpoints
        self.metrics = metrics
        self.use_subset_hint = use_subset_hint
        # With scraping on: endpoints without fresh metrics are left out while others have them.
        self.metrics_freshness_s = metrics_freshness_s
        # What predicts a request's latency before it queues (slo-deadline-ordering-policy): predicted-ttft-scorer.
        self.latency_predictor = next((e.plugin for e in pipeline.plugins if hasattr(e.plugin, "predict_latency")),
                                      None)
        # Session producers (agent-identity): they set the fairness id before flow control reads it.
        self.preprocessors = tuple(e.plugin for e in pipeline.plugins if isinstance(e.plugin, RequestPreprocessor))

    def candidates(self, request: InferenceRequest) -> list[Endpoint]:
        """Healthy, awake pool endpoints, narrowed by the request's subset hint, known load preferred.

        A sleeping vLLM accepts a request and holds it unserved until someone wakes it, so
        sleeping replicas are left out here, for every configuration (a filter could be
        forgotten in a GIE config; this cannot), exactly like unhealthy ones.
        """
        endpoints = [ep for ep in self.endpoints.snapshot() if ep.healthy and not ep.metrics.sleeping]
        if request.pinned_endpoint is not None:
            endpoints = _pinned(endpoints, request.pinned_endpoint)
        if self.use_subset_hint and request.subset_hint is not None:
            endpoints = match_subset(endpoints, request.subset_hint)
            if not endpoints and request.pinned_endpoint is not None:
                raise InferenceError(ErrorCode.SERVICE_UNAVAILABLE,
                                     f"the request continues state held only by replica {request.pinned_endpoint}, "
                                     "which the subset hint (x-gateway-destination-endpoint-subset) leaves out",
                                     drop_reason=DropReason.NO_ENDPOINTS)
        if self.metrics_freshness_s is not None:
            endpoints = prefer_fresh(endpoints, self.metrics_freshness_s)
        return endpoints

    def random_endpoint(self, subset_hint: Sequence[str] | None = None, pinned: str | None = None) -> Endpoint:
        """Any healthy, awake endpoint (within the subset hint), for requests without a body; `pinned`: that one."""
        endpoints = [ep for ep in self.endpoints.snapshot() if ep.healthy and not ep.metrics.sleeping]
        if not endpoints:
            raise InferenceError(ErrorCode.INTERNAL, "no pods available in datastore")
        if pinned is not None:
            endpoints = _pinned(endpoints, pinned)
        if self.use_subset_hint and subset_hint is not None:
            endpoints = match_subset(endpoints, subset_hint)
            if not endpoints:
                raise InferenceError(ErrorCode.SERVICE_UNAVAILABLE,
                                     "failed to find endpoint candidates for serving the request",
                                     drop_reason=DropReason.NO_ENDPOINTS)
        if self.metrics_freshness_s is not None:
            endpoints = prefer_fresh(endpoints, self.metrics_freshness_s)
        return random.choice(endpoints)

    def preprocess(self, state: CycleState, request: InferenceRequest) -> InferenceRequest:
        """The request as the preprocessors return it (its session's fairness id); once per CycleState."""
        if state.get(PREPROCESSED_STATE_KEY):
            return request
        state.put(PREPROCESSED_STATE_KEY, True)
        for plugin in self.preprocessors:
            t0 = time.perf_counter()
            try:
                request = plugin.preprocess(state, request)
            except Exception as exc:  # a broken session reader must not fail the request: it keeps its flow
                log_failure(log, logging.ERROR, "request preprocessor %s failed", exc, plugin.name)
            self.metrics.observe_plugin("Preprocess", plugin, time.perf_counter() - t0)
        return request

    def stage_plugins(self, stage: Stage) -> tuple[Plugin, ...]:
        """The plugins a stage runs in this pipeline, in order (the scheduler's: its profile handler)."""
        pipeline = self.pipeline
        by_stage: dict[str, tuple[Plugin, ...]] = {
            "preprocessors": self.preprocessors,
            "capacity-gates": pipeline.capacity_gates,
            "admitters-before-data": self.admitters_before_data,
            "data-producers": pipeline.data_producers,
            "admitters-after-data": self.admitters_after_data,
            "scheduler": (pipeline.scheduler.handler,),
            "pre-request-hooks": pipeline.pre_request_hooks,
        }
        return by_stage.get(stage.name, ())

    def stage_configured(self, stage: Stage) -> bool:
        """Whether a stage has anything to do in this pipeline (flow control: the gate is on)."""
        if stage.name == "flow-control":
            return self.pipeline.flow_controller is not None
        if stage.name in ("candidates", "scheduler", "booking"):
            return True
        return bool(self.stage_plugins(stage))

    async def schedule(self, state: CycleState, request: InferenceRequest, size_bytes: int = 0) -> SchedulingResult:
        """Pick the target endpoints of a request or raise `InferenceError` (`size_bytes`: its body)."""
        trace = tracing.of(state)
        run = StageRun(state, request, size_bytes=size_bytes,
                       # The metrics' timer itself when not traced.
                       timer=trace.plugin_timer(self.metrics.observe_plugin), profile_done=trace.profile_done)
        try:
            await self.run_stages(run)
        except InferenceError:
            if run.started is not None:  # refused past flow control: a failed scheduling attempt
                self.metrics.scheduler_attempts.labels("failure").inc()
            raise
        finally:
            if run.dispatch is not None:
                run.dispatch.placed(run.result.targets[0].name if run.result is not None else None)
        assert run.result is not None  # the scheduler stage raises when it picks nothing
        return run.result

    async def run_stages(self, run: StageRun) -> None:
        """Run every stage of `STAGES` in order; without `run.side_effects`, skip those that have some."""
        observer = run.observer
        for stage in STAGES:
            if stage.side_effects is not None and not run.side_effects:
                if observer is not None:
                    observer.stage(stage, skipped=True)
                continue
            if observer is not None:
                observer.stage(stage, skipped=False)
            if stage.awaits:
                await cast(Awaitable[None], stage.run(self, run))
            else:
                stage.run(self, run)

    # -- the stages, in the order of STAGES ------------------------------------------------------

    def _preprocessors(self, run: StageRun) -> None:
        run.request = self.preprocess(run.state, run.request)

    async def _flow_control(self, run: StageRun) -> None:
        flow_control = self.pipeline.flow_controller
        if flow_control is None:
            return
        request = run.request
        predicted = await self._predict(request) if flow_control.wants_prediction(request) else None
        # Waits while the pool is saturated; the endpoint is chosen after it (late binding, the view of then).
        with tracing.of(run.state).step("epp.flow_control"):
            run.dispatch = await flow_control.admit(request, run.size_bytes, predicted, state=run.state)

    def _candidates(self, run: StageRun) -> None:
        run.started = time.perf_counter()
        run.candidates = self.candidates(run.request)

    async def _capacity_gates(self, run: StageRun) -> None:
        for gate in self.pipeline.capacity_gates:
            run.candidates = list(await gate.ensure_capacity(run.state, run.request, run.candidates))

    def _admit_before_data(self, run: StageRun) -> None:
        self._admit(STAGE_ADMIT_BEFORE_DATA, self.admitters_before_data, run)
        if not run.candidates:
            raise InferenceError(ErrorCode.SERVICE_UNAVAILABLE,
                                 "failed to find endpoint candidates for serving the request",
                                 drop_reason=DropReason.NO_ENDPOINTS)

    async def _data_producers(self, run: StageRun) -> None:
        if self.pipeline.data_producers:
            await self._prepare_data(run.state, run.request, run.candidates, run.timer, run.observer)

    def _admit_after_data(self, run: StageRun) -> None:
        self._admit(STAGE_ADMIT_AFTER_DATA, self.admitters_after_data, run)

    def _scheduler(self, run: StageRun) -> None:
        run.result = self.pipeline.scheduler.schedule(run.state, run.request, run.candidates, run.timer,
                                                      trace=run.schedule_trace, profile_done=run.profile_done)

    def _pre_request_hooks(self, run: StageRun) -> None:
        result = run.result
        assert result is not None
        for hook in self.pipeline.pre_request_hooks:
            t0 = time.perf_counter()
            try:
                hook.pre_request(run.state, run.request, result)
            except Exception as exc:  # a broken hook must not fail a request that is already scheduled
                log_failure(log, logging.ERROR, "pre-request hook %s failed", exc, hook.name)
            run.timer("PreRequest", hook, time.perf_counter() - t0)

    def _booking(self, run: StageRun) -> None:
        assert run.result is not None
        self._book(run.state, run.request, run.result)
        self.metrics.scheduler_attempts.labels("success").inc()
        if run.started is not None:
            self.metrics.scheduler_e2e.observe(time.perf_counter() - run.started)

    # -- what the stages share -------------------------------------------------------------------

    async def _predict(self, request: InferenceRequest) -> PredictedLatency:
        """The request's own prefill and best TTFT now, for the queue's order (a scratch state: scheduling redoes it)."""
        from epp.flowcontrol.controller import PredictedLatency

        candidates = self.candidates(request)
        if self.latency_predictor is None or not candidates:
            tokens = estimate_prompt_tokens(request)
            return PredictedLatency(tokens * min((self.ledger.prefill_seconds_per_token(ep.name) for ep in candidates),
                                                 default=self.ledger.prefill_seconds_per_token("")))
        scratch = CycleState()
        if self.pipeline.data_producers:
            await self._prepare_data(scratch, request, candidates, self.metrics.observe_plugin)
        service_s, ttft_s = self.latency_predictor.predict_latency(scratch, request, candidates)
        return PredictedLatency(service_s, ttft_s)

    def _admit(self, stage: Stage, admitters: Sequence[Admitter], run: StageRun) -> None:
        observer = run.observer
        for admitter in admitters:
            t0 = time.perf_counter()
            refusal: InferenceError | None = None
            outcome = "admitted"
            try:
                admitter.admit(run.state, run.request, run.candidates)
            except InferenceError as exc:
                refusal, outcome = exc, f"refused: {exc.body}"
            except Exception as exc:  # an admitter that fails denies, as GIE does
                log_failure(log, logging.WARNING, "admitter %s failed", exc, admitter.name)
                refusal = InferenceError(ErrorCode.INTERNAL, "request cannot be admitted")
                refusal.__cause__ = exc
                outcome = f"failed: {type(exc).__name__}"
            finally:
                run.timer("Admitter", admitter, time.perf_counter() - t0)
            if observer is not None:
                observer.plugin(stage, admitter, outcome, None)
            if refusal is not None:
                if observer is None or not observer.goes_on_after(refusal):
                    raise refusal
                if run.refusal is None:
                    run.refusal = refusal

    def _book(self, state: CycleState, request: InferenceRequest, result: SchedulingResult) -> None:
        """Book the pick in the ledger: prompt tokens, and those the prefix match says are uncached."""
        if not result.targets:
            return
        target = result.targets[0]
        tier: TierMatch | None = state.endpoint_data(PREFIX_TIER_MATCH, target.name)
        cpu = disk = 0
        characters = prompt_characters(request)
        if not request.generates:  # a token count, say: the replica runs no prefill for it
            prompt = uncached = 0
        elif tier is not None and tier.total_tokens > 0:
            prompt, uncached = tier.total_tokens, tier.total_tokens - tier.cached_tokens
            cpu, disk = tier.cpu_tokens, tier.disk_tokens
        else:
            prompt = characters // CHARACTERS_PER_TOKEN
            info: PrefixMatchInfo | None = state.endpoint_data(PREFIX_MATCH_INFO, target.name)
            cached = int(info.matched_blocks * info.block_size_tokens) if info is not None else 0
            uncached = prompt - cached
        state.put(BOOKING_STATE_KEY, self.ledger.pick(
            target.name, model=request.target_model, prompt_tokens=prompt, uncached_tokens=uncached,
            cpu_tokens=cpu, disk_tokens=disk, running=target.metrics.running_requests_size,
            waiting=target.metrics.waiting_queue_size,
            prompt_characters=characters))

    def first_token(self, state: CycleState, *, observed: bool = True, request: InferenceRequest | None = None,
                    target: Endpoint | None = None) -> None:
        """The picked endpoint answered with its first token (`observed`) or a whole response."""
        booking: Booking | None = state.get(BOOKING_STATE_KEY)
        self.ledger.first_token(booking, observed=observed)
        if observed and request is not None:
            for hook in self._first_token_hooks:
                t0 = time.perf_counter()
                try:
                    hook.on_first_token(state, request, target)
                except Exception as exc:
                    log_failure(log, logging.ERROR, "first-token hook %s failed", exc, hook.name)
                self.metrics.observe_plugin("FirstToken", hook, time.perf_counter() - t0)
        if self.pipeline.flow_controller is not None:
            self.pipeline.flow_controller.wake()  # its prefill is done: a held request may fit now

    async def _prepare_data(self, state: CycleState, request: InferenceRequest, candidates: Sequence[Endpoint],
                            timer: PluginTimer, observer: StageObserver | None = None) -> None:
        """Run the data producers in order, all of them within `PREPARE_DATA_TIMEOUT_S`; best effort each."""
        deadline = time.monotonic() + PREPARE_DATA_TIMEOUT_S
        for producer in self.pipeline.data_producers:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                if observer is None:
                    log.warning("data producers ran out of time before %s", producer.name)
                    return
                observer.plugin(STAGE_DATA_PRODUCERS, producer, "skipped: the producers' deadline had passed", None)
                continue
            t0 = time.perf_counter()
            outcome = "ok"
            try:
                # A timeout scope, not wait_for: no task per producer (most finish without suspending).
                async with asyncio.timeout(remaining):
                    await producer.prepare(state, request, candidates)
            except TimeoutError as exc:
                log_failure(log, logging.WARNING, "data producer %s failed", exc, producer.name)
                outcome = f"timed out (the producers share {PREPARE_DATA_TIMEOUT_S * 1000:.0f} ms)"
            except Exception as exc:  # producers are best effort: scoring goes on without their data
                # Never the message at this level: a UnicodeEncodeError's message quotes the prompt.
                log_failure(log, logging.WARNING, "data producer %s failed", exc, producer.name)
                outcome = f"failed: {type(exc).__name__}"
            seconds = time.perf_counter() - t0
            timer("PrepareData", producer, seconds)
            if observer is not None:
                observer.plugin(STAGE_DATA_PRODUCERS, producer, outcome, seconds)

    def response_headers(self, state: CycleState, request: InferenceRequest,
                         response: ResponseInfo, target: Endpoint | None) -> None:
        """Run the response-headers hooks; they may add headers to `response.set_headers`."""
        for hook in self.pipeline.response_headers_hooks:
            t0 = time.perf_counter()
            try:
                hook.on_response_headers(state, request, response, target)
            except Exception as exc:
                log_failure(log, logging.ERROR, "response-headers hook %s failed", exc, hook.name)
            self.metrics.observe_plugin("ResponseReceived", hook, time.perf_counter() - t0)

    def response_complete(self, state: CycleState, request: InferenceRequest,
                          response: ResponseInfo, target: Endpoint | None) -> None:
        """Run the completion hooks once per picked request, also when the stream died."""
        if self.pipeline.flow_controller is not None:
            self.pipeline.flow_controller.on_request_complete(state, response)
        try:
            # No response header seen: the request may still run there (request-only Envoy mode,
            # or the client left), so it counts until the endpoint's next scrape shows it.
            self.ledger.complete(state.get(BOOKING_STATE_KEY), response, response_seen=bool(response.status))
        except Exception:  # an observer (a calibrator) must not break the completion hooks
            log.exception("in-flight ledger observer failed")
        for hook in self.response_complete_hooks:
            t0 = time.perf_counter()
            try:
                hook.on_response_complete(state, request, response, target)
            except Exception as exc:
                log_failure(log, logging.ERROR, "response-complete hook %s failed", exc, hook.name)
            self.metrics.observe_plugin("ResponseComplete", hook, time.perf_counter() - t0)


# The director's stages, in the order it runs them; `epp explain` runs them too, skipping those with side effects.
# The preprocessors (the session producers) run first: flow control queues the request under its session.
STAGE_PREPROCESSORS = Stage("preprocessors", None, False, Director._preprocessors)
STAGE_FLOW_CONTROL = Stage("flow-control", "queues the request while the pool is saturated", True,
                           Director._flow_control)
STAGE_CANDIDATES = Stage("candidates", None, False, Director._candidates)
STAGE_CAPACITY_GATES = Stage("capacity-gates", "may wake a sleeping replica and hold the request for it", True,
                             Director._capacity_gates)
STAGE_ADMIT_BEFORE_DATA = Stage("admitters-before-data", None, False, Director._admit_before_data)
STAGE_DATA_PRODUCERS = Stage("data-producers", None, True, Director._data_producers)
STAGE_ADMIT_AFTER_DATA = Stage("admitters-after-data", None, False, Director._admit_after_data)
STAGE_SCHEDULER = Stage("scheduler", None, False, Director._scheduler)
STAGE_PRE_REQUEST_HOOKS = Stage(
    "pre-request-hooks", "records the pick: prefix index, session binding, KV claim, prefiller header", False,
    Director._pre_request_hooks)
STAGE_BOOKING = Stage("booking", "books the pick in the in-flight ledger and counts the scheduling attempt", False,
                      Director._booking)
STAGES: tuple[Stage, ...] = (STAGE_PREPROCESSORS, STAGE_FLOW_CONTROL, STAGE_CANDIDATES, STAGE_CAPACITY_GATES, STAGE_ADMIT_BEFORE_DATA,
                             STAGE_DATA_PRODUCERS, STAGE_ADMIT_AFTER_DATA, STAGE_SCHEDULER, STAGE_PRE_REQUEST_HOOKS,
                             STAGE_BOOKING)
