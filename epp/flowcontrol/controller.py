"""The flow controller: holds requests while the pool is saturated and dispatches them by priority.

A request is queued in the band of its priority, in the queue of its flow (its fairness id). A
dispatch cycle runs on events only: a request arrives, a request completes, an endpoint's metrics
snapshot is swapped in, or a dispatched request fails to be placed. Each cycle walks the bands
from the highest priority down; while the saturation detector rates the pool below the band's
ceiling (usage-limit policy), the band's fairness policy picks a flow and its ordering policy the
request. A band over its ceiling stops the cycle (head-of-line blocking: lower bands wait too).

With `slo-deadline-ordering-policy` a request's TTFT objective (`x-llm-d-slo-ttft-ms`, or the
policy's `ttftObjective` for its band) and its predicted latency (`PredictedLatency`, from the
director before queueing) order the queue, and with `shed` a request that can no longer meet
its objective while the pool is saturated is answered at once instead of waiting to miss it:
429 at admission when even the best endpoint's predicted TTFT is over the objective, 503 when
its latest start (objective minus its predicted prefill) passes while it waits. Messages carry
llm-d's drop reasons (`rejected-saturated`, `rejected-ttl-expired`).

The endpoint is chosen only when a request leaves the queue (the director schedules after
`admit` returns): late binding, with the view of that moment.

Scraped metrics lag the requests just sent, so the detector is shown each endpoint with the
requests dispatched to it since its last scrape added to its waiting queue, and requests still
being scheduled spread over the least-loaded endpoints; otherwise one stale snapshot would let a
whole queue through at once. (`concurrency-detector` counts the picker's own requests itself and
is told only of those still being scheduled.)

The fairness policy hears of every request's course (queued, left, dispatched, finished with its
token usage), which `program-aware-fairness` charges as attained service. Ceilings come from the
usage-limit policy over every priority known (configured bands and those seen), as llm-d asks
`priority-holdback-policy`.

With `enableEviction` (llm-d's semantics), a band blocked by saturation while the next victim,
an in-flight sheddable request (priority < 0; the lowest priority first, then the most recently
dispatched), has a lower priority than the band, makes room: it evicts enough victims to bring
saturation under the band's ceiling (estimating each at saturation / requests in flight; at least
one, at most two per decision), then waits until every evicted stream has ended and a grace has
passed (10 ms for `concurrency-detector`, whose counts drop at once; 500 ms for scraped
detectors) or 10 s, before deciding again. An evicted request's stream is answered 429 with
`x-llm-d-request-dropped-reason: evicted` (the ext_proc server watches `eviction_signal`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import heapq
import itertools
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from epp.flowcontrol.concurrency import ConcurrencyDetector
from epp.flowcontrol.config import FlowControlConfig
from epp.flowcontrol.fairness import ServiceUsage
from epp.flowcontrol.metrics import FlowControlMetrics
from epp.flowcontrol.ordering import QueuedRequest, SLODeadlineOrderingPolicy
from epp.flowcontrol.queues import PriorityBand
from epp.framework.datakeys import PREFIX_MATCH_INFO, PREFIX_TIER_MATCH
from epp.framework.errors import DropReason, ErrorCode, InferenceError
from epp.framework.load import InflightLedger, estimate_prompt_tokens
from epp.framework.plugin import CycleState
from epp.framework.types import Endpoint, InferenceRequest, ResponseInfo

log = logging.getLogger(__name__)

CAPACITY_MESSAGE = "request rejected by flow control: queue capacity exceeded"
TTL_MESSAGE = "request timed out in queue"
SHUTDOWN_MESSAGE = "the endpoint picker is shutting down"
EVICTED_MESSAGE = "request evicted by flow control: its capacity went to a higher-priority request"
# Envoy's own deadline for the request (set from the route timeout): the EDF ordering uses it.
ENVOY_TIMEOUT_HEADER = "x-envoy-expected-rq-timeout-ms"
# Where `admit` leaves a request's Dispatch in its CycleState (completion and eviction find it there).
DISPATCH_STATE_KEY = "epp.flowcontrol/dispatch"
# llm-d's eviction pacing: victims per decision, and how long an unconfirmed one holds the next decision.
MAX_EVICTIONS_PER_DECISION = 2
EVICTION_CONFIRMATION_TIMEOUT_S = 10.0
# After a victim's stream ended: until its room shows in the detector (llm-d's values).
EVICTION_GRACE_COUNTING_S = 0.01  # concurrency-detector: its counts drop with the stream
EVICTION_GRACE_SCRAPED_S = 0.5  # scraped detectors: the engine frees the KV, then a scrape shows it


class SaturationDetector(Protocol):
    """Rates endpoints: >= 1.0 means saturated (e.g. `utilization-detector`)."""

    def saturation(self, endpoints: Sequence[Endpoint]) -> float: ...


class EndpointPool(Protocol):
    """The pool the controller watches (the `EndpointRegistry`)."""

    def snapshot(self) -> Sequence[Endpoint]: ...


@dataclass(frozen=True, slots=True)
class PredictedLatency:
    """What the director predicts for a request about to queue: its own prefill and its TTFT now (seconds)."""

    service_s: float  # the request's own prefill on its cheapest endpoint (no queue ahead)
    ttft_s: float | None = None  # the best endpoint's predicted TTFT if dispatched now; None: not predicted


def shed_at_admission_message(predicted_s: float, objective_s: float) -> str:
    """The 429 of a request whose best predicted TTFT is already over its objective."""
    return (f"request rejected by flow control ({DropReason.SATURATED}): the pool is saturated and the best "
            f"predicted TTFT {predicted_s * 1e3:.0f} ms exceeds the request's TTFT objective {objective_s * 1e3:.0f} ms")


def shed_in_queue_message(waited_s: float, service_s: float, objective_s: float) -> str:
    """The 503 of a queued request whose latest start passed."""
    return (f"request rejected by flow control ({DropReason.TTL_EXPIRED}): it can no longer meet its TTFT "
            f"objective {objective_s * 1e3:.0f} ms (waited {waited_s * 1e3:.0f} ms in the queue, predicted "
            f"prefill {service_s * 1e3:.0f} ms)")


class Dispatch:
    """A request let through: `placed` must be called once scheduling has picked (or failed to pick)."""

    __slots__ = ("_controller", "_done", "item", "band", "state", "endpoint", "finished", "evicted",
                 "request", "dispatched_seq")

    def __init__(self, controller: FlowController, item: QueuedRequest | None = None,
                 band: PriorityBand | None = None) -> None:
        self._controller = controller
        self._done = False
        self.item = item
        self.band = band
        self.state: CycleState | None = None
        self.endpoint: str | None = None
        self.finished = False
        # Resolved when flow control evicts the request (only sheddable requests under enableEviction get one).
        self.evicted: asyncio.Future[None] | None = None
        self.request: InferenceRequest | None = None
        self.dispatched_seq = 0

    def placed(self, endpoint: str | None) -> None:
        """Scheduling sent the request to `endpoint` (None: it failed and holds no room)."""
        if self._done:
            return
        self._done = True
        self._controller._placed(self, endpoint)


def eviction_signal(state: CycleState) -> asyncio.Future[None] | None:
    """The future that resolves when flow control evicts this request (None: it cannot be evicted)."""
    dispatch = state.get(DISPATCH_STATE_KEY)
    return dispatch.evicted if isinstance(dispatch, Dispatch) else None


class FlowController:
    """GIE-style flow control in front of the scheduler (one per picker process)."""

    def __init__(self, config: FlowControlConfig, detector: SaturationDetector, pool: EndpointPool,
                 ledger: InflightLedger, metrics: FlowControlMetrics | None = None, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.detector = detector
        self.pool = pool
        # The director books every placed request here; its `unseen_requests` are what the
        # metrics cannot show yet (also requests whose response the picker never sees).
        self.ledger = ledger
        self.metrics = metrics or FlowControlMetrics()
        self.clock = clock
        self._bands: dict[int, PriorityBand] = {}
        self._priorities: list[int] = []  # highest first
        self.queued_requests = 0
        self.queued_bytes = 0
        self._unplaced = 0  # let through, not yet placed by the scheduler
        self.closed = False  # shutting down: nothing is queued any more
        self._sequence = itertools.count()
        self._wake_scheduled = False
        self._in_cycle = False
        # Placed requests not finished yet, and those of them that may be evicted (a heap: lowest
        # priority, then newest dispatch first; finished ones are dropped lazily).
        self.inflight = 0
        self._evictable: list[tuple[int, int, Dispatch]] = []
        self._dispatch_seq = itertools.count()
        self._outstanding: dict[Dispatch, tuple[float, float]] = {}  # evicted, stream not ended: (issued, credit)
        self._cooling: list[tuple[float, float]] = []  # ended, room not visible yet: (until, credit)
        self._pending_reclaim = 0.0
        self.eviction_grace_s = (EVICTION_GRACE_COUNTING_S if isinstance(detector, ConcurrencyDetector)
                                 else EVICTION_GRACE_SCRAPED_S)

    # -- admission ------------------------------------------------------------------------------

    def wants_prediction(self, request: InferenceRequest) -> bool:
        """Whether `admit` would queue this request under an ordering that reads predictions."""
        band = self._band(request.priority)
        return band.ordering.uses_predictions and self._must_wait(band)

    def ttft_objective_s(self, request: InferenceRequest) -> float | None:
        """The request's TTFT objective in seconds: its header, else its band's SLO policy default."""
        if request.slo_ttft_ms is not None:
            return request.slo_ttft_ms / 1000.0
        ordering = self._band(request.priority).ordering
        return ordering.ttft_objective_s if isinstance(ordering, SLODeadlineOrderingPolicy) else None

    async def admit(self, request: InferenceRequest, size_bytes: int,
                    predicted: PredictedLatency | None = None, *, state: CycleState | None = None) -> Dispatch:
        """Wait for room; raise InferenceError 429 (over capacity, or shed) or 503 (TTL, or objective missed).

        `predicted`: the request's predicted latency (see `wants_prediction`). Cancel = leave the queue.
        `state`: the request's CycleState, where the Dispatch is kept for its completion and eviction.
        """
        band = self._band(request.priority)
        labels = (request.priority, request.fairness_id)
        if self.closed:
            self.metrics.finished(request.priority, "rejected", None)
            raise InferenceError(ErrorCode.SERVICE_UNAVAILABLE, SHUTDOWN_MESSAGE, drop_reason=DropReason.SHUTTING_DOWN)
        if not self._has_capacity(band, size_bytes):
            self.metrics.finished(request.priority, "rejected", None)
            raise InferenceError(ErrorCode.RESOURCE_EXHAUSTED, CAPACITY_MESSAGE, drop_reason=DropReason.SATURATED)
        objective = self.ttft_objective_s(request)
        shed = isinstance(band.ordering, SLODeadlineOrderingPolicy) and band.ordering.shed and objective is not None
        if (shed and predicted is not None and predicted.ttft_s is not None and predicted.ttft_s > objective
                and self._must_wait(band)):
            self.metrics.finished(request.priority, "shed", None)
            self.metrics.shed.labels(str(request.priority), "admission").inc()
            raise InferenceError(ErrorCode.RESOURCE_EXHAUSTED, shed_at_admission_message(predicted.ttft_s, objective),
                                 drop_reason=DropReason.SATURATED)
        now = self.clock()
        loop = asyncio.get_running_loop()
        item = QueuedRequest(request.request_id, request.fairness_id, request.priority, size_bytes, now,
                             next(self._sequence), deadline=now + self._deadline_s(request),
                             waiter=loop.create_future(),
                             service_s=predicted.service_s if predicted is not None else 0.0,
                             ttft_deadline=now + objective if objective is not None else math.inf)
        band.push(item)
        band.fairness.on_enqueue(item, now)
        self.queued_requests += 1
        self.queued_bytes += size_bytes
        self.metrics.queued(*labels, size_bytes, 1)
        ttl = self.config.ttl_for(request.priority)  # the band's own budget, else the global one
        timers = [loop.call_later(ttl, self._expire, band, item)] if ttl > 0 else []
        self._cycle()  # room now: dispatched before we wait
        if shed and not item.waiter.done():
            latest = item.ttft_deadline - item.service_s
            timers.append(loop.call_later(max(0.0, latest - now), self._objective_missed, band, item, objective))
        try:
            dispatch: Dispatch = await item.waiter
            dispatch.request = request
            if state is not None:
                dispatch.state = state
                state.put(DISPATCH_STATE_KEY, dispatch)
            return dispatch
        except asyncio.CancelledError:
            if item.waiter.done() and not item.waiter.cancelled() and item.waiter.exception() is None:
                item.waiter.result().placed(None)  # let through, but the client left before scheduling
            elif not item.removed:
                self._leave(band, item, "cancelled")
            raise
        finally:
            for timer in timers:
                timer.cancel()

    def _deadline_s(self, request: InferenceRequest) -> float:
        """Seconds this request may wait: its band's TTL, or Envoy's route deadline when that is sooner."""
        ttl = self.config.ttl_for(request.priority)
        budgets = [ttl] if ttl > 0 else []
        raw = request.headers.get(ENVOY_TIMEOUT_HEADER)
        if raw and raw.isdigit() and int(raw) > 0:
            budgets.append(int(raw) / 1000.0)
        return min(budgets) if budgets else math.inf

    def _has_capacity(self, band: PriorityBand, size_bytes: int) -> bool:
        cfg = self.config
        if cfg.max_requests and self.queued_requests + 1 > cfg.max_requests:
            return False
        if cfg.max_bytes and self.queued_bytes + size_bytes > cfg.max_bytes:
            return False
        return band.has_room(size_bytes)

    def _must_wait(self, band: PriorityBand) -> bool:
        """Whether a request arriving in `band` now would queue (a band at or above it holds requests, or no room)."""
        if any(self._bands[p].requests for p in self._priorities if p >= band.priority):
            return True
        saturation = self.saturation()
        return saturation >= self._ceilings(saturation).get(band.priority, 1.0)

    def _ceilings(self, saturation: float) -> dict[int, float]:
        """The usage-limit policy's ceiling of every priority known: configured bands and those seen."""
        priorities = sorted({*self._priorities, *(b.priority for b in self.config.bands)}, reverse=True)
        return self.config.usage_limit.ceilings(priorities, saturation)

    def _band(self, priority: int) -> PriorityBand:
        band = self._bands.get(priority)
        if band is None:
            # Priorities come from configured objectives (or 0), so bands stay few.
            cfg = self.config.band_for(priority)
            band = self._bands[priority] = PriorityBand(
                priority, max_requests=cfg.max_requests, max_bytes=cfg.max_bytes, ordering=cfg.ordering,
                fairness=cfg.fairness)
            self._priorities = sorted(self._bands, reverse=True)
        return band

    def _leave(self, band: PriorityBand, item: QueuedRequest, outcome: str) -> None:
        band.discard(item)
        band.fairness.on_leave(item, self.clock())
        self.queued_requests -= 1
        self.queued_bytes -= item.size_bytes
        self.metrics.queued(item.priority, item.fairness_id, item.size_bytes, -1)
        self.metrics.finished(item.priority, outcome, self.clock() - item.enqueued)

    def _expire(self, band: PriorityBand, item: QueuedRequest) -> None:
        if item.removed or item.waiter.done():
            return
        self._leave(band, item, "expired")
        item.waiter.set_exception(InferenceError(ErrorCode.SERVICE_UNAVAILABLE, TTL_MESSAGE,
                                                  drop_reason=DropReason.TTL_EXPIRED))

    def _objective_missed(self, band: PriorityBand, item: QueuedRequest, objective_s: float) -> None:
        """The request's latest start passed while it waited: it cannot meet its TTFT objective any more."""
        if item.removed or item.waiter.done():
            return
        waited = self.clock() - item.enqueued
        self._leave(band, item, "shed")
        self.metrics.shed.labels(str(item.priority), "queue").inc()
        item.waiter.set_exception(InferenceError(ErrorCode.SERVICE_UNAVAILABLE,
                                                 shed_in_queue_message(waited, item.service_s, objective_s),
                                                 drop_reason=DropReason.TTL_EXPIRED))

    # -- dispatch -------------------------------------------------------------------------------

    def wake(self) -> None:
        """Run a dispatch cycle soon (coalesced); safe to call from any event on the loop."""
        if self._wake_scheduled or not self.queued_requests:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # no loop (e.g. registry updated at start-up): the next request runs a cycle
        self._wake_scheduled = True
        loop.call_soon(self._woken)

    def _woken(self) -> None:
        self._wake_scheduled = False
        self._cycle()

    def on_request_complete(self, state: CycleState | None = None, response: ResponseInfo | None = None) -> None:
        """A dispatched request finished (its `state` names its Dispatch; `response`: its usage): a replica may have room."""
        dispatch = state.get(DISPATCH_STATE_KEY) if state is not None else None
        if isinstance(dispatch, Dispatch) and dispatch.endpoint is not None and not dispatch.finished:
            dispatch.finished = True
            self.inflight -= 1
            now = self.clock()
            if dispatch.item is not None and dispatch.band is not None:
                dispatch.band.fairness.on_complete(dispatch.item, self._usage(dispatch, response), now)
            issued = self._outstanding.pop(dispatch, None)
            if issued is not None:  # an evicted request's stream ended: its room shows after the grace
                self._cooling.append((now + self.eviction_grace_s, issued[1]))
                self.metrics.evictions.labels(str(dispatch.item.priority if dispatch.item else 0), "confirmed").inc()
                self._wake_later(self.eviction_grace_s)
        self.wake()

    def _usage(self, dispatch: Dispatch, response: ResponseInfo | None) -> ServiceUsage:
        """What the finished request cost: the server's usage, else the picker's estimates (prompt, prefix match)."""
        usage = response.usage if response is not None and isinstance(response.usage, dict) else {}
        prompt = _tokens(usage.get("prompt_tokens", usage.get("input_tokens")))
        completion = _tokens(usage.get("completion_tokens", usage.get("output_tokens"))) or 0
        details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details")
        cached = _tokens(details.get("cached_tokens")) if isinstance(details, dict) else None
        state, endpoint = dispatch.state, dispatch.endpoint
        if cached is None and state is not None and endpoint is not None:
            tier = state.endpoint_data(PREFIX_TIER_MATCH, endpoint)
            info = state.endpoint_data(PREFIX_MATCH_INFO, endpoint)
            if tier is not None:
                cached = tier.cached_tokens
                prompt = prompt if prompt is not None else tier.total_tokens
            elif info is not None:
                cached = int(info.matched_blocks * info.block_size_tokens)
        if prompt is None:
            prompt = estimate_prompt_tokens(dispatch.request) if dispatch.request is not None else 0
        return ServiceUsage(prompt, min(cached or 0, prompt), completion)

    def on_metrics_update(self, *_args: object) -> None:
        """An endpoint's metrics (or the set of endpoints) changed: the detector may see room."""
        self.wake()

    def _cycle(self) -> None:
        if self._in_cycle:
            return
        self._in_cycle = True
        try:
            while self.queued_requests:
                saturation = self.saturation()
                self.metrics.pool_saturation.set(saturation)
                band = next((self._bands[p] for p in self._priorities if self._bands[p].requests), None)
                if band is None:
                    return
                ceilings = self._ceilings(saturation)
                if saturation >= ceilings.get(band.priority, 1.0):
                    # Head-of-line blocking: nothing below this band may pass it.
                    if self.config.enable_eviction:
                        self._maybe_evict(saturation, ceilings)
                    return
                now = self.clock()
                flow = band.next_flow(now)
                if flow is None:
                    return
                item = band.pop(flow)
                band.fairness.on_dispatch(item, now)
                self.queued_requests -= 1
                self.queued_bytes -= item.size_bytes
                self.metrics.queued(item.priority, item.fairness_id, item.size_bytes, -1)
                self.metrics.finished(item.priority, "dispatched", now - item.enqueued)
                self._unplaced += 1
                item.waiter.set_result(Dispatch(self, item, band))
        finally:
            self._in_cycle = False

    def _placed(self, dispatch: Dispatch, endpoint: str | None) -> None:
        self._unplaced -= 1
        if endpoint is None:
            if dispatch.item is not None and dispatch.band is not None:
                dispatch.band.fairness.on_complete(dispatch.item, None, self.clock())
            self.wake()
            return
        dispatch.endpoint = endpoint
        self.inflight += 1
        item = dispatch.item
        if self.config.enable_eviction and item is not None and item.priority < 0:
            dispatch.evicted = asyncio.get_running_loop().create_future()
            dispatch.dispatched_seq = next(self._dispatch_seq)
            heapq.heappush(self._evictable, (item.priority, -dispatch.dispatched_seq, dispatch))
        # Lazy deletion keeps the heap cheap; compact when finished victims dominate so it stays bounded.
        if len(self._evictable) > 2 * self.inflight + 16:
            self._evictable = [e for e in self._evictable if not e[2].finished and not _is_evicted(e[2])]
            heapq.heapify(self._evictable)

    # -- eviction (enableEviction) ------------------------------------------------------------

    def _wake_later(self, delay_s: float) -> None:
        try:
            asyncio.get_running_loop().call_later(delay_s, self.wake)
        except RuntimeError:
            pass  # no loop: the next event runs a cycle

    def _victim(self) -> Dispatch | None:
        """The next request eviction would take (finished or already evicted ones are dropped)."""
        heap = self._evictable
        while heap and (heap[0][2].finished or _is_evicted(heap[0][2])):
            heapq.heappop(heap)
        return heap[0][2] if heap else None

    def _gate_open(self, now: float) -> bool:
        """Stop-and-wait pacing: no decision while an eviction is unconfirmed or its room is not visible yet."""
        for dispatch, (issued, credit) in list(self._outstanding.items()):
            if now - issued >= EVICTION_CONFIRMATION_TIMEOUT_S:
                del self._outstanding[dispatch]
                self._cooling.append((now + self.eviction_grace_s, credit))
                self.metrics.evictions.labels(str(dispatch.item.priority if dispatch.item else 0), "timed_out").inc()
        kept = []
        for until, credit in self._cooling:
            if until <= now:
                self._pending_reclaim = max(0.0, self._pending_reclaim - credit)
            else:
                kept.append((until, credit))
        self._cooling = kept
        return not self._outstanding and not self._cooling

    def _maybe_evict(self, saturation: float, ceilings: dict[int, float]) -> None:
        """A band is blocked: evict in-flight sheddable requests of lower priority if a blocked band waits."""
        now = self.clock()
        if not self._gate_open(now):
            return
        victim = self._victim()
        if victim is None or victim.item is None:
            return
        for priority in self._priorities:
            if priority <= victim.item.priority:
                return
            ceiling = ceilings.get(priority, 1.0)
            # A zero ceiling forbids the band whatever the load: no eviction can open it.
            if ceiling <= 0 or saturation < ceiling or not self._bands[priority].requests:
                continue
            self._evict(saturation, ceiling, priority, now)
            return

    def _evict(self, saturation: float, ceiling: float, demand_priority: int, now: float) -> None:
        evictable = sum(1 for _, _, d in self._evictable if not d.finished and not _is_evicted(d))
        if self.inflight <= 0 or evictable <= 0:
            return
        credit = saturation / self.inflight  # one request's share of the saturation
        if not (credit > 0 and math.isfinite(credit)):
            return
        target = saturation - ceiling - self._pending_reclaim
        if target < 0:
            return
        count = min(max(1, math.ceil(target / credit)), MAX_EVICTIONS_PER_DECISION, evictable)
        for _ in range(count):
            victim = self._victim()
            if victim is None or victim.item is None or victim.item.priority >= demand_priority:
                break
            heapq.heappop(self._evictable)
            self._outstanding[victim] = (now, credit)
            self._pending_reclaim += credit
            self.metrics.evictions.labels(str(victim.item.priority), "issued").inc()
            if victim.evicted is not None and not victim.evicted.done():
                victim.evicted.set_result(None)
            log.info("flow control evicted request %s (priority %d) for a blocked band of priority %d",
                     victim.item.request_id, victim.item.priority, demand_priority)
        self._wake_later(EVICTION_CONFIRMATION_TIMEOUT_S)

    def saturation(self) -> float:
        """The detector's rating of the pool, counting dispatches its metrics do not show yet."""
        endpoints = [ep for ep in self.pool.snapshot() if ep.healthy]
        if isinstance(self.detector, ConcurrencyDetector):
            return self.detector.saturation_with_pending(endpoints, self._unplaced)
        if not endpoints:
            return self.detector.saturation(endpoints)
        extra = [self.ledger.load(ep).unseen_requests for ep in endpoints]
        if self._unplaced:
            # Not placed yet: assume the scheduler sends each to the least-loaded endpoint.
            order = sorted(range(len(endpoints)), key=lambda i: endpoints[i].metrics.waiting_queue_size + extra[i])
            for n in range(self._unplaced):
                extra[order[n % len(order)]] += 1
        if any(extra):
            endpoints = [ep if not add else dataclasses.replace(
                ep, metrics=dataclasses.replace(ep.metrics, waiting_queue_size=ep.metrics.waiting_queue_size + add))
                for ep, add in zip(endpoints, extra, strict=True)]
        return self.detector.saturation(endpoints)

    def on_endpoints_changed(self, added: Sequence[Endpoint], removed: Sequence[Endpoint]) -> None:
        """The set of endpoints changed: run a cycle (new endpoints mean room)."""
        self.wake()

    def close(self) -> None:
        """The picker is shutting down: answer every queued request, and each new one, 503 at once.

        Their clients can go to another picker now instead of waiting out the drain and losing the
        stream at its end.
        """
        self.closed = True
        for band in self._bands.values():
            while (flow := band.next_flow(self.clock())) is not None:
                item = band.pop(flow)
                item.removed = True  # a cancellation racing this answer must not leave the queue twice
                self.queued_requests -= 1
                self.queued_bytes -= item.size_bytes
                self.metrics.queued(item.priority, item.fairness_id, item.size_bytes, -1)
                self.metrics.finished(item.priority, "rejected", self.clock() - item.enqueued)
                item.waiter.set_exception(InferenceError(ErrorCode.SERVICE_UNAVAILABLE, SHUTDOWN_MESSAGE,
                                                         drop_reason=DropReason.SHUTTING_DOWN))

    def debug_state(self) -> dict[str, object]:
        """Queue lengths and bounds per priority band, for `GET /debug/state` (no fairness ids: clients choose them)."""
        bands = [self._bands[p] for p in self._priorities]
        return {"queued_requests": self.queued_requests, "queued_bytes": self.queued_bytes,
                "dispatched_unplaced": self._unplaced, "inflight": self.inflight,
                "evictions_outstanding": len(self._outstanding), "max_requests": self.config.max_requests,
                "max_bytes": self.config.max_bytes,
                "bands": [{"priority": band.priority, "requests": band.requests, "bytes": band.bytes,
                           "flows": len(band.flows), "max_requests": band.max_requests, "max_bytes": band.max_bytes}
                          for band in bands]}


def _is_evicted(dispatch: Dispatch) -> bool:
    return dispatch.evicted is not None and dispatch.evicted.done()


def _tokens(value: object) -> int | None:
    """A token count from a usage object, or None when it is not one."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None
