"""sleep-wake-policy: wake a sleeping replica when a model needs one, put idle replicas to sleep.

**Wake on demand.** The director leaves sleeping replicas out of every request's candidates.
When a request's model has no awake replica, or every awake one is saturated (queue at least
`saturationQueueDepth`, or KV usage at least `saturationKVCacheUtilization`), the policy wakes
one sleeping replica of that model (`POST /wake_up`). At most one wake per model is in flight;
another one for the same model starts only `wakeCooldownSeconds` after the last one, so a burst
does not wake the whole pool. A request that found no awake replica is held until the wake is
done (at most `maxHoldSeconds`) and then scheduled onto the woken replica; a wake that fails, or
does not finish in time, answers 503. A request that found only saturated replicas is not held:
it is scheduled at once, and the woken replica takes the requests after it.

**Models sharing GPUs.** With `gpuLabel` set, endpoints whose label has the same value share a
GPU, and at most one of them is awake (the case sleep mode exists for: model A's and model B's
vLLM processes on one GPU). Waking a replica first puts its awake GPU mates to sleep, but only
idle ones (nothing in flight through the picker, nothing running or waiting in their metrics).

**Idle sleep.** With `idleSleepSeconds` > 0, a replica idle that long is put to sleep
(`POST /sleep?level=sleepLevel`), except the last awake replica of its model unless
`sleepLastReplica` is true.

A replica's model is its `modelLabel` label (endpoints without it form one group, model "").
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from epp.fleet.control import ControlError, ReplicaControl
from epp.framework import PluginParams
from epp.framework.errors import ConfigError, DropReason, ErrorCode, InferenceError
from epp.framework.plugin import (
    CapacityGate,
    CycleState,
    PluginContext,
    PreRequestHook,
    ResponseCompleteHook,
    SchedulingResult,
)
from epp.framework.types import Endpoint, InferenceRequest, ResponseInfo
from epp.requestcontrol.director import match_subset

log = logging.getLogger(__name__)

_RETRY_S = 0.05  # how often a held request looks again for a replica it may wake
_WAKE_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 15, 30, 60)


class WakeFailed(Exception):
    """A wake that did not bring a replica up; the message says why."""


def model_of(endpoint: Endpoint, label: str) -> str:
    """The model an endpoint serves, from its label ("" when unlabeled)."""
    return endpoint.labels.get(label, "")


class SleepWakePolicy(CapacityGate, PreRequestHook, ResponseCompleteHook):
    """Wakes a sleeping replica for a model with none awake (or all saturated); sleeps idle ones."""

    type_name = "sleep-wake-policy"

    def __init__(self, name: str, params: PluginParams, context: PluginContext) -> None:
        super().__init__(name)
        # None only where a config is checked, not served (`epp check-config`).
        self.registry = context.endpoints
        self.model_label = params.str("modelLabel", "model") or "model"
        self.gpu_label = params.str("gpuLabel", None)
        self.wake_on_demand = params.bool("wakeOnDemand", True)
        self.max_hold_s = params.float("maxHoldSeconds", 20.0, minimum=0.01)
        self.cooldown_s = params.float("wakeCooldownSeconds", 10.0, minimum=0.0)
        self.queue_threshold = params.int("saturationQueueDepth", 5, minimum=1)
        self.kv_threshold = params.float("saturationKVCacheUtilization", 0.8, minimum=0.0, maximum=1.0)
        self.idle_sleep_s = params.float("idleSleepSeconds", 0.0, minimum=0.0)
        self.idle_check_s = params.float("idleCheckSeconds", 1.0, minimum=0.01)
        self.sleep_level = params.int("sleepLevel", 1, minimum=0)
        if self.sleep_level > 2:
            raise ConfigError(f"plugin {name!r}: parameter 'sleepLevel' must be 0, 1 or 2, got {self.sleep_level}")
        self.sleep_last_replica = params.bool("sleepLastReplica", False)
        # A replica picked, finished or woken this recently is not idle: requests held for a wake
        # are dispatched to it just after, and scraped queues lag by a scrape or more.
        self.min_idle_s = params.float("minIdleSeconds", 2.0, minimum=0.0)
        self.control = ReplicaControl(self.registry, timeout=params.float("sleepTimeoutSeconds", 30.0, minimum=0.01))
        self._inflight: dict[str, int] = {}
        self._last_active: dict[str, float] = {}
        self._busy: set[str] = set()  # endpoints with a sleep or wake call in progress
        self._wakes: dict[str, asyncio.Task[Endpoint]] = {}
        self._last_wake: dict[str, float] = {}
        self._failed_at: dict[str, float] = {}
        self._idle_task: asyncio.Task[None] | None = None
        registry = context.metrics_registry or CollectorRegistry()
        self.actions = Counter("epp_sleep_wake_actions", "Sleep and wake calls made by the picker, by outcome.",
                               ["action", "outcome"], registry=registry)
        self.wake_duration = Histogram("epp_wake_duration_seconds",
                                       "From the wake decision to the replica answering /wake_up.",
                                       buckets=_WAKE_BUCKETS, registry=registry)
        self.held_gauge = Gauge("epp_wake_held_requests", "Requests held until a replica of their model wakes.",
                                ["model"], registry=registry)

    # -- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        if self.registry is None:
            raise RuntimeError(f"{self.name}: the plugin context has no endpoint registry")
        await self.control.start()
        if self.idle_sleep_s > 0:
            self._idle_task = asyncio.get_running_loop().create_task(self._idle_loop(), name=f"{self.name} idle")

    async def stop(self) -> None:
        tasks = [t for t in (self._idle_task, *self._wakes.values()) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._idle_task = None
        await self.control.stop()

    # -- what a replica is doing -----------------------------------------------------------------

    def serves(self, endpoint: Endpoint, model: str) -> bool:
        """Whether `endpoint` serves `model` (an unlabeled endpoint serves any model)."""
        label = endpoint.labels.get(self.model_label)
        return label is None or label == model

    def saturated(self, endpoint: Endpoint) -> bool:
        """Queue or KV cache at the configured threshold."""
        m = endpoint.metrics
        return m.waiting_queue_size >= self.queue_threshold or m.kv_cache_usage >= self.kv_threshold

    def working(self, endpoint: Endpoint) -> bool:
        """Requests in flight through the picker, running or waiting on it, or a call in progress."""
        m = endpoint.metrics
        return bool(self._inflight.get(endpoint.name) or m.running_requests_size or m.waiting_queue_size
                    or endpoint.name in self._busy)

    def idle(self, endpoint: Endpoint) -> bool:
        """Not working, and nothing picked, finished or woken there for `minIdleSeconds`."""
        quiet = time.monotonic() - self._last_active.get(endpoint.name, -math.inf) >= self.min_idle_s
        return quiet and not self.working(endpoint)

    def _awake_of(self, model_name: str) -> list[Endpoint]:
        return [ep for ep in self.registry.snapshot() if ep.healthy and not ep.metrics.sleeping
                and model_of(ep, self.model_label) == model_name]

    def _gpu_mates(self, endpoint: Endpoint) -> list[Endpoint]:
        if not self.gpu_label or self.gpu_label not in endpoint.labels:
            return []
        gpu = endpoint.labels[self.gpu_label]
        return [ep for ep in self.registry.snapshot() if ep.name != endpoint.name
                and ep.labels.get(self.gpu_label) == gpu and not ep.metrics.sleeping]

    def _may_sleep(self, endpoint: Endpoint, also_sleeping: Sequence[Endpoint] = ()) -> bool:
        """Idle, and not the last awake replica of its model (unless configured)."""
        if not self.idle(endpoint):
            return False
        if self.sleep_last_replica:
            return True
        model_name = model_of(endpoint, self.model_label)
        going = {ep.name for ep in also_sleeping} | {endpoint.name}
        return any(ep.name not in going for ep in self._awake_of(model_name))

    # -- wake on demand --------------------------------------------------------------------------

    async def ensure_capacity(self, state: CycleState, request: InferenceRequest,
                              candidates: Sequence[Endpoint]) -> Sequence[Endpoint]:
        """Candidates as they are, or held until a sleeping replica of the request's model wakes."""
        if not self.wake_on_demand:
            return candidates
        model_name = request.target_model
        awake = [ep for ep in candidates if self.serves(ep, model_name)]
        if awake and not all(self.saturated(ep) for ep in awake):
            return candidates
        sleeping = self._sleeping_of(model_name, request)
        if not sleeping:
            return candidates  # nothing to wake: scheduling decides (503 when nothing serves it)
        task = self._start_wake(model_name, request, first=not awake)
        if awake:
            return candidates  # saturated, not empty: serve now; the woken replica takes what follows
        # The gauge's label comes from the endpoints (operator-set), never from the client's body.
        label = model_of(sleeping[0], self.model_label)
        return [*candidates, await self._hold(model_name, label, request, task)]

    def _sleeping_of(self, model_name: str, request: InferenceRequest) -> list[Endpoint]:
        sleeping = [ep for ep in self.registry.snapshot() if ep.healthy and ep.metrics.sleeping
                    and ep.labels.get(self.model_label, model_name) == model_name]
        if request.subset_hint is not None:
            sleeping = match_subset(sleeping, request.subset_hint)
        return sleeping

    async def _hold(self, model_name: str, label: str, request: InferenceRequest,
                    task: asyncio.Task[Endpoint] | None) -> Endpoint:
        deadline = time.monotonic() + self.max_hold_s
        child = self.held_gauge.labels(label)
        child.inc()
        try:
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise InferenceError(ErrorCode.SERVICE_UNAVAILABLE,
                                         f"no replica of model {model_name!r} could be woken within "
                                         f"{self.max_hold_s:g}s", drop_reason=DropReason.NO_ENDPOINTS)
                if task is None:
                    # Every sleeping replica's GPU is still busy with another model: look again soon.
                    await asyncio.sleep(min(_RETRY_S, remaining))
                    task = self._start_wake(model_name, request, first=True)
                    continue
                try:
                    return await asyncio.wait_for(asyncio.shield(task), remaining)
                except TimeoutError:
                    raise InferenceError(ErrorCode.SERVICE_UNAVAILABLE,
                                         f"no replica of model {model_name!r} woke within {self.max_hold_s:g}s",
                                         drop_reason=DropReason.NO_ENDPOINTS) from None
                except WakeFailed as exc:
                    raise InferenceError(ErrorCode.SERVICE_UNAVAILABLE, f"waking a replica failed: {exc}",
                                         drop_reason=DropReason.NO_ENDPOINTS) from None
        finally:
            child.dec()

    def _start_wake(self, model_name: str, request: InferenceRequest, *, first: bool) -> asyncio.Task[Endpoint] | None:
        """The wake in flight for the model, or a new one (cooldown permitting); None if nothing can wake."""
        task = self._wakes.get(model_name)
        if task is not None and not task.done():
            return task
        now = time.monotonic()
        # The cooldown limits extra capacity; a model with nothing awake always gets its first wake.
        if not first and now - self._last_wake.get(model_name, -math.inf) < self.cooldown_s:
            return None
        choice = self._choose_wake_target(model_name, request, now)
        if choice is None:
            return None
        target, evict = choice
        self._last_wake[model_name] = now
        # The GPU mates chosen as idle stop taking requests now, in the same step as the choice:
        # a request routed to one before its /sleep call would wait on a sleeping engine, and the
        # idle loop must not count them as another model's awake replicas.
        for mate in evict:
            self.registry.expect_sleeping(mate.name, True, self.control.timeout)
        self._busy.update(m.name for m in evict)
        task = asyncio.get_running_loop().create_task(self._wake(target, evict), name=f"wake {target.name}")
        task.add_done_callback(_consume_result)
        self._wakes[model_name] = task
        return task

    def _choose_wake_target(self, model_name: str, request: InferenceRequest,
                            now: float) -> tuple[Endpoint, list[Endpoint]] | None:
        """A sleeping replica of the model to wake and the idle GPU mates to put to sleep first."""
        best: tuple[int, float, Endpoint, list[Endpoint]] | None = None
        for ep in self._sleeping_of(model_name, request):
            if ep.name in self._busy or now - self._failed_at.get(ep.name, -math.inf) < self.cooldown_s:
                continue
            mates = self._gpu_mates(ep)
            if not all(self._may_sleep(mate, mates) for mate in mates):
                continue
            # Prefer a free GPU, then the one whose mates have been idle longest.
            recent = max((self._last_active.get(m.name, 0.0) for m in mates), default=0.0)
            key = (len(mates), recent)
            if best is None or key < best[:2]:
                best = (len(mates), recent, ep, mates)
        return None if best is None else (best[2], best[3])

    async def _wake(self, target: Endpoint, evict: list[Endpoint]) -> Endpoint:
        started = time.monotonic()
        names = [target.name, *(m.name for m in evict)]
        self._busy.update(names)
        try:
            for i, mate in enumerate(evict):
                try:
                    await self.control.sleep(mate, self.sleep_level)
                    self.actions.labels("sleep", "ok").inc()
                except ControlError as exc:
                    self.actions.labels("sleep", "failed").inc()
                    for untouched in evict[i + 1:]:  # marked asleep at the choice, never sent /sleep
                        self.registry.expect_sleeping(untouched.name, False, 0.0)
                    raise WakeFailed(f"could not free the GPU of {target.name}: {exc}") from None
            try:
                await self.control.wake(target, timeout=self.max_hold_s)
            except ControlError as exc:
                self.actions.labels("wake", "failed").inc()
                self._failed_at[target.name] = time.monotonic()
                log.warning("waking %s failed: %s", target.name, exc)
                raise WakeFailed(str(exc)) from None
            self.actions.labels("wake", "ok").inc()
            self.wake_duration.observe(time.monotonic() - started)
            self._last_active[target.name] = time.monotonic()
            woken = self.registry.get(target.name)
            return woken if woken is not None else target
        finally:
            self._busy.difference_update(names)

    # -- in-flight accounting ----------------------------------------------------------------------

    def pre_request(self, state: CycleState, request: InferenceRequest, result: SchedulingResult) -> None:
        if result.targets:
            name = result.targets[0].name
            self._inflight[name] = self._inflight.get(name, 0) + 1
            self._last_active[name] = time.monotonic()

    def on_response_complete(self, state: CycleState, request: InferenceRequest, response: ResponseInfo,
                             target: Endpoint | None) -> None:
        if target is None:
            return
        left = self._inflight.get(target.name, 0) - 1
        if left > 0:
            self._inflight[target.name] = left
        else:
            self._inflight.pop(target.name, None)
        self._last_active[target.name] = time.monotonic()

    # -- idle sleep --------------------------------------------------------------------------------

    async def _idle_loop(self) -> None:
        while True:
            await asyncio.sleep(self.idle_check_s)
            try:
                await self.sleep_idle_replicas()
            except Exception:  # the loop must survive a bug in one round
                log.exception("idle-sleep round failed")

    async def sleep_idle_replicas(self, now: float | None = None) -> list[str]:
        """Put to sleep every replica idle for `idleSleepSeconds` that may sleep; returns their names."""
        now = time.monotonic() if now is None else now
        slept: list[str] = []
        known = set()
        for ep in self.registry.snapshot():
            known.add(ep.name)
            last = self._last_active.setdefault(ep.name, now)
            if not ep.healthy or ep.metrics.sleeping:
                continue
            if self.working(ep):
                self._last_active[ep.name] = now
                continue
            if now - last < self.idle_sleep_s or self._held_for(ep):
                continue
            current = self.registry.get(ep.name)
            if current is None or not self._may_sleep(current):
                continue
            self._busy.add(ep.name)
            try:
                await self.control.sleep(current, self.sleep_level)
                self.actions.labels("sleep", "ok").inc()
                slept.append(ep.name)
            except ControlError as exc:
                self.actions.labels("sleep", "failed").inc()
                log.warning("idle sleep of %s failed: %s", ep.name, exc)
                self._last_active[ep.name] = now  # try again after another idle period
            finally:
                self._busy.discard(ep.name)
        for name in list(self._last_active):
            if name not in known:
                del self._last_active[name]
        return slept

    def _held_for(self, endpoint: Endpoint) -> bool:
        """Whether a request of this replica's model is waiting for a wake (sleeping it would be perverse)."""
        model_name = model_of(endpoint, self.model_label)
        task = self._wakes.get(model_name)
        return task is not None and not task.done()


def _consume_result(task: asyncio.Task[Any]) -> None:
    """Read a finished wake's outcome so an unawaited failure is not reported as never retrieved."""
    if not task.cancelled():
        task.exception()
