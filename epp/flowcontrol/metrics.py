"""Flow-control metrics: queue length and bytes per band and flow, wait time, outcomes.

Fairness ids come from a client header, so each is cut to `MAX_FAIRNESS_LABEL_CHARS` and only the
first `max_flow_labels` distinct ids get their own series; later ones share `OTHER_FLOWS`.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from epp.metrics import BoundedLabels

OTHER_FLOWS = "__other__"
MAX_FAIRNESS_LABEL_CHARS = 64
DEFAULT_MAX_FLOW_LABELS = 100
OUTCOMES = ("dispatched", "rejected", "expired", "cancelled", "shed")
# Queue waits range from nothing (room at once) to the TTL (tens of seconds).
_WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0)


class FlowControlMetrics:
    """The series the flow controller keeps, on the picker's registry."""

    def __init__(self, registry: CollectorRegistry | None = None, *,
                 max_flow_labels: int = DEFAULT_MAX_FLOW_LABELS) -> None:
        r = registry if registry is not None else CollectorRegistry()
        self._flow_labels = BoundedLabels(max_flow_labels, lambda fairness_id: fairness_id[:MAX_FAIRNESS_LABEL_CHARS])
        self.queue_size = Gauge(
            "inference_extension_flow_control_queue_size", "Requests waiting in the flow-control queues.",
            ["priority", "fairness_id"], registry=r)
        self.queue_bytes = Gauge(
            "inference_extension_flow_control_queue_bytes", "Body bytes of the requests waiting in the queues.",
            ["priority", "fairness_id"], registry=r)
        self.queue_duration = Histogram(
            "inference_extension_flow_control_request_queue_duration_seconds",
            "Time from enqueue to leaving the queue, by outcome.",
            ["priority", "outcome"], buckets=_WAIT_BUCKETS, registry=r)
        self.outcomes = Counter(
            "inference_extension_flow_control_requests",
            "Requests through flow control by outcome (dispatched, rejected, expired, cancelled, shed).",
            ["priority", "outcome"], registry=r)
        self.pool_saturation = Gauge(
            "inference_extension_flow_control_pool_saturation",
            "Pool saturation seen by the last dispatch cycle (>= the band's ceiling: nothing dispatched).",
            registry=r)
        self.shed = Counter(
            "epp_flow_control_slo_shed",
            "Requests answered at once because they could no longer meet their TTFT objective while the pool "
            "was saturated, by priority and where (admission: 429, queue: 503).", ["priority", "stage"], registry=r)
        self.evictions = Counter(
            "epp_flow_control_evictions",
            "In-flight sheddable requests evicted to make room for a blocked higher band (enableEviction), by the "
            "victim's priority and outcome (issued; confirmed: its stream ended; timed_out: no end seen in time).",
            ["priority", "outcome"], registry=r)
        self.longest_wait = Gauge(
            "epp_flow_control_longest_wait_seconds",
            "The longest time any request spent in the flow-control queue (any outcome) since the picker started.",
            registry=r)
        self._longest_wait = 0.0

    @property
    def max_flow_labels(self) -> int:
        """How many distinct fairness ids get their own series."""
        return self._flow_labels.limit

    @max_flow_labels.setter
    def max_flow_labels(self, limit: int) -> None:
        self._flow_labels.limit = limit

    def flow_label(self, fairness_id: str) -> str:
        """The label of a fairness id: itself (cut short) while the label budget lasts."""
        return self._flow_labels(fairness_id)

    def queued(self, priority: int, fairness_id: str, size_bytes: int, sign: int) -> None:
        """A request entered (`sign` 1) or left (`sign` -1) a flow queue."""
        labels = (str(priority), self.flow_label(fairness_id))
        self.queue_size.labels(*labels).inc(sign)
        self.queue_bytes.labels(*labels).inc(sign * size_bytes)

    def finished(self, priority: int, outcome: str, waited: float | None) -> None:
        """One request's flow-control outcome and, if it was queued, how long it waited."""
        self.outcomes.labels(str(priority), outcome).inc()
        if waited is not None:
            self.queue_duration.labels(str(priority), outcome).observe(waited)
            if waited > self._longest_wait:
                self._longest_wait = waited
                self.longest_wait.set(waited)
