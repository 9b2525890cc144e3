"""Fairness policies: which flow (fairness id) of a priority band is served next."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol, TypeVar

from epp.flowcontrol.ordering import OrderingPolicy, QueuedRequest
from epp.framework.plugin import Plugin


class Flow(Protocol):
    """What a fairness policy sees of one flow's queue (queues.FlowQueue): its size and its next request."""

    requests: int

    def head(self) -> QueuedRequest | None: ...


FlowT = TypeVar("FlowT", bound=Flow)  # the band's own queue type, handed back


@dataclass(frozen=True, slots=True)
class ServiceUsage:
    """What a finished request cost the pool, in tokens: prompt (of which cached) and output."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0


class FairnessPolicy(Plugin):
    """Chooses the next flow among the non-empty flows of a band (it may reorder `flows`).

    The controller also tells it what happens to each request (queued, dispatched, finished), for
    policies that keep per-flow state (`program-aware-fairness`); the default ignores it.
    """

    def pick(self, flows: OrderedDict[str, FlowT], ordering: OrderingPolicy, now: float = 0.0) -> FlowT | None:
        """The flow to serve next; `now` is the controller's clock (the requests' `enqueued` is on it)."""
        raise NotImplementedError

    def on_enqueue(self, item: QueuedRequest, now: float) -> None:
        """A request of flow `item.fairness_id` entered the band's queue."""

    def on_dispatch(self, item: QueuedRequest, now: float) -> None:
        """A request left the queue to be scheduled."""

    def on_leave(self, item: QueuedRequest, now: float) -> None:
        """A queued request left without being dispatched (expired, shed, cancelled)."""

    def on_complete(self, item: QueuedRequest, usage: ServiceUsage | None, now: float) -> None:
        """A dispatched request finished (`usage` None: it never reached a model server)."""


class GlobalStrictFairnessPolicy(FairnessPolicy):
    """No fairness between flows: the band's best request by the ordering policy goes next."""

    type_name = "global-strict-fairness-policy"

    def pick(self, flows: OrderedDict[str, FlowT], ordering: OrderingPolicy, now: float = 0.0) -> FlowT | None:
        best: FlowT | None = None
        best_key: tuple[float, ...] | None = None
        for flow in flows.values():
            head = flow.head()
            if head is None:
                continue
            key = (*ordering.key(head), head.sequence)
            if best_key is None or key < best_key:
                best, best_key = flow, key
        return best


class RoundRobinFairnessPolicy(FairnessPolicy):
    """Flows take turns, one request each; a new flow joins at the end of the turn order.

    llm-d's turn order is the flow ids sorted, resumed after the last one served; here it is the
    order in which flows became non-empty. Either way every waiting flow gets one dispatch per
    round, so none waits behind more than one request of each other flow.
    """

    type_name = "round-robin-fairness-policy"

    def pick(self, flows: OrderedDict[str, FlowT], ordering: OrderingPolicy, now: float = 0.0) -> FlowT | None:
        for fairness_id, flow in flows.items():
            if flow.requests:
                flows.move_to_end(fairness_id)  # served: its next turn comes after every other flow's
                return flow
        return None


FAIRNESS_POLICIES: dict[str, type[FairnessPolicy]] = {
    cls.type_name: cls for cls in (GlobalStrictFairnessPolicy, RoundRobinFairnessPolicy)}
DEFAULT_FAIRNESS_POLICY = GlobalStrictFairnessPolicy.type_name
