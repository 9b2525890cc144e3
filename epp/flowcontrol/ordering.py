"""Ordering policies: the order in which the queued requests of one flow are dispatched.

`slo-deadline-ordering-policy` (llm-d's name) orders by predicted service time and by the
request's TTFT objective, with a bounded aging window:

    sjf(r)      = enqueued + min(serviceWeight x service_s, agingWindow)
    latest(r)   = ttft_deadline - service_s   (the last moment it can start and still meet its objective)
    key(r)      = min(sjf(r), latest(r))   if enqueued <= latest(r) <= sjf(r), else sjf(r)

`service_s` is the request's own predicted prefill (the cheapest endpoint's, from
`predicted-ttft-scorer`), so short prefills go first (shortest predicted processing first), and
a request whose objective would otherwise be missed moves up to its latest start. A request
already past its latest start (it cannot meet the objective anyway) keeps its `sjf` place.

Every key lies in [enqueued, enqueued + agingWindow]. So **no request is ever overtaken by one
that arrived more than `agingWindow` after it** (the aging bound): however long the stream of
short requests, a long one waits at most for what arrived before it plus `agingWindow`. The
hard bound on any wait in the queue stays `defaultRequestTTL` (then 503).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from epp.framework.errors import ConfigError
from epp.framework.params import PluginParams
from epp.framework.plugin import Plugin, PluginContext


@dataclass(eq=False, slots=True)
class QueuedRequest:
    """One request waiting in a flow queue (the body stays with its stream; only its size is counted)."""

    request_id: str
    fairness_id: str
    priority: int
    size_bytes: int
    enqueued: float  # monotonic seconds
    sequence: int  # arrival order, the final tie-breaker of every policy
    deadline: float = math.inf  # monotonic seconds; inf = no deadline known
    removed: bool = False
    waiter: Any = field(default=None, repr=False)  # the future the request's stream awaits
    service_s: float = 0.0  # predicted own prefill seconds (0 = unknown)
    ttft_deadline: float = math.inf  # enqueued + its TTFT objective; inf = no objective


class OrderingPolicy(Plugin):
    """Ranks the requests of one flow: the smallest `key` is dispatched first."""

    # Whether `key` reads `service_s` (the director then predicts it before queueing).
    uses_predictions: bool = False

    def key(self, item: QueuedRequest) -> tuple[float, ...]:
        raise NotImplementedError


class FCFSOrderingPolicy(OrderingPolicy):
    """First come, first served: by arrival in the picker."""

    type_name = "fcfs-ordering-policy"

    def key(self, item: QueuedRequest) -> tuple[float, ...]:
        return (item.enqueued, item.sequence)


class EDFOrderingPolicy(OrderingPolicy):
    """Earliest deadline first; requests without a deadline go after every request that has one."""

    type_name = "edf-ordering-policy"

    def key(self, item: QueuedRequest) -> tuple[float, ...]:
        return (item.deadline, item.enqueued, item.sequence)


class SLODeadlineOrderingPolicy(OrderingPolicy):
    """Shortest predicted prefill first, moved up to the latest start its TTFT objective allows, aging bounded.

    Parameters: `agingWindow` (default 5s; no request is overtaken by one that arrived more than
    this after it), `serviceWeight` (default 10: queue seconds charged per predicted second of
    prefill), `ttftObjective` (the TTFT objective of requests in this band that carry no
    `x-llm-d-slo-ttft-ms` header; default none), `shed` (default true: a request that can no
    longer meet its TTFT objective while the pool is saturated is answered at once, 429 at
    admission, 503 once its latest start passes in the queue, instead of waiting to miss it).
    """

    type_name = "slo-deadline-ordering-policy"
    uses_predictions = True

    def __init__(self, name: str | None = None, params: PluginParams | None = None,
                 context: PluginContext | None = None, *, aging_window_s: float = 5.0, service_weight: float = 10.0,
                 ttft_objective_s: float | None = None, shed: bool = True) -> None:
        super().__init__(name)
        if params is not None:
            aging_window_s = params.duration("agingWindow", aging_window_s)
            service_weight = params.float("serviceWeight", service_weight, minimum=0.0)
            objective = params.duration("ttftObjective", -1.0)
            ttft_objective_s = objective if objective >= 0 else ttft_objective_s
            shed = params.bool("shed", shed)
        if not (math.isfinite(aging_window_s) and aging_window_s >= 0):
            raise ConfigError(f"plugin {self.name!r}: parameter 'agingWindow' must be a finite duration >= 0")
        if ttft_objective_s is not None and ttft_objective_s <= 0:
            raise ConfigError(f"plugin {self.name!r}: parameter 'ttftObjective' must be > 0, got {ttft_objective_s}")
        self.aging_window_s = float(aging_window_s)
        self.service_weight = float(service_weight)
        self.ttft_objective_s = ttft_objective_s
        self.shed = shed

    def describe(self) -> str:
        objective = f"{self.ttft_objective_s:g}s" if self.ttft_objective_s else "from the header only"
        return (f"agingWindow={self.aging_window_s:g}s serviceWeight={self.service_weight:g} "
                f"ttftObjective={objective} shed={str(self.shed).lower()}")

    def key(self, item: QueuedRequest) -> tuple[float, ...]:
        sjf = item.enqueued + min(self.service_weight * item.service_s, self.aging_window_s)
        latest = item.ttft_deadline - item.service_s
        start = latest if item.enqueued <= latest < sjf else sjf
        return (start, item.enqueued, item.sequence)


ORDERING_POLICIES: dict[str, type[OrderingPolicy]] = {
    cls.type_name: cls for cls in (FCFSOrderingPolicy, EDFOrderingPolicy, SLODeadlineOrderingPolicy)}
DEFAULT_ORDERING_POLICY = FCFSOrderingPolicy.type_name
