"""The Envoy ext_proc service: one gRPC stream per HTTP request, driven as the GIE endpoint picker.

Request headers are held until the body ends; then the request is parsed and scheduled, and the
headers reply (destination endpoint) and the body (re-emitted as `streamed_response` pieces)
are sent back to back. Response headers, body and trailers are answered as they come: SSE is
streamed through piece by piece, JSON is buffered so the model name can be rewritten back.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf.message import DecodeError

from epp.director import Director
from epp.framework.errors import ErrorCode, InferenceError
from epp.framework.plugin import CycleState
from epp.framework.types import Endpoint, InferenceRequest, ResponseInfo
from epp.limits import Limits
from epp.logutil import Throttled, log_failure
from epp.metrics import EppMetrics
from epp.request.parsing import RequestParser
from epp.request.response import ResponseRewriter, UnreadableBody, parse_usage
from epp.server import messages

log = logging.getLogger(__name__)

REQUEST_ID_HEADER = "x-request-id"
SUBSET_HINT_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_HINT_KEY = "x-gateway-destination-endpoint-subset"
SERVED_ENDPOINT_KEY = "x-gateway-destination-endpoint-served"
DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
RESPONSE_PHASES = frozenset({"response_headers", "response_body", "response_trailers"})
# Token counts beyond this are not counts (and would overflow a float): they are not observed.
_MAX_TOKEN_COUNT = 2**53


def _token_count(value: Any) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= _MAX_TOKEN_COUNT:
        return value
    return None


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
    """
    if not chunk.strip():
        return False
    return not (b'"role"' in chunk and b'"content":""' in chunk and chunk.count(b"data:") <= 1)


class _Stream:
    """State of one ext_proc stream (one HTTP request and its response)."""

    __slots__ = ("service", "headers", "body_parts", "body_size", "subset_hint", "request_id",
                 "request", "target", "state", "response", "rewriter", "response_parts",
                 "response_size", "passthrough", "finished", "rejected", "started", "scheduled",
                 "model_labels", "first_token_seen")

    def __init__(self, service: ExtProcService) -> None:
        self.service = service
        self.headers: dict[str, str] = {}
        self.body_parts: list[bytes] = []
        self.body_size = 0
        self.subset_hint: tuple[str, ...] | None = None
        self.request_id = ""
        self.request: InferenceRequest | None = None
        self.target: Endpoint | None = None
        self.state = CycleState()
        self.response = ResponseInfo()
        self.rewriter: ResponseRewriter | None = None
        self.response_parts: list[bytes] = []
        self.response_size = 0
        self.passthrough = False
        self.finished = False
        self.rejected = False
        self.scheduled = False
        self.started = time.monotonic()
        self.model_labels: tuple[str, str] = ("", "")
        self.first_token_seen = False

    # -- request path -------------------------------------------------------------------------

    async def on_request_headers(self, msg: pb.HttpHeaders) -> list[pb.ProcessingResponse]:
        self.service.check_request_headers(msg.headers)
        self.headers = _header_map(msg.headers)
        self.request_id = self.headers.get(REQUEST_ID_HEADER) or str(uuid.uuid4())
        if not msg.end_of_stream:
            return []  # held until the body has been scheduled
        target = self.service.director.random_endpoint(self.subset_hint)
        self.target = target
        self.scheduled = True
        return [messages.request_headers_response(
            [(messages.DESTINATION_ENDPOINT_HEADER, target.hostport), (REQUEST_ID_HEADER, self.request_id)],
            destination=target.hostport)]

    async def on_request_body(self, msg: pb.HttpBody) -> list[pb.ProcessingResponse]:
        if self.scheduled:
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
        replies = [] if self.scheduled else await self._schedule(end_of_stream=False)
        replies.append(messages.request_trailers_response())
        return replies

    async def _schedule(self, *, end_of_stream: bool) -> list[pb.ProcessingResponse]:
        body = b"".join(self.body_parts)
        self.body_parts = []
        service = self.service
        request, forwarded = service.parser.parse(
            request_id=self.request_id, headers=self.headers, body=body, subset_hint=self.subset_hint)
        self.request = request
        self.model_labels = service.metrics.model_labels(request.model, request.target_model)
        service.metrics.requests.labels(*self.model_labels, str(request.priority)).inc()
        service.metrics.request_sizes.labels(*self.model_labels).observe(len(body))
        result = await service.director.schedule(self.state, request, len(body))
        targets = result.targets
        self.target = targets[0]
        self.scheduled = True
        service.metrics.running_requests.labels(self.model_labels[0]).inc()
        destination = ",".join(ep.hostport for ep in targets)
        set_headers = [(messages.DESTINATION_ENDPOINT_HEADER, destination), (REQUEST_ID_HEADER, self.request_id)]
        if forwarded:
            set_headers.append(("Content-Length", str(len(forwarded))))
        # Headers the pre-request hooks set (the prefiller's ip:port, say); routing headers stay ours.
        set_headers.extend((k, v) for k, v in self.state.request_headers().items()
                           if k not in (messages.DESTINATION_ENDPOINT_HEADER, REQUEST_ID_HEADER))
        replies = [messages.request_headers_response(set_headers, destination=destination)]
        replies.extend(messages.request_body_response(piece, eos)
                       for piece, eos in messages.streamed_body_chunks(forwarded, end_of_stream=end_of_stream))
        self.rewriter = ResponseRewriter(request.model, request.target_model)
        return replies

    # -- response path ------------------------------------------------------------------------

    def on_response_headers(self, req: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        msg = req.response_headers
        headers = _header_map(msg.headers)
        response = self.response
        response.headers = headers
        response.status = headers.get(":status", "")
        response.served_endpoint = served_endpoint_of(req)
        response.streaming = "text/event-stream" in headers.get("content-type", "") or bool(
            self.request and self.request.stream)
        if self.request is not None:
            self.service.director.response_headers(self.state, self.request, response, self.target)
            if not response.streaming or response.status != "200":
                # A whole (or failed) response: its prefill is over, but no first token was timed.
                self.first_token_seen = True
                self.service.director.first_token(self.state, observed=False)
        remove = ["content-length"] if self.rewriter is not None and self.rewriter.active else []
        replies = [messages.response_headers_response(response.set_headers.items(), remove)]
        if msg.end_of_stream:
            self.complete()
        return replies

    def on_response_body(self, msg: pb.HttpBody) -> list[pb.ProcessingResponse]:
        chunk = msg.body
        response = self.response
        if response.streaming or self.passthrough:
            if not self.first_token_seen and self.scheduled and carries_token(chunk):
                self.first_token_seen = True
                self.service.director.first_token(self.state)
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
            self.complete()
        return replies

    def on_response_trailers(self) -> list[pb.ProcessingResponse]:
        self.complete()
        return [messages.response_trailers_response()]

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

    def complete(self, *, aborted: bool = False) -> None:
        """Finish the request once: metrics and completion hooks (also when the stream died)."""
        if self.finished or not self.scheduled:
            return
        self.finished = True
        self.response.end_of_stream = True
        request = self.request
        if request is None:
            return
        metrics = self.service.metrics
        labels = self.model_labels
        metrics.running_requests.labels(labels[0]).dec()
        if not aborted:
            metrics.request_duration.labels(*labels).observe(
                time.monotonic() - self.started)
        try:
            self._observe_usage(labels)
        except Exception as exc:  # metrics of a finished request never fail the response
            log_failure(log, logging.ERROR, "token usage of request %s not recorded", exc, self.request_id)
        self.service.director.response_complete(self.state, request, self.response, self.target)

    def _observe_usage(self, labels: tuple[str, str]) -> None:
        metrics = self.service.metrics
        usage = self.response.usage
        if usage:
            prompt = _token_count(usage.get("prompt_tokens", usage.get("input_tokens")))
            completion = _token_count(usage.get("completion_tokens", usage.get("output_tokens")))
            if prompt is not None:
                metrics.input_tokens.labels(*labels).observe(prompt)
            if completion is not None:
                metrics.output_tokens.labels(*labels).observe(completion)
            details = usage.get("prompt_tokens_details") or usage.get("prompt_token_details") or {}
            cached = _token_count(details.get("cached_tokens")) if isinstance(details, dict) else None
            if cached is not None:
                metrics.cached_tokens.labels(*labels).observe(cached)


class ExtProcService(pb_grpc.ExternalProcessorServicer):
    """`envoy.service.ext_proc.v3.ExternalProcessor` implemented as the GIE endpoint picker."""

    def __init__(self, director: Director, parser: RequestParser, metrics: EppMetrics, *,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, limits: Limits | None = None) -> None:
        self.director = director
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
            return await context.read()
        async with asyncio.timeout(self.limits.stream_idle_timeout_s):
            return await context.read()

    async def Process(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> None:  # noqa: N802
        stream = _Stream(self)
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
                    break
                if stream.rejected:
                    continue  # Envoy answers the client itself after an immediate response
                try:
                    replies = await self._dispatch(stream, req)
                except InferenceError as err:
                    stream.rejected = True
                    metrics.request_errors.labels(*stream.model_labels, err.code.label).inc()
                    replies = [messages.immediate_response(err.code.http_status, err.body)]
                except Exception as exc:
                    replies = self._on_failure(stream, req, exc)
                for reply in replies:
                    await context.write(reply)
        except TimeoutError:
            metrics.stream_errors.labels("idle").inc()
            if not stream.rejected:
                err = InferenceError(ErrorCode.REQUEST_TIMEOUT,
                                     f"no request data for {self.limits.stream_idle_timeout_s:g} s")
                await context.write(messages.immediate_response(err.code.http_status, err.body))
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
            stream.complete(aborted=True)

    async def _refuse(self, context: grpc.aio.ServicerContext, stream: _Stream) -> None:
        """Answer a stream over the concurrency limit with 429 once its first message arrives."""
        self.metrics.stream_errors.labels("over_capacity").inc()
        first = await self._read(context, stream)
        if first is grpc.aio.EOF:
            return
        err = InferenceError(ErrorCode.RESOURCE_EXHAUSTED,
                             f"too many concurrent requests (limit {self.limits.max_concurrent_streams})")
        await context.write(messages.immediate_response(err.code.http_status, err.body))

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
        return [messages.immediate_response(
            500, InferenceError(ErrorCode.INTERNAL, "internal error while processing request").body)]

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


