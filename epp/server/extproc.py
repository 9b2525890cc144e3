"""The Envoy ext_proc service: one gRPC stream per HTTP request, driven as the GIE endpoint picker.

Request headers are held until the body ends; then the request is parsed and scheduled, and the
headers reply (destination endpoint) and the body (re-emitted as `streamed_response` pieces)
are sent back to back. Response headers, body and trailers are answered as they come: SSE is
streamed through piece by piece, JSON is buffered so the model name can be rewritten back.
When Envoy says (in the stream's `protocol_config`) that it sends no response body
(`epp envoy-config --responses headers`), the response headers end the request's prefill and
the stream's close ends the request. When it sends the body STREAMED (`--responses first-token`),
each chunk is answered as it comes and the picker closes the stream once the response holds
nothing more it needs (a streamed answer's first token; Envoy passes the rest on unread).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from epp.debug.scores import ENDPOINT_SCORES_KEY, endpoint_scores_of
from epp.flowcontrol.controller import EVICTED_MESSAGE, eviction_signal
from epp.framework.errors import DropReason, ErrorCode, InferenceError
from epp.framework.jsonbody import UnreadableResponse
from epp.framework.types import InferenceRequest
from epp.limits import Limits
from epp.metrics import EppMetrics
from epp.request.parsing import RequestParser
from epp.request.response import ResponseRewriter
from epp.requestcontrol.director import Director
from epp.requestcontrol.lifecycle import RequestAccounting, RequestLifecycle
from epp.server import messages
from epp.server.transport import DEFAULT_MAX_BODY_BYTES, ExtProcTransport, header_map
from epp.tracing import NO_TRACE, NoTrace, RequestTrace, RequestTracing

log = logging.getLogger(__name__)

REQUEST_ID_HEADER = "x-request-id"
SERVED_ENDPOINT_KEY = "x-gateway-destination-endpoint-served"
# A JSON answer whose model name is rewritten back is held whole up to this size before its chunks are
# answered (STREAMED body mode); past it each chunk is rewritten on its own. Envoy holds the chunks it
# sent until they are answered and stops reading the answer past its buffer limit (1 MiB by default),
# so holding more could wait for an end that never comes.
STREAMED_HOLD_LIMIT = 256 * 1024
__all__ = ["ExtProcService", "carries_token", "served_endpoint_of"]


def served_endpoint_of(req: pb.ProcessingRequest) -> str | None:
    namespace = req.metadata_context.filter_metadata.get(messages.LB_METADATA_NAMESPACE)
    if namespace is None or SERVED_ENDPOINT_KEY not in namespace.fields:
        return None
    return namespace.fields[SERVED_ENDPOINT_KEY].string_value or None


def carries_token(request: InferenceRequest | None, chunk: bytes) -> bool:
    """Whether a streamed response chunk holds generated output, as the request's API format reads it.

    A request routed without a body (no parser read it): any non-empty chunk.
    """
    if request is None or request.format is None:
        return bool(chunk.strip())
    return request.format.carries_token(request, chunk)


class _Stream:
    """Transport state of one ext_proc stream (one HTTP request and its response).

    What the director needs to know goes to the request's `RequestLifecycle`, which also does
    the request's accounting; this class only buffers bodies and builds the replies.
    """

    __slots__ = ("service", "life", "headers", "body_parts", "body_size", "subset_hint", "request_id",
                 "rewriter", "response_parts", "response_size", "passthrough", "rejected", "response_body_sent",
                 "response_body_streamed", "released", "trace", "grpc_metadata", "eviction")

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
        # Whether Envoy sends the response body (its first message says when it does not), and whether
        # STREAMED (`--responses first-token`): one reply per chunk, and the picker may stop reading.
        self.response_body_sent = True
        self.response_body_streamed = False
        # The picker has read all it needs of the response: the transport closes the stream.
        self.released = False
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
        self.headers = header_map(msg.headers)
        self.request_id = self.headers.get(REQUEST_ID_HEADER) or str(uuid.uuid4())
        if self.service.tracing is not None:
            self.trace = self.service.tracing.start(self.headers, self.life.state, self.grpc_metadata)
        if not msg.end_of_stream:
            return []  # held until the body has been scheduled
        pinned = self.service.parser.path_affinity(self.headers.get(":path") or "")
        target = self.life.route_without_body(self.subset_hint, pinned)
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
            try:
                request, forwarded = self.service.parser.parse(
                    request_id=self.request_id, headers=self.headers, body=body, subset_hint=self.subset_hint)
            except InferenceError:
                self.life.refused_unparsed(self.headers, body)  # its error metric names the model it asked for
                raise
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
        headers = header_map(msg.headers)
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
        if self.response_body_streamed:
            return self._on_held_chunk(msg)
        chunk = msg.body
        life = self.life
        response = life.response
        request = life.request
        if response.streaming or self.passthrough:
            if life.awaiting_first_token and carries_token(request, chunk):
                life.first_token()
                self.trace.first_token()
            if self.rewriter is not None:
                chunk = self.rewriter.rewrite(chunk)
            if response.streaming and request is not None and request.format is not None:
                self._read_streamed(request, chunk)
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
            if request is not None and request.format is not None:
                self._read_whole(request, body)
            replies = [messages.response_body_response(piece, eos)
                       for piece, eos in messages.streamed_body_chunks(body)]
            self.response_parts = []
        if msg.end_of_stream:
            life.complete()
        return replies

    def on_response_trailers(self) -> list[pb.ProcessingResponse]:
        replies = self._answer_held(whole=True) if self.response_body_streamed else []
        self.life.complete()
        replies.append(messages.response_trailers_response())
        return replies

    # -- response body held by Envoy (STREAMED: `--responses first-token`) -----------------------

    def _on_held_chunk(self, msg: pb.HttpBody) -> list[pb.ProcessingResponse]:
        """One chunk Envoy holds until it is answered: one reply each, in order; reading stops once it can.

        A streamed answer is read up to its first token (and the stored response's id, which comes
        before it); then the stream is released and Envoy sends the rest without the picker. A JSON
        answer is read whole for its usage. A model name rewritten back keeps the picker on every chunk.
        """
        chunk = msg.body
        life = self.life
        request = life.request
        rewriter = self.rewriter
        rewriting = rewriter is not None and rewriter.active
        if life.response.streaming:
            if life.awaiting_first_token and carries_token(request, chunk):
                life.first_token()
                self.trace.first_token()
            out = rewriter.rewrite(chunk) if rewriting and rewriter is not None else chunk
            if request is not None and request.format is not None:
                self._read_streamed(request, out)
            replies = [_answer(chunk, out)]
            if msg.end_of_stream:
                life.complete()
            elif not rewriting and not life.awaiting_first_token:
                self._release()
            return replies
        if self.passthrough:  # too big to read (or to hold) whole: each chunk goes on as it comes
            out = rewriter.rewrite(chunk) if rewriting and rewriter is not None else chunk
            replies = [_answer(chunk, out)]
            if msg.end_of_stream:
                life.complete()
            return replies
        size = self.response_size + len(chunk)
        self.response_parts.append(chunk)
        self.response_size = size
        if msg.end_of_stream:
            replies = self._answer_held(whole=True) if rewriting else [messages.response_body_unchanged()]
            if not rewriting:
                self._answer_held(whole=True)  # read it: its chunks were answered as they came
            life.complete()
            return replies
        if rewriting:
            if size <= STREAMED_HOLD_LIMIT:
                return []  # answered with the whole (rewritten) answer at its end
            return self._answer_held(whole=False)
        if size > self.service.max_body_bytes:
            # Too big to read whole: Envoy sends the rest on unread.
            self.response_parts = []
            self._release()
        return [messages.response_body_unchanged()]

    def _answer_held(self, *, whole: bool) -> list[pb.ProcessingResponse]:
        """Replies to the JSON chunks not answered yet; `whole`: the answer ended, read it (and rewrite it whole).

        Only a rewritten answer's chunks wait for their reply; the others were answered unchanged
        as they came and are kept only to be read at the end.
        """
        parts, self.response_parts = self.response_parts, []
        rewriter = self.rewriter
        rewriting = rewriter is not None and rewriter.active
        request = self.life.request
        if not whole:  # past the hold limit: each held chunk rewritten on its own, unread
            self.passthrough = True
            assert rewriter is not None
            return [_answer(part, rewriter.rewrite(part)) for part in parts]
        if not parts:
            return []
        body = b"".join(parts)
        if rewriting and rewriter is not None:
            body = rewriter.rewrite(body)
        if request is not None and request.format is not None:
            self._read_whole(request, body)
        if not rewriting:
            return []  # each chunk was answered unchanged when it came
        return [messages.response_body_cleared()] * (len(parts) - 1) + [messages.response_body_replaced(body)]

    def _release(self) -> None:
        """The picker has all it needs of this response: the request ends here, the stream closes."""
        self.released = True
        self.life.complete(released=True)

    def on_close(self) -> None:
        """Envoy closed the stream: without a response body, that is how a response ends."""
        if not self.response_body_sent and self.life.response.status:
            self.life.complete()

    @property
    def ended(self) -> bool:
        """Whether Envoy has nothing more to send on this stream, so its close (EOF or reset) is no error.

        The response ended, or the picker answered the request itself; or Envoy sends no response
        body (`--responses headers|none`), when the stream's close is how a routed request ends.
        """
        life = self.life
        return life.finished or self.rejected or self.released or (not self.response_body_sent and life.scheduled)

    def opened(self, context: grpc.aio.ServicerContext) -> None:
        """A tracing picker keeps the stream's gRPC metadata: a tracing Envoy puts its trace context there."""
        if self.service.tracing is not None:
            self.grpc_metadata = tuple(context.invocation_metadata() or ())

    def on_refused(self, err: InferenceError, *, counted: bool) -> None:
        """The request is answered with `err`: its trace says so; `counted`: in the request error metric."""
        if counted:
            self.life.failed(err.code)
        self.trace.failed(err.code, err.message)

    def interruption(self) -> tuple[asyncio.Future[None], InferenceError, str] | None:
        """Flow control's eviction of the routed request: its signal, the answer (429 `evicted`) and the error label."""
        if self.eviction is None or self.life.finished:
            return None
        return self.eviction, InferenceError(ErrorCode.RESOURCE_EXHAUSTED, EVICTED_MESSAGE,
                                             drop_reason=DropReason.EVICTED), "evicted"

    def on_stream_end(self) -> None:
        """The gRPC stream is over: the request ends (aborted, unless its response ended first)."""
        self.life.complete(aborted=True)
        self.trace.end(self.life.response)

    def _read_streamed(self, request: InferenceRequest, chunk: bytes) -> None:
        """Usage and the stored response's id from one streamed chunk, as the request's format reads them."""
        fmt = request.format
        assert fmt is not None
        response = self.life.response
        try:
            if response.usage is None:
                response.usage = fmt.usage(request, chunk, streamed=True)
            if response.response_id is None:
                response.response_id = fmt.response_id(request, chunk, streamed=True)
        except UnreadableResponse:
            self.service.unreadable_response("too_deep")

    def _read_whole(self, request: InferenceRequest, body: bytes) -> None:
        """Usage and the stored response's id of a whole response; a body the picker cannot read is counted."""
        fmt = request.format
        assert fmt is not None
        response = self.life.response
        try:
            response.usage = fmt.usage(request, body, streamed=False)
            response.response_id = fmt.response_id(request, body, streamed=False)
        except UnreadableResponse:
            self.service.unreadable_response("too_deep")

    def pass_through(self, req: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        """The reply to a response message the picker failed on: the model server's bytes, unchanged."""
        kind = req.WhichOneof("request")
        if kind == "response_headers":
            return [messages.response_headers_response()]
        if kind == "response_trailers":
            return [messages.response_trailers_response()]
        msg = req.response_body
        if self.response_body_streamed:
            # One reply for each chunk Envoy still holds (a rewritten JSON answer's held ones and this
            # one), unchanged; then the picker stops reading and Envoy sends the rest on.
            rewriting = self.rewriter is not None and self.rewriter.active
            waiting = len(self.response_parts) if rewriting and not self.passthrough else 0
            self.response_parts = []
            self._release()
            return [messages.response_body_unchanged()] * (waiting + 1)
        held, self.response_parts = b"".join(self.response_parts) + msg.body, []
        self.passthrough = True
        return [messages.response_body_response(piece, eos)
                for piece, eos in messages.streamed_body_chunks(held, end_of_stream=msg.end_of_stream)]


def _answer(chunk: bytes, out: bytes) -> pb.ProcessingResponse:
    """The reply to a chunk Envoy holds that the picker turned into `out` (unchanged: no body sent back)."""
    return messages.response_body_unchanged() if out == chunk else messages.response_body_replaced(out)


class ExtProcService(ExtProcTransport):
    """`envoy.service.ext_proc.v3.ExternalProcessor` implemented as the GIE endpoint picker."""

    def __init__(self, director: Director, parser: RequestParser, metrics: EppMetrics, *,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, limits: Limits | None = None,
                 emit_endpoint_scores: bool = False, tracing: RequestTracing | None = None) -> None:
        super().__init__(metrics, max_body_bytes=max_body_bytes, limits=limits)
        self.director = director
        # The pick's scores in the headers reply's `envoy.lb` metadata (the scheduler records them).
        self.emit_endpoint_scores = emit_endpoint_scores
        # None: tracing is off, and every stream's trace is NO_TRACE (nothing is done per request).
        self.tracing = tracing
        # Request and token metrics of every stream; label children cached across requests.
        self.accounting = RequestAccounting(metrics)
        self.parser = parser
        self.metrics: EppMetrics = metrics
        self._unreadable_logged = False

    def error_body(self, err: InferenceError, path: str | None) -> bytes | None:
        """The error body in the shape of the API whose parser claims `path` (Anthropic's on `/v1/messages`...)."""
        return self.parser.error_body(err, path)

    def new_stream(self) -> _Stream:
        """A picker stream: its request is parsed, scheduled and its response read."""
        return _Stream(self)

    def unreadable_response(self, reason: str) -> None:
        """Count a response body passed on unread; the first one is logged (the counter has the rest)."""
        self.metrics.unreadable_responses.labels(reason).inc()
        if not self._unreadable_logged:
            self._unreadable_logged = True
            log.warning("a model server's response could not be read (%s) and was passed through unchanged; "
                        "epp_extproc_unreadable_responses_total counts every such response (logged once)", reason)
