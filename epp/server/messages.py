"""Builders of the ext_proc `ProcessingResponse` messages the picker sends to Envoy."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from epp.framework.headers import PREFILLER_HOST_PORT_HEADER

# Some Envoy deployments cap streamed body messages at 64 KiB; GIE re-emits bodies in 62,000-byte pieces.
BODY_CHUNK_LIMIT = 62_000

DESTINATION_ENDPOINT_HEADER = "x-gateway-destination-endpoint"
LB_METADATA_NAMESPACE = "envoy.lb"


# Routing headers only the picker may set (GIE §1.3). The request-headers reply drops any other
# copy, so a client's forged value cannot sit next to (or instead of) the picked endpoint.
SERVED_ENDPOINT_HEADER = "x-gateway-destination-endpoint-served"
PICKER_OWNED_HEADERS = (DESTINATION_ENDPOINT_HEADER, SERVED_ENDPOINT_HEADER, PREFILLER_HOST_PORT_HEADER)

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


def destination_metadata(endpoints: str) -> struct_pb2.Struct:
    """`dynamic_metadata["envoy.lb"]["x-gateway-destination-endpoint"]` = the same string as the header."""
    metadata = struct_pb2.Struct()
    metadata.fields[LB_METADATA_NAMESPACE].struct_value.fields[DESTINATION_ENDPOINT_HEADER].string_value = endpoints
    return metadata


def request_headers_response(set_headers: Iterable[tuple[str, str]], *,
                             destination: str | None) -> pb.ProcessingResponse:
    """The held request-headers reply: route to `destination`, with its LB metadata.

    Picker-owned headers that this reply does not set are removed (a client's copies never pass).
    """
    set_headers = list(set_headers)
    setting = {key.lower() for key, _ in set_headers}
    remove = [name for name in PICKER_OWNED_HEADERS if name not in setting]
    response = pb.ProcessingResponse(
        request_headers=pb.HeadersResponse(response=pb.CommonResponse(
            header_mutation=header_mutation(set_headers, remove), clear_route_cache=True)))
    if destination is not None:
        response.dynamic_metadata.CopyFrom(destination_metadata(destination))
    return response


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
    return pb.ProcessingResponse(request_body=pb.BodyResponse(response=pb.CommonResponse(
        body_mutation=pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(
            body=body, end_of_stream=end_of_stream)))))


def response_body_response(body: bytes, end_of_stream: bool) -> pb.ProcessingResponse:
    """One `streamed_response` piece of the response body."""
    return pb.ProcessingResponse(response_body=pb.BodyResponse(response=pb.CommonResponse(
        body_mutation=pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(
            body=body, end_of_stream=end_of_stream)))))


def response_headers_response(set_headers: Iterable[tuple[str, str]] = (),
                              remove: Iterable[str] = ()) -> pb.ProcessingResponse:
    """The response-headers reply, with the hooks' headers and any header to drop."""
    set_headers, remove = list(set_headers), list(remove)
    common = pb.CommonResponse()
    if set_headers or remove:
        common.header_mutation.CopyFrom(header_mutation(set_headers, remove))
    return pb.ProcessingResponse(response_headers=pb.HeadersResponse(response=common))


def request_trailers_response() -> pb.ProcessingResponse:
    return pb.ProcessingResponse(request_trailers=pb.TrailersResponse())


def response_trailers_response() -> pb.ProcessingResponse:
    return pb.ProcessingResponse(response_trailers=pb.TrailersResponse())


def immediate_response(status: int, body: str) -> pb.ProcessingResponse:
    """Answer the client directly with `status` and a plain-text body; the request goes nowhere."""
    return pb.ProcessingResponse(immediate_response=pb.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=status), body=body.encode(),
        headers=header_mutation([("content-type", "text/plain; charset=utf-8")])))
