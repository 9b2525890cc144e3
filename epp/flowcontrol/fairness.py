"""Fairness policies: which flow (fairness id) of a priority band is served next."""

from __future__ import annotations

from collections import OrderedDict
from typing import Protocol, TypeVar

from epp.flowcontrol.ordering import OrderingPolicy, QueuedRequest
from epp.framework.plugin import Plugin


class Flow(Protocol):
    """What a fairness policy sees of one flow's queue (queues.FlowQueue): its size and its next request."""

    requests: int

    def head(self) -> QueuedRequest | None: ...


FlowT = TypeVar("FlowT", bound=Flow)  # the band's own queue type, handed back


class FairnessPolicy(Plugin):
    """Chooses the next flow among the non-empty flows of a band (it may reorder `flows`)."""

    def pick(self, flows: OrderedDict[str, FlowT], ordering: OrderingPolicy) -> FlowT | None:
        raise NotImplementedError


class GlobalStrictFairnessPolicy(FairnessPolicy):
    """No fairness between flows: the band's best request by the ordering policy goes next."""

    type_name = "global-strict-fairness-policy"

    def pick(self, flows: OrderedDict[str, FlowT], ordering: OrderingPolicy) -> FlowT | None:
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
    """Flows take turns, one request each; a new flow joins at the end of the turn order."""

    type_name = "round-robin-fairness-policy"

    def pick(self, flows: OrderedDict[str, FlowT], ordering: OrderingPolicy) -> FlowT | None:
        for fairness_id, flow in flows.items():
            if flow.requests:
                flows.move_to_end(fairness_id)  # served: its next turn comes after every other flow's
                return flow
        return None


FAIRNESS_POLICIES: dict[str, type[FairnessPolicy]] = {
    cls.type_name: cls for cls in (GlobalStrictFairnessPolicy, RoundRobinFairnessPolicy)}
DEFAULT_FAIRNESS_POLICY = GlobalStrictFairnessPolicy.type_name
