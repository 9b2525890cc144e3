"""Ordering policies: the order in which the queued requests of one flow are dispatched."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from epp.framework.plugin import Plugin


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


class OrderingPolicy(Plugin):
    """Ranks the requests of one flow: the smallest `key` is dispatched first."""

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


ORDERING_POLICIES: dict[str, type[OrderingPolicy]] = {
    cls.type_name: cls for cls in (FCFSOrderingPolicy, EDFOrderingPolicy)}
DEFAULT_ORDERING_POLICY = FCFSOrderingPolicy.type_name
