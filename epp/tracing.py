"""OpenTelemetry spans for each request, off unless asked for (`epp serve --tracing` or `OTEL_TRACES_EXPORTER`).

One `RequestTrace` per ext_proc stream: a server span `epp.request` that continues the trace context
of the stream's gRPC metadata (a tracing Envoy's) or of the request headers (a client's `traceparent`),
with children for parsing, the flow-control wait, each plugin call the director and the scheduler time
(admitters, data producers, each profile's filters, scorers and picker, pre-request hooks) and the response.
The upstream request gets a `traceparent` naming the primary profile's picker span, so the model
server's spans join the same trace. Plugin spans are written after the call, from the timings the
plugin-latency metric already takes (start = end - duration): the hot path gains no context switching.

Off, every request gets `NO_TRACE`, whose methods do nothing and allocate nothing; the OpenTelemetry
packages (the `tracing` extra) are imported only when tracing is configured. The SDK reads its own
environment: `OTEL_SERVICE_NAME`/`OTEL_RESOURCE_ATTRIBUTES` (the resource), `OTEL_TRACES_SAMPLER`/`_ARG`
(the sampler), `OTEL_BSP_*` (the batch processor), `OTEL_EXPORTER_OTLP_*` (the OTLP exporter),
`OTEL_PROPAGATORS` (the propagation format); `OTEL_TRACES_EXPORTER` names the exporters by the names
their packages register (`otlp`, `console`, ...). No span holds prompt text.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from epp.framework.errors import ErrorCode
from epp.framework.plugin import CycleState, Plugin, ProfileRunResult
from epp.framework.scheduler import PluginTimer
from epp.framework.types import Endpoint, InferenceRequest, ResponseInfo

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Span

# Where a request's trace sits in its CycleState (the director finds it there).
TRACE_STATE_KEY = "epp.tracing/request-trace"

# The plugin calls that happen inside one scheduling profile (their spans are children of its span).
_PROFILE_POINTS = frozenset({"Filter", "Scorer", "Picker"})
# The profile handler's bookkeeping (which profiles run, which result is primary) gets no span of its
# own: what it decided shows in the profile spans and the request's `epp.profile`; spans cost CPU.
_UNTRACED_POINTS = frozenset({"ProfilePicker", "ProcessProfilesResults"})
# OTLP exporter entry-point names by `OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL`, as the SDK registers them.
_OTLP_BY_PROTOCOL = {"grpc": "otlp_proto_grpc", "http/protobuf": "otlp_proto_http"}
EXPORTER_ENTRY_POINTS = "opentelemetry_traces_exporter"
DEFAULT_SERVICE_NAME = "epp"


class TracingSetupError(ValueError):
    """The tracing environment names something this install cannot do; the message is the user's one line."""


def requested_by_environment(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the environment asks for traces: `OTEL_TRACES_EXPORTER` set to anything but `none`."""
    names = environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    return bool(names) and names != "none"


def disabled_by_environment(environ: Mapping[str, str] = os.environ) -> bool:
    """`OTEL_SDK_DISABLED=true`: the standard switch that turns the SDK off whatever else asks for it."""
    return environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true"


def exporter_names(environ: Mapping[str, str] = os.environ) -> list[str]:
    """The exporters' entry-point names `OTEL_TRACES_EXPORTER` asks for (unset: `otlp`, the spec's default)."""
    value = environ.get("OTEL_TRACES_EXPORTER", "").strip() or "otlp"
    names = [name.strip() for name in value.split(",") if name.strip() and name.strip().lower() != "none"]
    protocol = (environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
                or "").strip()
    if protocol and protocol not in _OTLP_BY_PROTOCOL:
        raise TracingSetupError(f"OTEL_EXPORTER_OTLP_PROTOCOL: {protocol!r} is not supported "
                                f"(one of {', '.join(_OTLP_BY_PROTOCOL)})")
    # `otlp` is the gRPC exporter unless the protocol says otherwise (the SDK's own reading).
    return [_OTLP_BY_PROTOCOL[protocol or "grpc"] if name == "otlp" else name for name in names]


def load_exporters(environ: Mapping[str, str] = os.environ) -> list[type[SpanExporter]]:
    """The span exporter classes `OTEL_TRACES_EXPORTER` names, from the packages' registered entry points."""
    from importlib.metadata import entry_points

    registered = {ep.name: ep for ep in entry_points(group=EXPORTER_ENTRY_POINTS)}
    classes = []
    for name in exporter_names(environ):
        if name not in registered:
            raise TracingSetupError(f"OTEL_TRACES_EXPORTER: no trace exporter named {name!r} is installed "
                                    f"(installed: {', '.join(sorted(registered)) or 'none'})")
        try:
            classes.append(registered[name].load())
        except ImportError as exc:
            raise TracingSetupError(f"OTEL_TRACES_EXPORTER: exporter {name!r} does not load ({exc})."
                                    f"{_clobbered_protos_hint()}") from None
    return classes


def _clobbered_protos_hint() -> str:
    """How to repair an install whose OTLP protos xds-protos overwrote, or "" when they are intact."""
    # xds-protos (Envoy's API, a core dependency) ships an older copy of opentelemetry/proto in the
    # same place as opentelemetry-proto; whichever pip installs last wins, and the OTLP exporters do
    # not load beside the older copy.
    from importlib import import_module
    from importlib.metadata import PackageNotFoundError, version

    try:
        trace_pb2 = import_module("opentelemetry.proto.trace.v1.trace_pb2")
    except ImportError:
        return ""
    if "scope_spans" in trace_pb2.ResourceSpans.DESCRIPTOR.fields_by_name:
        return ""
    try:
        pin = f"=={version('opentelemetry-proto')}"
    except PackageNotFoundError:
        pin = ""
    return (" xds-protos overwrote the opentelemetry-proto files; restore them with "
            f"`pip install --force-reinstall --no-deps opentelemetry-proto{pin}`")


def provider_from_environment() -> TracerProvider:
    """A tracer provider configured by the standard OTEL_* variables, exporting in batches."""
    from importlib.metadata import PackageNotFoundError, version

    from opentelemetry.sdk.resources import SERVICE_NAME, SERVICE_VERSION, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    try:
        attributes = {SERVICE_VERSION: version("llm-epp")}
    except PackageNotFoundError:
        attributes = {}
    resource = Resource.create(attributes)
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: DEFAULT_SERVICE_NAME}))
    exporters = load_exporters()
    provider = TracerProvider(resource=resource)  # the sampler: OTEL_TRACES_SAMPLER, read by the SDK
    for exporter in exporters:
        provider.add_span_processor(BatchSpanProcessor(exporter()))
    return provider


class RequestTracing:
    """The picker's tracer: a `RequestTrace` for each ext_proc stream, spans to `provider`'s exporters."""

    def __init__(self, provider: TracerProvider) -> None:
        from opentelemetry import propagate, trace

        self.provider = provider
        self.tracer = provider.get_tracer("epp")
        self._propagate = propagate
        self._trace = trace
        # The header names the propagation format reads (OTEL_PROPAGATORS; by default traceparent, tracestate, baggage).
        self._fields = frozenset(propagate.get_global_textmap().fields)

    @classmethod
    def from_environment(cls) -> RequestTracing:
        """Tracing as the OTEL_* environment configures it (raises TracingSetupError on what it cannot do)."""
        return cls(provider_from_environment())

    def start(self, headers: Mapping[str, str], state: CycleState,
              grpc_metadata: Sequence[tuple[str, Any]] = ()) -> RequestTrace | NoTrace:
        """The trace of one request, continuing the trace context of its ext_proc stream's gRPC metadata (a
        tracing Envoy's span of the ext_proc call), else of its HTTP headers; NO_TRACE when sampled out."""
        from opentelemetry.trace import SpanKind

        metadata = {key: value for key, value in grpc_metadata if isinstance(value, str)}
        parent = self._propagate.extract(metadata if self._fields & metadata.keys() else headers)
        path = headers.get(":path", "")
        root = self.tracer.start_span("epp.request", context=parent, kind=SpanKind.SERVER, attributes={
            "http.request.method": headers.get(":method", ""), "url.path": path.split("?", 1)[0],
            "epp.request_id": headers.get("x-request-id", "")})
        if not root.is_recording():
            # Not sampled: no spans, and the request's own traceparent goes upstream as it came.
            return NO_TRACE
        request_trace = RequestTrace(self, root, parent)
        state.put(TRACE_STATE_KEY, request_trace)
        return request_trace

    def shutdown(self) -> None:
        """Export what is pending and stop the exporters (blocking: call it from a thread)."""
        self.provider.shutdown()


class _Step:
    """A live child span of the request; an exception ends it in error, naming only the error's code or type."""

    __slots__ = ("span",)

    def __init__(self, span: Span) -> None:
        self.span = span

    def __enter__(self) -> Span:
        return self.span

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        if exc is not None:
            _set_error(self.span, exc)
        self.span.end()


def _set_error(span: Span, exc: BaseException) -> None:
    from opentelemetry.trace import Status, StatusCode

    code = getattr(exc, "code", None)
    if isinstance(code, ErrorCode):
        # An InferenceError's message is the client's answer (written to quote no prompt).
        span.set_attribute("error.type", code.label)
        span.set_status(Status(StatusCode.ERROR, getattr(exc, "message", code.label)))
    else:  # any other exception's message may quote request content: its type only
        span.set_attribute("error.type", type(exc).__name__)
        span.set_status(Status(StatusCode.ERROR, type(exc).__name__))


class RequestTrace:
    """The spans of one request; the transport, the director and the scheduler call it at their steps."""

    __slots__ = ("tracing", "root", "_incoming", "_root_context", "_timer", "_pending", "_pickers", "_response")

    def __init__(self, tracing: RequestTracing, root: Span, incoming: Any) -> None:
        self.tracing = tracing
        self.root = root
        # The incoming context (its baggage and tracestate go upstream too); children hang off the root.
        self._incoming = incoming
        self._root_context = tracing._trace.set_span_in_context(root, incoming)
        self._timer: PluginTimer | None = None
        # Plugin calls of the profile running now: its span is made when it ends (profile_done).
        self._pending: list[tuple[str, Plugin, int, int]] = []
        self._pickers: dict[str, Span] = {}
        self._response: Span | None = None

    def step(self, name: str) -> contextlib.AbstractContextManager[Any]:
        """A child span of the request around a step (`with trace.step("epp.parse"):`)."""
        return _Step(self.tracing.tracer.start_span(name, context=self._root_context))

    def parsed(self, request: InferenceRequest) -> None:
        """The request's model and API on the request span (never its prompt)."""
        root = self.root
        root.set_attribute("gen_ai.request.model", request.model)
        # The GenAI semantic conventions' operation name, for the APIs that have one (the parser knows).
        operation = request.format.operation(request) if request.format is not None else None
        if operation is not None:
            root.set_attribute("gen_ai.operation.name", operation)
        root.set_attribute("epp.api", request.api)
        if request.target_model != request.model:
            root.set_attribute("epp.target_model", request.target_model)
        root.set_attribute("epp.priority", request.priority)
        root.set_attribute("epp.stream", request.stream)

    def plugin_timer(self, metrics: PluginTimer) -> PluginTimer:
        """A plugin timer that records a span per plugin call, then passes the timing on to `metrics`."""
        self._timer = metrics
        return self._plugin_called

    def _plugin_called(self, point: str, plugin: Plugin, seconds: float) -> None:
        end = time.time_ns()
        start = end - int(seconds * 1e9)
        if point in _PROFILE_POINTS:
            self._pending.append((point, plugin, start, end))
        elif point not in _UNTRACED_POINTS:
            self._plugin_span(point, plugin, start, end, self._root_context, None)
        if self._timer is not None:
            self._timer(point, plugin, seconds)

    def _plugin_span(self, point: str, plugin: Plugin, start: int, end: int, context: Any,
                     attributes: dict[str, Any] | None) -> Span:
        # The name says the extension point and the plugin's name; the type is the one attribute all have.
        attrs = {"epp.plugin.type": plugin.type_name or type(plugin).__name__}
        if attributes:
            attrs.update(attributes)
        span = self.tracing.tracer.start_span(f"{point} {plugin.name}", context=context, start_time=start,
                                              attributes=attrs)
        span.end(end)
        return span

    def profile_done(self, name: str, result: ProfileRunResult | None) -> None:
        """A scheduling profile ran: its span, with its filters, scorers and picker (the pick as `epp.endpoint`)."""
        pending, self._pending = self._pending, []
        end = time.time_ns()
        tracer = self.tracing.tracer
        profile = tracer.start_span("epp.profile", context=self._root_context,
                                    start_time=pending[0][2] if pending else end, attributes={"epp.profile": name})
        chosen = result.targets if result is not None else ()
        if chosen:
            profile.set_attribute("epp.endpoint", chosen[0].hostport)
        context = self.tracing._trace.set_span_in_context(profile, self._incoming)
        for point, plugin, start, stop in pending:
            picked = {"epp.profile": name}
            if point == "Picker" and chosen:
                picked["epp.endpoint"] = chosen[0].hostport
                if len(chosen) > 1:
                    picked["epp.fallback_endpoints"] = [ep.hostport for ep in chosen[1:]]
            span = self._plugin_span(point, plugin, start, stop, context, picked)
            if point == "Picker":
                self._pickers[name] = span
        profile.end(end)

    def routed(self, targets: Sequence[Endpoint], profile: str | None = None) -> Sequence[tuple[str, str]]:
        """The request goes to `targets` (picked by `profile`): the trace headers for the upstream request.

        Their parent is the profile's picker span (the request span when no picker ran), so the model
        server's spans join this trace under the pick.
        """
        if targets:
            self.root.set_attribute("epp.endpoint", targets[0].hostport)
        if profile is not None:
            self.root.set_attribute("epp.profile", profile)
        parent = self._pickers.get(profile) if profile is not None else None
        context = self.tracing._trace.set_span_in_context(parent or self.root, self._incoming)
        carrier: dict[str, str] = {}
        self.tracing._propagate.inject(carrier, context=context)
        return list(carrier.items())

    def failed(self, code: ErrorCode, message: str) -> None:
        """The picker answered the request itself with an error (`message` is the client's answer)."""
        from opentelemetry.trace import Status, StatusCode

        self.root.set_attribute("error.type", code.label)
        self.root.set_attribute("http.response.status_code", code.http_status)
        self.root.set_status(Status(StatusCode.ERROR, message))

    def response_started(self, status: str) -> None:
        """The model server's response headers arrived: the response span starts."""
        if self._response is None:
            self._response = self.tracing.tracer.start_span("epp.response", context=self._root_context)
        if status.isdigit():
            self._response.set_attribute("http.response.status_code", int(status))

    def first_token(self) -> None:
        """The first generated output of a streamed response went by."""
        if self._response is not None:
            self._response.add_event("first_token")

    def end(self, response: ResponseInfo) -> None:
        """The stream closed: the response's status, usage and served endpoint; every open span ends."""
        from opentelemetry.trace import Status, StatusCode

        root = self.root
        if not root.is_recording():
            return  # ended already
        span = self._response
        if span is not None:
            if response.served_endpoint:
                span.set_attribute("epp.served_endpoint", response.served_endpoint)
            for key, names in (("gen_ai.usage.input_tokens", ("prompt_tokens", "input_tokens")),
                               ("gen_ai.usage.output_tokens", ("completion_tokens", "output_tokens"))):
                value = _token_count(response.usage, names)
                if value is not None:
                    span.set_attribute(key, value)
            span.end()
        if response.status.isdigit():
            status = int(response.status)
            root.set_attribute("http.response.status_code", status)
            if status >= 500:
                root.set_attribute("error.type", response.status)
                root.set_status(Status(StatusCode.ERROR, f"the model server answered {status}"))
        root.end()


def _token_count(usage: Mapping[str, Any] | None, names: Sequence[str]) -> int | None:
    if not usage:
        return None
    for name in names:
        value = usage.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
    return None


class NoTrace:
    """Tracing off (or the request not sampled): every step is free."""

    __slots__ = ()

    def step(self, name: str) -> contextlib.AbstractContextManager[Any]:
        return _NO_STEP

    def parsed(self, request: InferenceRequest) -> None:
        return None

    def plugin_timer(self, metrics: PluginTimer) -> PluginTimer:
        return metrics

    def profile_done(self, name: str, result: ProfileRunResult | None) -> None:
        return None

    def routed(self, targets: Sequence[Endpoint], profile: str | None = None) -> Sequence[tuple[str, str]]:
        return ()

    def failed(self, code: ErrorCode, message: str) -> None:
        return None

    def response_started(self, status: str) -> None:
        return None

    def first_token(self) -> None:
        return None

    def end(self, response: ResponseInfo) -> None:
        return None


NO_TRACE = NoTrace()
_NO_STEP = contextlib.nullcontext()


def of(state: CycleState) -> RequestTrace | NoTrace:
    """The trace of the request `state` belongs to (NO_TRACE when it is not traced)."""
    found: RequestTrace | None = state.get(TRACE_STATE_KEY)
    return NO_TRACE if found is None else found

