"""One ext_proc request as GIE's integration tests send it, and what the picker answered."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from tests.extproc_support import (
    ExtProcClient,
    headers_of,
    request_body,
    request_headers,
)


def gie_body(model: str, prompt: str = "test1") -> bytes:
    """GIE's request builder body: compact JSON with sorted keys."""
    return json.dumps({"max_tokens": 100, "model": model, "prompt": prompt, "temperature": 0},
                      separators=(",", ":"), sort_keys=True).encode()


async def route(client: ExtProcClient, body: bytes, extra: Iterable[tuple[str, str]] = (),
                metadata=None) -> tuple[str, str, bytes]:
    """One buffered request that must be routed; returns (destination header, `envoy.lb` endpoint, body sent on)."""
    replies = await client.exchange([request_headers(extra=extra, metadata=metadata),
                                     request_body(body, metadata=metadata)], expect=2)
    assert replies[0].WhichOneof("response") == "request_headers", replies[0]
    common = replies[0].request_headers.response
    assert common.clear_route_cache is True
    headers = headers_of(common.header_mutation)
    assert headers["x-request-id"] == "test-request-id"
    lb = replies[0].dynamic_metadata.fields["envoy.lb"].struct_value.fields
    streamed = replies[1].request_body.response.body_mutation.streamed_response
    assert streamed.end_of_stream is True
    assert headers["Content-Length"] == str(len(streamed.body))
    return headers["x-gateway-destination-endpoint"], lb["x-gateway-destination-endpoint"].string_value, \
        streamed.body


async def immediate(client: ExtProcClient, requests: Sequence[pb.ProcessingRequest]) -> tuple[int, bytes]:
    """A request the picker must answer itself; returns (HTTP status, body)."""
    [reply] = await client.exchange(requests, expect=1)
    assert reply.WhichOneof("response") == "immediate_response", reply
    return reply.immediate_response.status.code, reply.immediate_response.body
