"""The ext_proc transport every service of this project runs on: one gRPC stream per HTTP request.

`ExtProcTransport.Process` reads Envoy's messages (within the idle timeout until the request is
answered), limits the open streams and the request headers, hands each message to the stream's
handler by phase and writes its replies; an `InferenceError` becomes the immediate answer in the
API's error shape, any other failure a 500 (or, in a response phase, the response passed on
unchanged). The endpoint picker (`epp/server/extproc.py`) and the body-based router
(`epp/bbr/`) are two handlers of this one transport.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Protocol

import grpc
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf.message import DecodeError
from prometheus_client import Counter, Gauge

from epp.framework.errors import DropReason, ErrorCode, InferenceError
from epp.limits import Limits
from epp.logutil import Throttled, log_failure
from epp.server import messages

log = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
RESPONSE_PHASES = frozenset({"response_headers", "response_body", "response_trailers"})
SUBSET_HINT_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_HINT_KEY = "x-gateway-destination-endpoint-subset"


def header_map(headers: Any) -> dict[str, str]:
    """Envoy headers as a dict of lower-case names; Envoy sends values in `raw_value`."""
    out: dict[str, str] = {}
    for h in headers.headers:
        out[h.key.lower()] = h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value
    return out


def subset_hint_of(req: pb.ProcessingRequest) -> tuple[str, ...] | None:
    """The subset hint in the request metadata: a list, or one comma-separated string."""
    namespace = req.metadata_context.filter_metadata.get(SUBSET_HINT_NAMESPACE)
    if namespace is None or SUBSET_HINT_KEY not in namespace.fields:
        return None
    value = namespace.fields[SUBSET_HINT_KEY]
    kind = value.WhichOneof("kind")
    if kind == "list_value":
        return tuple(v.string_value for v in value.list_value.values if v.WhichOneof("kind") == "string_value")
    if kind == "string_value":
        return tuple(part.strip() for part in value.string_value.split(",") if part.strip())
    return ()


class TransportMetrics(Protocol):
    """The transport's own series (`epp_extproc_*`), in whichever registry the service keeps."""

    streams_active: Gauge
    stream_errors: Counter
    messages_by_phase: dict[str, Any]


class StreamHandler(Protocol):
    """What one stream's handler does with each phase of its HTTP request (and response)."""

    headers: dict[str, str]  # the request headers, lower-case names (empty before they came)
    request_id: str
    rejected: bool  # answered with an immediate response: Envoy answers the client itself
    subset_hint: tuple[str, ...] | None
    response_body_sent: bool  # whether Envoy sends the response body (its protocol_config says)

    @property
    def scheduled(self) -> bool:
        """The request has been answered (routed): no idle timeout from here on."""

    @property
    def ended(self) -> bool:
        """Envoy has nothing more to send: its close (EOF or reset) is no error."""

    def opened(self, context: grpc.aio.ServicerContext) -> None:
        """The stream's gRPC call began."""

    async def on_request_headers(self, msg: pb.HttpHeaders) -> list[pb.ProcessingResponse]:
        """The request headers."""

    async def on_request_body(self, msg: pb.HttpBody) -> list[pb.ProcessingResponse]:
        """A request body chunk."""

    async def on_request_trailers(self) -> list[pb.ProcessingResponse]:
        """The request trailers."""

    def on_response_headers(self, req: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        """The response headers."""

    def on_response_body(self, msg: pb.HttpBody) -> list[pb.ProcessingResponse]:
        """A response body chunk."""

    def on_response_trailers(self) -> list[pb.ProcessingResponse]:
        """The response trailers."""

    def pass_through(self, req: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        """The reply to a response message the handler failed on: the bytes unchanged."""

    def on_close(self) -> None:
        """Envoy closed the stream, or reset it once `ended`."""

    def on_refused(self, err: InferenceError, *, counted: bool) -> None:
        """The request is answered with `err` (`counted`: as a request error of the service)."""

    def on_stream_end(self) -> None:
        """The gRPC stream is over, however it ended (once)."""

    def interruption(self) -> tuple[asyncio.Future[None], InferenceError, str] | None:
        """How the service may end a routed request early: a signal, the answer then, its stream-error label."""


class _Interrupted(Exception):
    """The service ended a routed request early (flow control evicted it): answered with `error`."""

    def __init__(self, error: InferenceError, label: str) -> None:
        super().__init__(error.message)
        self.error = error
        self.label = label


class ExtProcTransport(pb_grpc.ExternalProcessorServicer):
    """`envoy.service.ext_proc.v3.ExternalProcessor`: the stream loop, limits and error answers."""

    def __init__(self, metrics: TransportMetrics, *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                 limits: Limits | None = None) -> None:
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes
        self.limits = limits or Limits()
        self.active_streams = 0
        self._throttled = Throttled(log)

    def new_stream(self) -> StreamHandler:
        """The handler of a new stream."""
        raise NotImplementedError

    def error_body(self, err: InferenceError, path: str | None) -> bytes | None:
        """The JSON body of an answer to `err` in the shape the path's API's clients read; None: OpenAI's."""
        return None

    def error_reply(self, err: InferenceError, path: str | None) -> pb.ProcessingResponse:
        """The immediate answer to `err` on a request to `path`."""
        return messages.error_response(err, self.error_body(err, path))

    def check_request_headers(self, headers: Any) -> None:
        """Raise 431 when request headers exceed the count or size limit."""
        entries = headers.headers
        limits = self.limits
        if len(entries) > limits.max_request_headers:
            raise InferenceError(ErrorCode.HEADERS_TOO_LARGE,
                                 f"more than {limits.max_request_headers} request headers")
        size = sum(len(h.key) + (len(h.raw_value) if h.raw_value else len(h.value)) for h in entries)
        if size > limits.max_request_header_bytes:
            raise InferenceError(ErrorCode.HEADERS_TOO_LARGE,
                                 f"request headers exceed {limits.max_request_header_bytes} bytes")

    async def _read(self, context: grpc.aio.ServicerContext, stream: StreamHandler) -> Any:
        """The next message; waits at most the idle timeout while the request is not answered yet."""
        if stream.scheduled:
            interruption = stream.interruption()
            if interruption is None:
                return await context.read()
            return await self._read_unless_interrupted(context, *interruption)
        async with asyncio.timeout(self.limits.stream_idle_timeout_s):
            return await context.read()

    @staticmethod
    async def _read_unless_interrupted(context: grpc.aio.ServicerContext, signal: asyncio.Future[None],
                                       error: InferenceError, label: str) -> Any:
        """The next message, or `_Interrupted` when the service ends the request first."""
        read = asyncio.ensure_future(context.read())
        try:
            await asyncio.wait((read, signal), return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            read.cancel()
            raise
        if read.done():
            return read.result()
        read.cancel()
        raise _Interrupted(error, label)

    async def Process(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> None:  # noqa: N802
        stream = self.new_stream()
        stream.opened(context)
        metrics = self.metrics
        metrics.streams_active.inc()
        self.active_streams += 1
        req: Any = None
        try:
            if self.active_streams > self.limits.max_concurrent_streams:
                await self._refuse(context, stream)
                return
            while True:
                req = await self._read(context, stream)
                if req is grpc.aio.EOF:
                    if stream.headers and not stream.ended:
                        # Closed mid-request or mid-response: the client (or the model server) went away.
                        metrics.stream_errors.labels("cancelled").inc()
                    stream.on_close()
                    break
                if stream.rejected:
                    continue  # Envoy answers the client itself after an immediate response
                try:
                    replies = await self._dispatch(stream, req)
                except InferenceError as err:
                    stream.rejected = True
                    stream.on_refused(err, counted=True)
                    replies = [self.error_reply(err, stream.headers.get(":path"))]
                except Exception as exc:
                    replies = self._on_failure(stream, req, exc)
                for reply in replies:
                    await context.write(reply)
        except _Interrupted as interrupted:
            # Flow control's eviction (llm-d: 429 with the reason header); Envoy resets the upstream request.
            metrics.stream_errors.labels(interrupted.label).inc()
            stream.on_refused(interrupted.error, counted=False)
            await context.write(self.error_reply(interrupted.error, stream.headers.get(":path")))
        except TimeoutError:
            metrics.stream_errors.labels("idle").inc()
            if not stream.rejected:
                err = InferenceError(ErrorCode.REQUEST_TIMEOUT,
                                     f"no request data for {self.limits.stream_idle_timeout_s:g} s")
                stream.on_refused(err, counted=False)
                await context.write(self.error_reply(err, stream.headers.get(":path")))
        except DecodeError:
            # A message that is not a ProcessingRequest: one log line (throttled), no traceback.
            metrics.stream_errors.labels("bad_message").inc()
            self._throttled.log(logging.WARNING, "bad_message",
                                "ext_proc stream sent a message that is not a ProcessingRequest: stream closed")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "malformed ProcessingRequest")
        except asyncio.CancelledError:
            # Envoy resets a stream it is done with as often as it half-closes it (its ext_proc
            # client closes, then resets): after the response's end that is the normal close.
            if stream.ended:
                stream.on_close()
            else:
                metrics.stream_errors.labels("cancelled").inc()
            raise
        finally:
            self.active_streams -= 1
            metrics.streams_active.dec()
            stream.on_stream_end()

    async def _refuse(self, context: grpc.aio.ServicerContext, stream: StreamHandler) -> None:
        """Answer a stream over the concurrency limit with 429 once its first message arrives."""
        self.metrics.stream_errors.labels("over_capacity").inc()
        first = await self._read(context, stream)
        if first is grpc.aio.EOF:
            return
        err = InferenceError(ErrorCode.RESOURCE_EXHAUSTED,
                             f"too many concurrent requests (limit {self.limits.max_concurrent_streams})",
                             drop_reason=DropReason.SATURATED)
        path = header_map(first.request_headers.headers).get(":path") if first.HasField("request_headers") else None
        await context.write(self.error_reply(err, path))

    def _on_failure(self, stream: StreamHandler, req: pb.ProcessingRequest,
                    exc: Exception) -> list[pb.ProcessingResponse]:
        """An unexpected error: a request gets 500; a response is passed through, never replaced."""
        kind = req.WhichOneof("request")
        if kind in RESPONSE_PHASES:
            log_failure(log, logging.ERROR, "response phase %s failed (request id %s); passed through",
                        exc, kind, stream.request_id)
            self.metrics.stream_errors.labels("response_internal").inc()
            return stream.pass_through(req)
        log_failure(log, logging.ERROR, "ext_proc stream failed (request id %s)", exc, stream.request_id)
        self.metrics.stream_errors.labels("internal").inc()
        stream.rejected = True
        err = InferenceError(ErrorCode.INTERNAL, "internal error while processing request")
        stream.on_refused(err, counted=False)
        return [self.error_reply(err, stream.headers.get(":path"))]

    async def _dispatch(self, stream: StreamHandler, req: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        kind = req.WhichOneof("request")
        counter = self.metrics.messages_by_phase.get(kind)
        if counter is not None:
            counter.inc()
        if kind == "request_headers" or kind == "request_body":
            hint = subset_hint_of(req) if req.HasField("metadata_context") else None
            if hint is not None:
                stream.subset_hint = hint
            if kind == "request_headers":
                if req.HasField("protocol_config"):
                    stream.response_body_sent = req.protocol_config.response_body_mode != ProcessingMode.NONE
                return await stream.on_request_headers(req.request_headers)
            return await stream.on_request_body(req.request_body)
        if kind == "response_headers":
            return stream.on_response_headers(req)
        if kind == "response_body":
            return stream.on_response_body(req.response_body)
        if kind == "request_trailers":
            return await stream.on_request_trailers()
        if kind == "response_trailers":
            return stream.on_response_trailers()
        return []
