"""The Envoy ext_proc service: one gRPC stream per HTTP request, driven as the GIE endpoint picker.

Request headers are held until the body ends; then the request is parsed and scheduled, and the
headers reply (destination endpoint) and the body (re-emitted as `streamed_response` pieces)
are sent back to back. Response headers, body and trailers are answered as they come: SSE is
streamed through piece by piece, JSON is buffered so the model name can be rewritten back.
When Envoy says (in the stream's `protocol_config`) that it sends no response body
(`epp envoy-config --responses headers`), the response headers end the request's prefill and
the stream's close ends the request.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any

import grpc
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf.message import DecodeError

from epp.debug.scores import ENDPOINT_SCORES_KEY, endpoint_scores_of
from epp.flowcontrol.controller import EVICTED_MESSAGE, eviction_signal
from epp.framework.errors import DropReason, ErrorCode, InferenceError
from epp.limits import Limits
from epp.logutil import Throttled, log_failure
from epp.metrics import EppMetrics
from epp.request.parsing import RequestParser
from epp.request.response import ResponseRewriter, UnreadableBody, only_anthropic_preamble, parse_usage
from epp.requestcontrol.director import Director
from epp.requestcontrol.lifecycle import RequestAccounting, RequestLifecycle
from epp.server import messages
from epp.tracing import NO_TRACE, NoTrace, RequestTrace, RequestTracing

log = logging.getLogger(__name__)

REQUEST_ID_HEADER = "x-request-id"
SUBSET_HINT_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_HINT_KEY = "x-gateway-destination-endpoint-subset"
SERVED_ENDPOINT_KEY = "x-gateway-destination-endpoint-served"
DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
RESPONSE_PHASES = frozenset({"response_headers", "response_body", "response_trailers"})


def _header_map(header_map: Any) -> dict[str, str]:
    """Envoy headers as a dict of lower-case names; Envoy sends values in `raw_value`."""
    out: dict[str, str] = {}
    for h in header_map.headers:
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


def served_endpoint_of(req: pb.ProcessingRequest) -> str | None:
    namespace = req.metadata_context.filter_metadata.get(messages.LB_METADATA_NAMESPACE)
    if namespace is None or SERVED_ENDPOINT_KEY not in namespace.fields:
        return None
    return namespace.fields[SERVED_ENDPOINT_KEY].string_value or None


def carries_token(chunk: bytes) -> bool:
    """Whether a streamed response chunk holds generated output, not only the role announcement.

    vLLM's first chat chunk carries `"role":"assistant","content":""`; it is sent with the first
    token, but a server may send it earlier, so the first token is timed from the next chunk.
    Anthropic streams open with `message_start` and `content_block_start` events: not output either.
    """
    if not chunk.strip() or only_anthropic_preamble(chunk):
        return False
    return not (b'"role"' in chunk and b'"content":""' in chunk and chunk.count(b"data:") <= 1)


class _Evicted(Exception):
    """Flow control evicted the stream's request (enableEviction): it is answered 429 and the stream ends."""


class _Stream:
    """Transport state of one ext_proc stream (one HTTP request and its response).

    What the director needs to know goes to the request's `RequestLifecycle`, which also does
    the request's accounting; this class only buffers bodies and builds the replies.
    """

    __slots__ = ("service", "life", "headers", "body_parts", "body_size", "subset_hint", "request_id",
                 "rewriter", "response_parts", "response_size", "passthrough", "rejected", "response_body_sent",
                 "trace", "grpc_metadata", "eviction")

    def __init__(self, service: ExtProcService) -> None:
        self.service = service
        self.life = RequestLifecycle(service.director, service.accounting)
        self.headers: dict[str, str] = {}
        self.body_parts: list[bytes] = []
        self.body_size = 0
        self.subset_hint: tuple[str, ...] | None = None
        self.request_id = ""
        self.rewriter: ResponseRewriter | None = None
        self.response_parts: list[bytes] = []
        self.response_size = 0
        self.passthrough = False
        self.rejected = False
        # Whether Envoy sends the response body (its first message says when it does not).
        self.response_body_sent = True
        self.trace: RequestTrace | NoTrace = NO_TRACE
        # The stream's gRPC metadata, kept when tracing: a tracing Envoy puts its own trace context there.
        self.grpc_metadata: tuple[tuple[str, Any], ...] = ()
        # Resolved if flow control evicts the request once it runs (sheddable requests under enableEviction).
        self.eviction: asyncio.Future[None] | None = None

    @property
    def scheduled(self) -> bool:
        return self.life.scheduled

    # -- request path -------------------------------------------------------------------------

    async def on_request_headers(self, msg: pb.HttpHeaders) -> list[pb.ProcessingResponse]:
        self.service.check_request_headers(msg.headers)
        self.headers = _header_map(msg.headers)
        self.request_id = self.headers.get(REQUEST_ID_HEADER) or str(uuid.uuid4())
        if self.service.tracing is not None:
            self.trace = self.service.tracing.start(self.headers, self.life.state, self.grpc_metadata)
        if not msg.end_of_stream:
            return []  # held until the body has been scheduled
        target = self.life.route_without_body(self.subset_hint)
        return [messages.request_headers_response(
            [(messages.DESTINATION_ENDPOINT_HEADER, target.hostport), (REQUEST_ID_HEADER, self.request_id),
             *self.trace.routed((target,))],
            destination=target.hostport)]

    async def on_request_body(self, msg: pb.HttpBody) -> list[pb.ProcessingResponse]:
        if self.life.scheduled:
            return []  # a body after a header-only reply cannot happen; ignore defensively
        if msg.body:
            self.body_size += len(msg.body)
            if self.body_size > self.service.max_body_bytes:
                self.body_parts.clear()
                raise InferenceError(
                    ErrorCode.PAYLOAD_TOO_LARGE,
                    f"request body exceeds the limit of {self.service.max_body_bytes} bytes")
            self.body_parts.append(msg.body)
        if not msg.end_of_stream:
            return []
        return await self._schedule(end_of_stream=True)

    async def on_request_trailers(self) -> list[pb.ProcessingResponse]:
        # Trailers end a request whose last body message did not carry end_of_stream.
        replies = [] if self.life.scheduled else await self._schedule(end_of_stream=False)
        replies.append(messages.request_trailers_response())
        return replies

    async def _schedule(self, *, end_of_stream: bool) -> list[pb.ProcessingResponse]:
        body = b"".join(self.body_parts)
        self.body_parts = []
        trace = self.trace
        with trace.step("epp.parse"):
            request, forwarded = self.service.parser.parse(
                request_id=self.request_id, headers=self.headers, body=body, subset_hint=self.subset_hint)
        trace.parsed(request)
        life = self.life
        result = await life.schedule(request, len(body))
        self.eviction = eviction_signal(life.state)
        targets = result.targets
        destination = ",".join(ep.hostport for ep in targets)
        set_headers = [(messages.DESTINATION_ENDPOINT_HEADER, destination), (REQUEST_ID_HEADER, self.request_id),
                       *trace.routed(targets, result.primary_profile)]
        if forwarded:
            set_headers.append(("Content-Length", str(len(forwarded))))
        # Headers the pre-request hooks set (the prefiller's ip:port, say); routing headers stay ours.
        set_headers.extend((k, v) for k, v in life.state.request_headers().items()
                           if k not in (messages.DESTINATION_ENDPOINT_HEADER, REQUEST_ID_HEADER))
        replies = [messages.request_headers_response(set_headers, destination=destination)]
        if self.service.emit_endpoint_scores and (scores := endpoint_scores_of(life.state)) is not None:
            messages.set_lb_metadata(replies[0], ENDPOINT_SCORES_KEY, scores)
        replies.extend(messages.request_body_response(piece, eos)
                       for piece, eos in messages.streamed_body_chunks(forwarded, end_of_stream=end_of_stream))
        self.rewriter = ResponseRewriter(request.model, request.target_model)
        return replies

    # -- response path ------------------------------------------------------------------------

    def on_response_headers(self, req: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        msg = req.response_headers
        headers = _header_map(msg.headers)
        life = self.life
        response = life.response
        response.headers = headers
        response.status = headers.get(":status", "")
        response.served_endpoint = served_endpoint_of(req)
        response.streaming = "text/event-stream" in headers.get("content-type", "") or bool(
            life.request and life.request.stream)
        body_sent = self.response_body_sent
        self.trace.response_started(response.status)
        life.response_headers(first_token_follows=body_sent)
        # The body is rewritten (its length may change) only when the picker is shown it.
        remove = ["content-length"] if body_sent and self.rewriter is not None and self.rewriter.active else []
        replies = [messages.response_headers_response(response.set_headers.items(), remove)]
        if msg.end_of_stream:
            life.complete()
        return replies

    def on_response_body(self, msg: pb.HttpBody) -> list[pb.ProcessingResponse]:
        chunk = msg.body
        life = self.life
        response = life.response
        if response.streaming or self.passthrough:
            if life.awaiting_first_token and carries_token(chunk):
                life.first_token()
                self.trace.first_token()
            if self.rewriter is not None:
                chunk = self.rewriter.rewrite(chunk)
            if response.streaming and response.usage is None and b"usage" in chunk:
                response.usage = self._usage_of(chunk, sse=True)
            replies = [messages.response_body_response(chunk, msg.end_of_stream)]
        # Held parts are dropped only once their reply is built: `pass_through` re-sends them on a failure.
        elif self.response_size + len(chunk) > self.service.max_body_bytes:
            # Too big to buffer: send what we hold and stream the rest through unmodified.
            self.passthrough = True
            held = b"".join(self.response_parts) + chunk
            replies = [messages.response_body_response(piece, eos) for piece, eos in
                       messages.streamed_body_chunks(held, end_of_stream=msg.end_of_stream)]
            self.response_parts = []
        elif not msg.end_of_stream:
            self.response_parts.append(chunk)
            self.response_size += len(chunk)
            return []
        else:
            body = b"".join(self.response_parts) + chunk
            if self.rewriter is not None:
                body = self.rewriter.rewrite(body)
            response.usage = self._usage_of(body, sse=False)
            replies = [messages.response_body_response(piece, eos)
                       for piece, eos in messages.streamed_body_chunks(body)]
            self.response_parts = []
        if msg.end_of_stream:
            life.complete()
        return replies

    def on_response_trailers(self) -> list[pb.ProcessingResponse]:
        self.life.complete()
        return [messages.response_trailers_response()]

    def on_close(self) -> None:
        """Envoy closed the stream: without a response body, that is how a response ends."""
        if not self.response_body_sent and self.life.response.status:
            self.life.complete()

    def _usage_of(self, body: bytes, *, sse: bool) -> dict[str, Any] | None:
        """Token usage of a response body; a body the picker cannot read is counted and passed on."""
        try:
            return parse_usage(body, sse=sse)
        except UnreadableBody:
            self.service.unreadable_response("too_deep")
            return None

    def pass_through(self, req: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        """The reply to a response message the picker failed on: the model server's bytes, unchanged."""
        kind = req.WhichOneof("request")
        if kind == "response_headers":
            return [messages.response_headers_response()]
        if kind == "response_trailers":
            return [messages.response_trailers_response()]
        msg = req.response_body
        held, self.response_parts = b"".join(self.response_parts) + msg.body, []
        self.passthrough = True
        return [messages.response_body_response(piece, eos)
                for piece, eos in messages.streamed_body_chunks(held, end_of_stream=msg.end_of_stream)]


class ExtProcService(pb_grpc.ExternalProcessorServicer):
    """`envoy.service.ext_proc.v3.ExternalProcessor` implemented as the GIE endpoint picker."""

    def __init__(self, director: Director, parser: RequestParser, metrics: EppMetrics, *,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, limits: Limits | None = None,
                 emit_endpoint_scores: bool = False, tracing: RequestTracing | None = None) -> None:
        self.director = director
        # The pick's scores in the headers reply's `envoy.lb` metadata (the scheduler records them).
        self.emit_endpoint_scores = emit_endpoint_scores
        # None: tracing is off, and every stream's trace is NO_TRACE (nothing is done per request).
        self.tracing = tracing
        # Request and token metrics of every stream; label children cached across requests.
        self.accounting = RequestAccounting(metrics)
        self.parser = parser
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes
        self.limits = limits or Limits()
        self.active_streams = 0
        self._throttled = Throttled(log)
        self._unreadable_logged = False

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

    def unreadable_response(self, reason: str) -> None:
        """Count a response body passed on unread; the first one is logged (the counter has the rest)."""
        self.metrics.unreadable_responses.labels(reason).inc()
        if not self._unreadable_logged:
            self._unreadable_logged = True
            log.warning("a model server's response could not be read (%s) and was passed through unchanged; "
                        "epp_extproc_unreadable_responses_total counts every such response (logged once)", reason)

    async def _read(self, context: grpc.aio.ServicerContext, stream: _Stream) -> Any:
        """The next message; waits at most the idle timeout while the request is not answered yet."""
        if stream.scheduled:
            if stream.eviction is None or stream.life.finished:
                return await context.read()
            return await self._read_unless_evicted(context, stream.eviction)
        async with asyncio.timeout(self.limits.stream_idle_timeout_s):
            return await context.read()

    @staticmethod
    async def _read_unless_evicted(context: grpc.aio.ServicerContext, evicted: asyncio.Future[None]) -> Any:
        """The next message, or `_Evicted` when flow control evicts the request first."""
        read = asyncio.ensure_future(context.read())
        try:
            await asyncio.wait((read, evicted), return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            read.cancel()
            raise
        if read.done():
            return read.result()
        read.cancel()
        raise _Evicted

    async def Process(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> None:  # noqa: N802
        stream = _Stream(self)
        if self.tracing is not None:
            stream.grpc_metadata = tuple(context.invocation_metadata() or ())
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
                    stream.on_close()
                    break
                if stream.rejected:
                    continue  # Envoy answers the client itself after an immediate response
                try:
                    replies = await self._dispatch(stream, req)
                except InferenceError as err:
                    stream.rejected = True
                    stream.life.failed(err.code)
                    stream.trace.failed(err.code, err.message)
                    replies = [messages.error_response(err, stream.headers.get(":path"))]
                except Exception as exc:
                    replies = self._on_failure(stream, req, exc)
                for reply in replies:
                    await context.write(reply)
        except _Evicted:
            # llm-d's answer: 429 with the reason header; Envoy resets the upstream request, which frees its KV.
            metrics.stream_errors.labels("evicted").inc()
            err = InferenceError(ErrorCode.RESOURCE_EXHAUSTED, EVICTED_MESSAGE, drop_reason=DropReason.EVICTED)
            stream.trace.failed(err.code, err.message)
            await context.write(messages.error_response(err, stream.headers.get(":path")))
        except TimeoutError:
            metrics.stream_errors.labels("idle").inc()
            if not stream.rejected:
                err = InferenceError(ErrorCode.REQUEST_TIMEOUT,
                                     f"no request data for {self.limits.stream_idle_timeout_s:g} s")
                stream.trace.failed(err.code, err.message)
                await context.write(messages.error_response(err, stream.headers.get(":path")))
        except DecodeError:
            # A message that is not a ProcessingRequest: one log line (throttled), no traceback.
            metrics.stream_errors.labels("bad_message").inc()
            self._throttled.log(logging.WARNING, "bad_message",
                                "ext_proc stream sent a message that is not a ProcessingRequest: stream closed")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "malformed ProcessingRequest")
        except asyncio.CancelledError:
            metrics.stream_errors.labels("cancelled").inc()
            raise
        finally:
            self.active_streams -= 1
            metrics.streams_active.dec()
            stream.life.complete(aborted=True)
            stream.trace.end(stream.life.response)

    async def _refuse(self, context: grpc.aio.ServicerContext, stream: _Stream) -> None:
        """Answer a stream over the concurrency limit with 429 once its first message arrives."""
        self.metrics.stream_errors.labels("over_capacity").inc()
        first = await self._read(context, stream)
        if first is grpc.aio.EOF:
            return
        err = InferenceError(ErrorCode.RESOURCE_EXHAUSTED,
                             f"too many concurrent requests (limit {self.limits.max_concurrent_streams})",
                             drop_reason=DropReason.SATURATED)
        path = _header_map(first.request_headers.headers).get(":path") if first.HasField("request_headers") else None
        await context.write(messages.error_response(err, path))

    def _on_failure(self, stream: _Stream, req: pb.ProcessingRequest, exc: Exception) -> list[pb.ProcessingResponse]:
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
        stream.trace.failed(ErrorCode.INTERNAL, "internal error while processing request")
        return [messages.error_response(InferenceError(ErrorCode.INTERNAL, "internal error while processing request"),
                                        stream.headers.get(":path"))]

    async def _dispatch(self, stream: _Stream, req: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
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


