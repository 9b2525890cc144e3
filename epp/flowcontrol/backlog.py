"""`prefill-backlog-detector`: the pool is saturated when every endpoint has `maxBacklog` seconds of prefill ahead.

vLLM admits a new request into its running batch at once while it has sequence slots and KV
room, and works through the prefills in its batch in arrival order (chunked prefill), so its
waiting queue stays empty while its prefill work piles up: a queue-depth detector lets a whole
burst through and the replicas serve it first come, first served. This detector measures what a
new request waits for there: the prefill still to do of the requests the picker sent to each
endpoint (the in-flight ledger's backlog, at the prefill speed the ledger learned for that
endpoint) plus the scraped waiting queue at the mean request's prefill. With it the queue forms
in the picker, where `slo-deadline-ordering-policy` orders it and each request is placed when
it leaves (late binding).

Per endpoint: `backlog_s / maxBacklog`; the pool's saturation is the least of them (a pool is
saturated only when no endpoint has room) over the healthy endpoints; none healthy: 1.0.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

from epp.framework.errors import ConfigError
from epp.framework.load import Booking, InflightLedger
from epp.framework.params import PluginParams
from epp.framework.plugin import PluginContext, SaturationDetector
from epp.framework.types import Endpoint

# Uncached prompt tokens of a request before any completed one was seen (a scraped waiting request counts this).
PRIOR_REQUEST_TOKENS = 512.0
MEAN_TOKENS_EWMA_WEIGHT = 0.05


class PrefillBacklogDetector(SaturationDetector):
    """Saturation = least over endpoints of (prefill seconds ahead / maxBacklog)."""

    type_name = "prefill-backlog-detector"

    def __init__(self, name: str | None = None, params: PluginParams | None = None,
                 context: PluginContext | None = None, *, max_backlog_s: float = 0.5,
                 ledger: InflightLedger | None = None) -> None:
        super().__init__(name)
        if params is not None:
            max_backlog_s = params.duration("maxBacklog", max_backlog_s)
        if not (max_backlog_s > 0 and math.isfinite(max_backlog_s)):
            raise ConfigError(f"plugin {self.name!r}: parameter 'maxBacklog' must be a duration > 0, got {max_backlog_s}")
        self.max_backlog_s = float(max_backlog_s)
        self.ledger = ledger if ledger is not None else (context.load if context is not None else InflightLedger())
        self.mean_request_tokens = PRIOR_REQUEST_TOKENS
        self.ledger.add_observer(self._observe)

    def describe(self) -> str:
        return f"maxBacklog={self.max_backlog_s:g}s"

    def _observe(self, booking: Booking, response: Any) -> None:
        """Follow the mean uncached prompt tokens per request (what one scraped waiting request stands for)."""
        self.mean_request_tokens += MEAN_TOKENS_EWMA_WEIGHT * (booking.uncached_tokens - self.mean_request_tokens)

    def backlog_s(self, endpoint: Endpoint, now: float | None = None) -> float:
        """Predicted prefill seconds a request sent to `endpoint` now waits for."""
        load = self.ledger.load(endpoint, now)
        # max, not sum: once scraped, the picker's own requests show in both.
        tokens = max(load.prefill_backlog_tokens, endpoint.metrics.waiting_queue_size * self.mean_request_tokens)
        return tokens * self.ledger.prefill_seconds_per_token(endpoint.name)

    def saturation(self, endpoints: Sequence[Endpoint]) -> float:
        now = time.monotonic()
        return min((self.backlog_s(ep, now) / self.max_backlog_s for ep in endpoints if ep.healthy), default=1.0)
