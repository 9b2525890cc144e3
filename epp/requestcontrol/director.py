"""Request control: from a parsed request to the picked endpoints, and the response hooks after."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

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
from epp.framework.plugin import Admitter, CycleState, RequestPreprocessor, ResponseCompleteHook, SchedulingResult
from epp.framework.scheduler import PluginTimer
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


class Director:
    """Runs admission, candidate selection, producers, scheduling and hooks for each request."""

    def __init__(self, pipeline: LoadedConfig, endpoints: EndpointRegistry, metrics: EppMetrics, *,
                 server_hooks: Sequence[ResponseCompleteHook] = (), use_subset_hint: bool = True,
                 metrics_freshness_s: float | None = None,
                 ledger: InflightLedger | None = None) -> None:
        self.pipeline = pipeline
        # The server's own completion hooks (token accounting), run after the configured ones.
        self.response_complete_hooks = (*pipeline.response_complete_hooks, *server_hooks)
        # Admitters that read no producer data refuse before the producers run (tokenization costs).
        self._admitters_before_data = tuple(a for a in pipeline.admitters if not a.consumes())
        self._admitters_after_data = tuple(a for a in pipeline.admitters if a.consumes())
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
        if self.use_subset_hint and request.subset_hint is not None:
            endpoints = match_subset(endpoints, request.subset_hint)
        if self.metrics_freshness_s is not None:
            endpoints = prefer_fresh(endpoints, self.metrics_freshness_s)
        return endpoints

    def random_endpoint(self, subset_hint: Sequence[str] | None = None) -> Endpoint:
        """Any healthy, awake endpoint (within the subset hint), for requests without a body."""
        endpoints = [ep for ep in self.endpoints.snapshot() if ep.healthy and not ep.metrics.sleeping]
        if not endpoints:
            raise InferenceError(ErrorCode.INTERNAL, "no pods available in datastore")
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

    async def schedule(self, state: CycleState, request: InferenceRequest, size_bytes: int = 0) -> SchedulingResult:
        """Pick the target endpoints of a request or raise `InferenceError` (`size_bytes`: its body)."""
        request = self.preprocess(state, request)
        flow_control = self.pipeline.flow_controller
        if flow_control is None:
            return await self._schedule(state, request)
        predicted = await self._predict(request) if flow_control.wants_prediction(request) else None
        # Waits while the pool is saturated; the endpoint is chosen after it (late binding, the view of then).
        with tracing.of(state).step("epp.flow_control"):
            dispatch: Dispatch = await flow_control.admit(request, size_bytes, predicted, state=state)
        target = None
        try:
            result = await self._schedule(state, request)
            target = result.targets[0].name
            return result
        finally:
            dispatch.placed(target)

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

    async def _schedule(self, state: CycleState, request: InferenceRequest) -> SchedulingResult:
        started = time.perf_counter()
        trace = tracing.of(state)
        timer = trace.plugin_timer(self.metrics.observe_plugin)  # the metrics' timer itself when not traced
        try:
            candidates = self.candidates(request)
            for gate in self.pipeline.capacity_gates:
                candidates = list(await gate.ensure_capacity(state, request, candidates))
            self._admit(self._admitters_before_data, state, request, candidates, timer)
            if not candidates:
                raise InferenceError(ErrorCode.SERVICE_UNAVAILABLE,
                                     "failed to find endpoint candidates for serving the request",
                                     drop_reason=DropReason.NO_ENDPOINTS)
            if self.pipeline.data_producers:
                await self._prepare_data(state, request, candidates, timer)
            self._admit(self._admitters_after_data, state, request, candidates, timer)
            result = self.pipeline.scheduler.schedule(state, request, candidates, timer,
                                                      profile_done=trace.profile_done)
        except InferenceError:
            self.metrics.scheduler_attempts.labels("failure").inc()
            raise
        for hook in self.pipeline.pre_request_hooks:
            t0 = time.perf_counter()
            try:
                hook.pre_request(state, request, result)
            except Exception as exc:  # a broken hook must not fail a request that is already scheduled
                log_failure(log, logging.ERROR, "pre-request hook %s failed", exc, hook.name)
            timer("PreRequest", hook, time.perf_counter() - t0)
        self._book(state, request, result)
        self.metrics.scheduler_attempts.labels("success").inc()
        self.metrics.scheduler_e2e.observe(time.perf_counter() - started)
        return result

    def _admit(self, admitters: Sequence[Admitter], state: CycleState, request: InferenceRequest,
               candidates: Sequence[Endpoint], timer: PluginTimer) -> None:
        for admitter in admitters:
            t0 = time.perf_counter()
            try:
                admitter.admit(state, request, candidates)
            except InferenceError:
                raise
            except Exception as exc:  # an admitter that fails denies, as GIE does
                log_failure(log, logging.WARNING, "admitter %s failed", exc, admitter.name)
                raise InferenceError(ErrorCode.INTERNAL, "request cannot be admitted") from exc
            finally:
                timer("Admitter", admitter, time.perf_counter() - t0)

    def _book(self, state: CycleState, request: InferenceRequest, result: SchedulingResult) -> None:
        """Book the pick in the ledger: prompt tokens, and those the prefix match says are uncached."""
        if not result.targets:
            return
        target = result.targets[0]
        tier: TierMatch | None = state.endpoint_data(PREFIX_TIER_MATCH, target.name)
        cpu = disk = 0
        characters = prompt_characters(request)
        if tier is not None and tier.total_tokens > 0:
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

    def first_token(self, state: CycleState, *, observed: bool = True) -> None:
        """The picked endpoint answered with its first token (`observed`) or a whole response."""
        booking: Booking | None = state.get(BOOKING_STATE_KEY)
        self.ledger.first_token(booking, observed=observed)
        if self.pipeline.flow_controller is not None:
            self.pipeline.flow_controller.wake()  # its prefill is done: a held request may fit now

    async def _prepare_data(self, state: CycleState, request: InferenceRequest,
                            candidates: Sequence[Endpoint], timer: PluginTimer) -> None:
        deadline = time.monotonic() + PREPARE_DATA_TIMEOUT_S
        for producer in self.pipeline.data_producers:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                log.warning("data producers ran out of time before %s", producer.name)
                return
            t0 = time.perf_counter()
            try:
                # A timeout scope, not wait_for: no task per producer (most finish without suspending).
                async with asyncio.timeout(remaining):
                    await producer.prepare(state, request, candidates)
            except Exception as exc:  # producers are best effort: scoring goes on without their data
                # Never the message at this level: a UnicodeEncodeError's message quotes the prompt.
                log_failure(log, logging.WARNING, "data producer %s failed", exc, producer.name)
            timer("PrepareData", producer, time.perf_counter() - t0)

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
