"""Flow control: hold requests in the picker while the pool is saturated (GIE's `flowControl` layer).

- `config`: the `flowControl` section of the EndpointPickerConfig (field names and defaults of GIE).
- `ordering`: which request of a flow goes first (`fcfs-ordering-policy`, `edf-ordering-policy`,
  `slo-deadline-ordering-policy`: shortest predicted prefill first, TTFT objectives, bounded aging).
- `fairness`: which flow of a priority band goes next (`global-strict-`, `round-robin-fairness-policy`).
- `usage`: the saturation ceiling per priority (`static-usage-limit-policy`).
- `queues`: the bounded per-flow queues of one priority band.
- `controller`: admission, the event-driven dispatch cycle, TTL expiry, cancellation, SLO shedding.
- `backlog`: `prefill-backlog-detector`, saturation as the prefill seconds queued on each endpoint.
- `metrics`: queue sizes, bytes, wait times and outcomes with bounded labels.
"""
