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
whole queue through at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from epp.flowcontrol.config import FlowControlConfig
from epp.flowcontrol.metrics import FlowControlMetrics
from epp.flowcontrol.ordering import QueuedRequest, SLODeadlineOrderingPolicy
from epp.flowcontrol.queues import PriorityBand
from epp.framework.errors import DropReason, ErrorCode, InferenceError
from epp.framework.load import InflightLedger
from epp.framework.types import Endpoint, InferenceRequest

log = logging.getLogger(__name__)

CAPACITY_MESSAGE = "request rejected by flow control: queue capacity exceeded"
TTL_MESSAGE = "request timed out in queue"
SHUTDOWN_MESSAGE = "the endpoint picker is shutting down"
# Envoy's own deadline for the request (set from the route timeout): the EDF ordering uses it.
ENVOY_TIMEOUT_HEADER = "x-envoy-expected-rq-timeout-ms"


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

    __slots__ = ("_controller", "_done")

    def __init__(self, controller: FlowController) -> None:
        self._controller = controller
        self._done = False

    def placed(self, endpoint: str | None) -> None:
        """Scheduling sent the request to `endpoint` (None: it failed and holds no room)."""
        if self._done:
            return
        self._done = True
        self._controller._placed(endpoint)


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
                    predicted: PredictedLatency | None = None) -> Dispatch:
        """Wait for room; raise InferenceError 429 (over capacity, or shed) or 503 (TTL, or objective missed).

        `predicted`: the request's predicted latency (see `wants_prediction`). Cancel = leave the queue.
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
        self.queued_requests += 1
        self.queued_bytes += size_bytes
        self.metrics.queued(*labels, size_bytes, 1)
        ttl = self.config.default_request_ttl
        timers = [loop.call_later(ttl, self._expire, band, item)] if ttl > 0 else []
        self._cycle()  # room now: dispatched before we wait
        if shed and not item.waiter.done():
            latest = item.ttft_deadline - item.service_s
            timers.append(loop.call_later(max(0.0, latest - now), self._objective_missed, band, item, objective))
        try:
            return await item.waiter
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
        """Seconds this request may wait: the TTL, or Envoy's route deadline when that is sooner."""
        budgets = [self.config.default_request_ttl] if self.config.default_request_ttl > 0 else []
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
        return saturation >= self.config.usage_limit.ceiling(band.priority, saturation)

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

    def on_request_complete(self) -> None:
        """A dispatched request finished: a replica may have room."""
        self.wake()

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
                if saturation >= self.config.usage_limit.ceiling(band.priority, saturation):
                    return  # head-of-line blocking: nothing below this band may pass it
                flow = band.next_flow()
                if flow is None:
                    return
                item = band.pop(flow)
                self.queued_requests -= 1
                self.queued_bytes -= item.size_bytes
                self.metrics.queued(item.priority, item.fairness_id, item.size_bytes, -1)
                self.metrics.finished(item.priority, "dispatched", self.clock() - item.enqueued)
                self._unplaced += 1
                item.waiter.set_result(Dispatch(self))
        finally:
            self._in_cycle = False

    def _placed(self, endpoint: str | None) -> None:
        self._unplaced -= 1
        if endpoint is None:
            self.wake()

    def saturation(self) -> float:
        """The detector's rating of the pool, counting dispatches its metrics do not show yet."""
        endpoints = [ep for ep in self.pool.snapshot() if ep.healthy]
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
            while (flow := band.next_flow()) is not None:
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
                "dispatched_unplaced": self._unplaced, "max_requests": self.config.max_requests,
                "max_bytes": self.config.max_bytes,
                "bands": [{"priority": band.priority, "requests": band.requests, "bytes": band.bytes,
                           "flows": len(band.flows), "max_requests": band.max_requests, "max_bytes": band.max_bytes}
                          for band in bands]}
