"""The body-based router's ext_proc handler, on the project's one ext_proc transport.

Like the picker, it holds the request headers until the body has ended (Envoy sends the body
`FULL_DUPLEX_STREAMED`), then answers the headers with the model headers set and the route cache
cleared, and the body unchanged in `streamed_response` pieces. A request without a body, or whose
body names no model, goes on with the model headers removed (a client cannot choose the pool by
sending them itself). A body the picker would refuse is refused here with the picker's answer.
Response phases, should Envoy send them, pass through unchanged.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from prometheus_client import CollectorRegistry, Counter, Gauge

from epp.bbr.adapters import AdapterMap
from epp.bbr.model import error_body, request_model
from epp.framework.errors import ErrorCode, InferenceError
from epp.limits import Limits
from epp.server import messages
from epp.server.transport import DEFAULT_MAX_BODY_BYTES, ExtProcTransport, header_map

MODEL_HEADER = "x-gateway-model-name"
BASE_MODEL_HEADER = "x-gateway-base-model-name"
MODEL_HEADERS = (MODEL_HEADER, BASE_MODEL_HEADER)
REQUEST_ID_HEADER = "x-request-id"


class BbrMetrics:
    """The router's series: the transport's `epp_extproc_*` and its own `epp_bbr_*`."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or CollectorRegistry()
        self.streams_active = Gauge("epp_extproc_streams_active", "Open ext_proc streams.", registry=r)
        self.stream_errors = Counter("epp_extproc_stream_errors", "ext_proc streams ended by an unexpected error.",
                                     ["reason"], registry=r)
        messages_total = Counter("epp_extproc_messages", "ext_proc messages received, by phase.", ["phase"],
                                 registry=r)
        self.messages_by_phase = {phase: messages_total.labels(phase) for phase in (
            "request_headers", "request_body", "request_trailers", "response_headers", "response_body",
            "response_trailers")}
        self.requests = Counter(
            "epp_bbr_requests", "Requests by outcome: routed (model headers set), no_model (removed), refused.",
            ["outcome"], registry=r)
        self.refused = Counter("epp_bbr_refused_requests", "Requests the router answered itself, by error code.",
                               ["error_code"], registry=r)
        self.adapters = Gauge("epp_bbr_adapters", "Adapters in the adapter -> base model mapping in use.",
                              registry=r)
        self.reloads = Counter("epp_bbr_mapping_reloads", "Changes of the mapping files seen, by outcome (ok, error).",
                               ["outcome"], registry=r)


class _BbrStream:
    """One request through the router: headers held until the body ends, then the model headers."""

    __slots__ = ("service", "headers", "request_id", "rejected", "subset_hint", "response_body_sent",
                 "body_parts", "body_size", "answered")

    def __init__(self, service: BodyRouter) -> None:
        self.service = service
        self.headers: dict[str, str] = {}
        self.request_id = ""
        self.rejected = False
        self.subset_hint: tuple[str, ...] | None = None
        self.response_body_sent = True
        self.body_parts: list[bytes] = []
        self.body_size = 0
        self.answered = False

    @property
    def scheduled(self) -> bool:
        return self.answered

    @property
    def ended(self) -> bool:
        # Nothing of the response matters to the router: once the request is answered, a close is normal.
        return self.answered or self.rejected

    def opened(self, context: grpc.aio.ServicerContext) -> None:
        return None

    async def on_request_headers(self, msg: pb.HttpHeaders) -> list[pb.ProcessingResponse]:
        self.service.check_request_headers(msg.headers)
        self.headers = header_map(msg.headers)
        self.request_id = self.headers.get(REQUEST_ID_HEADER) or str(uuid.uuid4())
        if not msg.end_of_stream:
            return []  # held until the body has been read
        self.answered = True
        self.service.metrics.requests.labels("no_model").inc()
        return [messages.request_headers_response((), destination=None, remove=MODEL_HEADERS)]

    async def on_request_body(self, msg: pb.HttpBody) -> list[pb.ProcessingResponse]:
        if self.answered:
            return []
        if msg.body:
            self.body_size += len(msg.body)
            if self.body_size > self.service.max_body_bytes:
                self.body_parts.clear()
                raise InferenceError(ErrorCode.PAYLOAD_TOO_LARGE,
                                     f"request body exceeds the limit of {self.service.max_body_bytes} bytes")
            self.body_parts.append(msg.body)
        if not msg.end_of_stream:
            return []
        return self._route(end_of_stream=True)

    async def on_request_trailers(self) -> list[pb.ProcessingResponse]:
        replies = [] if self.answered else self._route(end_of_stream=False)
        replies.append(messages.request_trailers_response())
        return replies

    def _route(self, *, end_of_stream: bool) -> list[pb.ProcessingResponse]:
        body = b"".join(self.body_parts)
        self.body_parts = []
        model = request_model(self.headers, body)  # InferenceError: answered as the picker answers it
        self.answered = True
        if model:
            base = self.service.adapters().base_of(model)
            headers = [(MODEL_HEADER, model), (BASE_MODEL_HEADER, base)]
            replies = [messages.request_headers_response(headers, destination=None)]
            self.service.metrics.requests.labels("routed").inc()
        else:
            replies = [messages.request_headers_response((), destination=None, remove=MODEL_HEADERS)]
            self.service.metrics.requests.labels("no_model").inc()
        replies.extend(messages.request_body_response(piece, eos)
                       for piece, eos in messages.streamed_body_chunks(body, end_of_stream=end_of_stream))
        return replies

    def on_response_headers(self, req: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        return [messages.response_headers_response()]

    def on_response_body(self, msg: pb.HttpBody) -> list[pb.ProcessingResponse]:
        return [messages.response_body_response(msg.body, msg.end_of_stream)]

    def on_response_trailers(self) -> list[pb.ProcessingResponse]:
        return [messages.response_trailers_response()]

    def pass_through(self, req: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        kind = req.WhichOneof("request")
        if kind == "response_body":
            return self.on_response_body(req.response_body)
        if kind == "response_trailers":
            return self.on_response_trailers()
        return [messages.response_headers_response()]

    def on_close(self) -> None:
        return None

    def on_refused(self, err: InferenceError, *, counted: bool) -> None:
        self.service.metrics.requests.labels("refused").inc()
        self.service.metrics.refused.labels(err.code.label).inc()

    def on_stream_end(self) -> None:
        return None

    def interruption(self) -> None:
        return None  # a routed request is Envoy's from here: the router never ends it early


class BodyRouter(ExtProcTransport):
    """`ExternalProcessor` as the body-based router: the model headers for every request."""

    def __init__(self, adapters: Callable[[], AdapterMap], metrics: BbrMetrics, *,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, limits: Limits | None = None) -> None:
        super().__init__(metrics, max_body_bytes=max_body_bytes, limits=limits)
        self.metrics: BbrMetrics = metrics
        # The adapter mapping in use now (the watcher swaps it in; read once per request).
        self.adapters = adapters

    def error_body(self, err: InferenceError, path: str | None) -> bytes | None:
        """The picker's error shape for the path's API (its parser says: Anthropic's on `/v1/messages`...)."""
        return error_body(err, path)

    def new_stream(self) -> _BbrStream:
        """A router stream."""
        return _BbrStream(self)


__all__ = ["BASE_MODEL_HEADER", "MODEL_HEADER", "BbrMetrics", "BodyRouter"]
