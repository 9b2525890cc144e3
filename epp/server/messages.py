"""Builders of the ext_proc `ProcessingResponse` messages the picker sends to Envoy."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2

from epp.framework.errors import DROP_REASON_HEADER, InferenceError
from epp.framework.headers import (
    ENCODER_HOSTS_PORTS_HEADER,
    KV_CACHE_SOURCE_HEADER,
    KV_CACHE_SOURCE_P2P_PORT_HEADER,
    PREFILLER_HOST_PORT_HEADER,
)
from epp.framework.types import openai_error_body

# Some Envoy deployments cap streamed body messages at 64 KiB; GIE re-emits bodies in 62,000-byte pieces.
BODY_CHUNK_LIMIT = 62_000

DESTINATION_ENDPOINT_HEADER = "x-gateway-destination-endpoint"
LB_METADATA_NAMESPACE = "envoy.lb"


# Routing headers only the picker may set (GIE §1.3). The request-headers reply drops any other
# copy, so a client's forged value cannot sit next to (or instead of) the picked endpoint.
SERVED_ENDPOINT_HEADER = "x-gateway-destination-endpoint-served"
PICKER_OWNED_HEADERS = (DESTINATION_ENDPOINT_HEADER, SERVED_ENDPOINT_HEADER, PREFILLER_HOST_PORT_HEADER,
                        ENCODER_HOSTS_PORTS_HEADER, KV_CACHE_SOURCE_HEADER, KV_CACHE_SOURCE_P2P_PORT_HEADER)

_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD


def header_mutation(set_headers: Iterable[tuple[str, str]],
                    remove: Iterable[str] = ()) -> pb.HeaderMutation:
    """Headers to set, replacing any existing value (as `raw_value`, as Envoy expects), and headers to remove."""
    return pb.HeaderMutation(
        set_headers=[base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=k, raw_value=v.encode()),
                                                append_action=_OVERWRITE)
                     for k, v in set_headers],
        remove_headers=list(remove),
    )


def request_headers_response(set_headers: Iterable[tuple[str, str]], *,
                             destination: str | None, remove: Iterable[str] = ()) -> pb.ProcessingResponse:
    """The held request-headers reply: route to `destination`, with its LB metadata; the route is recomputed.

    Picker-owned headers that this reply does not set are removed (a client's copies never pass),
    and those in `remove`.
    """
    # Built field by field in place: nested constructors copy each sub-message (twice as slow per request).
    response = pb.ProcessingResponse()
    common = response.request_headers.response
    common.clear_route_cache = True
    mutation = common.header_mutation
    add = mutation.set_headers.add
    setting = set()
    for key, value in set_headers:
        option = add(append_action=_OVERWRITE)
        option.header.key = key
        option.header.raw_value = value.encode()
        setting.add(key.lower())
    mutation.remove_headers.extend([name for name in PICKER_OWNED_HEADERS if name not in setting])
    if remove:
        mutation.remove_headers.extend(remove)
    if destination is not None:
        response.dynamic_metadata.fields[LB_METADATA_NAMESPACE].struct_value.fields[
            DESTINATION_ENDPOINT_HEADER].string_value = destination
    return response


def set_lb_metadata(response: pb.ProcessingResponse, key: str, value: str) -> None:
    """Add a string under `envoy.lb` to a reply's dynamic metadata (`--emit-endpoint-scores`)."""
    response.dynamic_metadata.fields[LB_METADATA_NAMESPACE].struct_value.fields[key].string_value = value


def streamed_body_chunks(body: bytes, *, end_of_stream: bool = True,
                         limit: int = BODY_CHUNK_LIMIT) -> Iterator[tuple[bytes, bool]]:
    """Split a body into pieces of at most `limit` bytes; an empty body still yields one piece."""
    if not body:
        yield b"", end_of_stream
        return
    view = memoryview(body)
    for offset in range(0, len(body), limit):
        piece = bytes(view[offset:offset + limit])
        yield piece, end_of_stream and offset + limit >= len(body)


def request_body_response(body: bytes, end_of_stream: bool) -> pb.ProcessingResponse:
    """One `streamed_response` piece of the request body."""
    response = pb.ProcessingResponse()
    piece = response.request_body.response.body_mutation.streamed_response
    piece.body = body
    piece.end_of_stream = end_of_stream
    return response


def response_body_response(body: bytes, end_of_stream: bool) -> pb.ProcessingResponse:
    """One `streamed_response` piece of the response body."""
    response = pb.ProcessingResponse()
    piece = response.response_body.response.body_mutation.streamed_response
    piece.body = body
    piece.end_of_stream = end_of_stream
    return response


def response_body_replaced(body: bytes) -> pb.ProcessingResponse:
    """The reply to a response chunk Envoy holds (STREAMED body mode): the chunk is replaced by `body`."""
    response = pb.ProcessingResponse()
    response.response_body.response.body_mutation.body = body
    return response


def response_body_unchanged() -> pb.ProcessingResponse:
    """The reply to a response chunk Envoy holds (STREAMED body mode): Envoy sends the chunk on as it is."""
    return _RESPONSE_BODY_UNCHANGED


def response_body_cleared() -> pb.ProcessingResponse:
    """The reply to a response chunk Envoy holds (STREAMED body mode): the chunk is dropped (sent in a later one)."""
    return _RESPONSE_BODY_CLEARED


# Replies without content are the same every time: built once, sent many times (never mutated).
_EMPTY_RESPONSE_HEADERS = pb.ProcessingResponse(response_headers=pb.HeadersResponse(response=pb.CommonResponse()))
_REQUEST_TRAILERS = pb.ProcessingResponse(request_trailers=pb.TrailersResponse())
_RESPONSE_TRAILERS = pb.ProcessingResponse(response_trailers=pb.TrailersResponse())
_RESPONSE_BODY_UNCHANGED = pb.ProcessingResponse(response_body=pb.BodyResponse(response=pb.CommonResponse()))
_RESPONSE_BODY_CLEARED = pb.ProcessingResponse(response_body=pb.BodyResponse(
    response=pb.CommonResponse(body_mutation=pb.BodyMutation(clear_body=True))))


def response_headers_response(set_headers: Iterable[tuple[str, str]] = (),
                              remove: Iterable[str] = ()) -> pb.ProcessingResponse:
    """The response-headers reply, with the hooks' headers and any header to drop."""
    set_headers, remove = list(set_headers), list(remove)
    if not set_headers and not remove:
        return _EMPTY_RESPONSE_HEADERS
    common = pb.CommonResponse()
    common.header_mutation.CopyFrom(header_mutation(set_headers, remove))
    return pb.ProcessingResponse(response_headers=pb.HeadersResponse(response=common))


def request_trailers_response() -> pb.ProcessingResponse:
    """The reply to request trailers: passed on unchanged."""
    return _REQUEST_TRAILERS


def response_trailers_response() -> pb.ProcessingResponse:
    """The reply to response trailers: passed on unchanged."""
    return _RESPONSE_TRAILERS


def error_response(err: InferenceError, body: bytes | None = None) -> pb.ProcessingResponse:
    """Answer the client directly with `err`; the request goes nowhere.

    `body` is the JSON in the shape the request's API's clients read (its parser's `error_body`;
    default OpenAI's); a dropped request (429, 503) says why in `x-llm-d-request-dropped-reason`.
    """
    headers = [("content-type", "application/json")]
    reason = err.drop_reason
    if reason is not None:
        headers.append((DROP_REASON_HEADER, reason))
    return pb.ProcessingResponse(immediate_response=pb.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=err.code.http_status),
        body=body if body is not None else openai_error_body(err), headers=header_mutation(headers)))
