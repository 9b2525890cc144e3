"""One request's course through the director, with its accounting (GIE request and token metrics).

The ext_proc transport opens a `RequestLifecycle` per stream, turns Envoy messages into calls on it and its results
into replies; counting requests, sizes, in-flight requests, durations, tokens and errors happens
here, on the director's side, so the transport holds no bookkeeping of its own.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from epp.framework.errors import ErrorCode
from epp.framework.headers import MODEL_REWRITE_HEADERS, header_value
from epp.framework.jsonbody import nesting_exceeds
from epp.framework.plugin import CycleState, SchedulingResult
from epp.framework.types import Endpoint, InferenceRequest, ResponseInfo
from epp.logutil import log_failure
from epp.metrics import EppMetrics
from epp.requestcontrol.director import Director

log = logging.getLogger(__name__)

# Token counts beyond this are not counts (and would overflow a float): they are not observed.
_MAX_TOKEN_COUNT = 2**53


def token_count(value: Any) -> int | None:
    """`value` as a token count, or None when it is not a plausible one (a bool, negative, huge)."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= _MAX_TOKEN_COUNT:
        return value
    return None


class _ModelSeries:
    """The label children of one `(model_name, target_model_name)` pair, looked up once."""

    __slots__ = ("labels", "requests", "sizes", "duration", "running", "input", "output", "cached")

    def __init__(self, metrics: EppMetrics, labels: tuple[str, str]) -> None:
        self.labels = labels
        self.requests: dict[int, Any] = {}  # by priority
        self.sizes = metrics.request_sizes.labels(*labels)
        self.duration = metrics.request_duration.labels(*labels)
        self.running = metrics.running_requests.labels(labels[0])
        self.input = metrics.input_tokens.labels(*labels)
        self.output = metrics.output_tokens.labels(*labels)
        self.cached = metrics.cached_tokens.labels(*labels)


class RequestAccounting:
    """The director's request metrics; label children are cached because they are touched per request.

    The cache holds one entry per label pair `EppMetrics.model_labels` hands out, and that set is
    capped (`max_model_labels` pairs, then `__other__`), so it needs no eviction of its own.
    """

    def __init__(self, metrics: EppMetrics) -> None:
        self.metrics = metrics
        self._series: dict[tuple[str, str], _ModelSeries] = {}

    def series(self, model: str, target_model: str) -> _ModelSeries:
        """The cached label children of a request's model pair (label values made safe and capped)."""
        labels = self.metrics.model_labels(model, target_model)
        series = self._series.get(labels)
        if series is None:
            series = self._series[labels] = _ModelSeries(self.metrics, labels)
        return series

    def received(self, series: _ModelSeries, priority: int, size_bytes: int) -> None:
        """A parsed request, before scheduling: counted by priority, its body size observed."""
        counter = series.requests.get(priority)
        if counter is None:
            counter = series.requests[priority] = self.metrics.requests.labels(*series.labels, str(priority))
        counter.inc()
        series.sizes.observe(size_bytes)

    def failed(self, labels: tuple[str, str], code: ErrorCode) -> None:
        """A request answered with an error instead of being routed."""
        self.metrics.request_errors.labels(*labels, code.label).inc()

    def usage(self, series: _ModelSeries, usage: dict[str, Any] | None) -> None:
        """Token counts the model server reported (OpenAI or Responses field names)."""
        if not usage:
            return
        prompt = token_count(usage.get("prompt_tokens", usage.get("input_tokens")))
        completion = token_count(usage.get("completion_tokens", usage.get("output_tokens")))
        if prompt is not None:
            series.input.observe(prompt)
        if completion is not None:
            series.output.observe(completion)
        details = usage.get("prompt_tokens_details") or usage.get("prompt_token_details") or {}
        cached = token_count(details.get("cached_tokens")) if isinstance(details, dict) else None
        if cached is not None:
            series.cached.observe(cached)


_NO_LABELS = ("", "")


class _NamedModel(msgspec.Struct):
    """A body's top-level `model`, every other field skipped unread."""

    model: Any = None


_read_named_model = msgspec.json.Decoder(_NamedModel).decode
# Deeper bodies are not read again for their model (the parser refused them for their depth).
_MAX_DEPTH_READ = 64


def model_named_in(body: bytes) -> str:
    """The top-level `model` string of a body the parser refused, "" when it names none or is not JSON.

    Every API format that names its model in the body names it there (OpenAI, Anthropic, vLLM,
    SGLang), so a request refused for another field still counts under its model.
    """
    if nesting_exceeds(body, _MAX_DEPTH_READ):
        return ""
    try:
        model = _read_named_model(body).model
    except (msgspec.DecodeError, UnicodeDecodeError):
        return ""
    return model if isinstance(model, str) else ""


class RequestLifecycle:
    """One request from its first message to the end of its response: director calls and accounting."""

    __slots__ = ("director", "accounting", "state", "request", "target", "response", "series", "started",
                 "scheduled", "finished", "first_token_seen")

    def __init__(self, director: Director, accounting: RequestAccounting) -> None:
        self.director = director
        self.accounting = accounting
        self.state = CycleState()
        self.request: InferenceRequest | None = None
        self.target: Endpoint | None = None
        self.response = ResponseInfo()
        self.series: _ModelSeries | None = None
        self.started = time.monotonic()
        self.scheduled = False
        self.finished = False
        self.first_token_seen = False

    @property
    def labels(self) -> tuple[str, str]:
        """The request's `(model_name, target_model_name)` labels; empty before it was parsed."""
        return self.series.labels if self.series is not None else _NO_LABELS

    @property
    def awaiting_first_token(self) -> bool:
        """Scheduled, and no first token (or whole response) seen yet."""
        return self.scheduled and not self.first_token_seen

    def route_without_body(self, subset_hint: Sequence[str] | None, pinned: str | None = None) -> Endpoint:
        """A request that ended with its headers goes to any eligible endpoint (GIE does the same), or to the
        one its path's state is held on (`pinned`: a stored response's `GET`)."""
        self.target = self.director.random_endpoint(subset_hint, pinned)
        self.scheduled = True
        return self.target

    async def schedule(self, request: InferenceRequest, size_bytes: int) -> SchedulingResult:
        """Count the request, then pick its endpoints (raises `InferenceError` when none may serve it)."""
        # The request as the session producers see it (its fairness id), for scheduling and every hook after.
        request = self.request = self.director.preprocess(self.state, request)
        series = self.series = self.accounting.series(request.model, request.target_model)
        self.accounting.received(series, request.priority, size_bytes)
        result = await self.director.schedule(self.state, request, size_bytes)
        self.target = result.targets[0]
        self.scheduled = True
        series.running.inc()
        return result

    def failed(self, code: ErrorCode) -> None:
        """The request was answered with an error."""
        self.accounting.failed(self.labels, code)

    def refused_unparsed(self, headers: Mapping[str, str], body: bytes) -> None:
        """The parser refused the request: its error counts under the model the body names, if it names one."""
        if self.series is not None or not body:
            return
        model = model_named_in(body)
        if model:
            self.series = self.accounting.series(model, header_value(headers, MODEL_REWRITE_HEADERS) or model)

    def response_headers(self, *, first_token_follows: bool = True) -> None:
        """`self.response` holds the response headers: run the hooks; prefill ends unless a first token will show."""
        request = self.request
        if request is None:
            return
        response = self.response
        self.director.response_headers(self.state, request, response, self.target)
        if not (first_token_follows and response.streaming and response.status == "200"):
            # A whole (or failed) response, or a body the picker is not shown: its prefill counts
            # as over (early, for a streamed one: the next scrape shows the replica's own queue),
            # but no first token was timed.
            self.first_token_seen = True
            self.director.first_token(self.state, observed=False)

    def first_token(self) -> None:
        """The first generated output of a streamed response went by."""
        self.first_token_seen = True
        self.director.first_token(self.state, request=self.request, target=self.target)

    def complete(self, *, aborted: bool = False) -> None:
        """Finish the request once: metrics and completion hooks (also when the stream died)."""
        if self.finished or not self.scheduled:
            return
        self.finished = True
        self.response.end_of_stream = True
        request, series = self.request, self.series
        if request is None or series is None:
            return
        series.running.dec()
        if not aborted:
            series.duration.observe(time.monotonic() - self.started)
        try:
            self.accounting.usage(series, self.response.usage)
        except Exception as exc:  # metrics of a finished request never fail the response
            log_failure(log, logging.ERROR, "token usage of request %s not recorded", exc, request.request_id)
        response = self.response
        if response.response_id is not None and request.format is not None and self.target is not None:
            # The model server stored this response: its API's format remembers where (Responses follow-ups).
            # Envoy names the endpoint that served it when that was not the first one picked.
            try:
                request.format.response_stored(request, response, response.served_endpoint or self.target.name)
            except Exception as exc:
                log_failure(log, logging.ERROR, "stored response of request %s not recorded", exc,
                            request.request_id)
        self.director.response_complete(self.state, request, response, self.target)
