"""The queues of one priority band: one queue per flow (fairness id), bounded by requests and bytes."""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING

from epp.flowcontrol.ordering import OrderingPolicy, QueuedRequest

if TYPE_CHECKING:
    from epp.flowcontrol.fairness import FairnessPolicy


class FlowQueue:
    """The waiting requests of one flow, ordered by the band's ordering policy."""

    __slots__ = ("fairness_id", "_key", "_heap", "requests", "bytes")

    def __init__(self, fairness_id: str, key: Callable[[QueuedRequest], tuple[float, ...]]) -> None:
        self.fairness_id = fairness_id
        self._key = key
        self._heap: list[tuple[tuple[float, ...], int, QueuedRequest]] = []
        self.requests = 0
        self.bytes = 0

    def push(self, item: QueuedRequest) -> None:
        heapq.heappush(self._heap, (self._key(item), item.sequence, item))
        self.requests += 1
        self.bytes += item.size_bytes

    def head(self) -> QueuedRequest | None:
        """The request this flow would dispatch next (removed entries are dropped lazily)."""
        heap = self._heap
        while heap and heap[0][2].removed:
            heapq.heappop(heap)
        return heap[0][2] if heap else None

    def pop(self) -> QueuedRequest:
        item = self.head()
        if item is None:
            raise IndexError("pop from an empty flow queue")
        heapq.heappop(self._heap)
        self.requests -= 1
        self.bytes -= item.size_bytes
        return item

    def discard(self, item: QueuedRequest) -> None:
        """Forget a request that left before dispatch (expired or cancelled)."""
        item.removed = True
        self.requests -= 1
        self.bytes -= item.size_bytes
        # Lazy deletion keeps removal O(1); compact when dead entries dominate so memory stays bounded.
        if len(self._heap) > 2 * self.requests + 16:
            self._heap = [entry for entry in self._heap if not entry[2].removed]
            heapq.heapify(self._heap)

    def __len__(self) -> int:
        return self.requests


class PriorityBand:
    """Every flow of one priority, with the band's limits and policies."""

    def __init__(self, priority: int, *, max_requests: int, max_bytes: int, ordering: OrderingPolicy,
                 fairness: FairnessPolicy) -> None:
        self.priority = priority
        self.max_requests = max_requests  # 0 = unlimited
        self.max_bytes = max_bytes  # 0 = unlimited
        self.ordering = ordering
        self.fairness = fairness
        self.flows: OrderedDict[str, FlowQueue] = OrderedDict()
        self.requests = 0
        self.bytes = 0

    def has_room(self, size_bytes: int) -> bool:
        """Whether one more request of `size_bytes` fits the band's limits."""
        if self.max_requests and self.requests + 1 > self.max_requests:
            return False
        return not (self.max_bytes and self.bytes + size_bytes > self.max_bytes)

    def push(self, item: QueuedRequest) -> FlowQueue:
        flow = self.flows.get(item.fairness_id)
        if flow is None:
            flow = self.flows[item.fairness_id] = FlowQueue(item.fairness_id, self.ordering.key)
        flow.push(item)
        self.requests += 1
        self.bytes += item.size_bytes
        return flow

    def next_flow(self, now: float = 0.0) -> FlowQueue | None:
        """The flow the fairness policy serves next (None when the band is empty); `now`: the controller's clock."""
        if not self.requests:
            return None
        return self.fairness.pick(self.flows, self.ordering, now)

    def pop(self, flow: FlowQueue) -> QueuedRequest:
        item = flow.pop()
        self._account(flow, item)
        return item

    def discard(self, item: QueuedRequest) -> None:
        flow = self.flows.get(item.fairness_id)
        if flow is None or item.removed:
            return
        flow.discard(item)
        self._account(flow, item)

    def _account(self, flow: FlowQueue, item: QueuedRequest) -> None:
        self.requests -= 1
        self.bytes -= item.size_bytes
        if not flow.requests:
            del self.flows[flow.fairness_id]  # flows live only while they hold requests

