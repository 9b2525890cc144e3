"""The baseline picker of `bench/overhead.py`: a bare grpc.aio ext_proc servicer that routes at random.

It speaks the same contract as `epp serve` behind the same Envoy config (request headers held
until the body ends, destination header and `envoy.lb` metadata, bodies re-emitted as
`streamed_response`, response phases answered as they come) and does nothing else: no parsing,
no scheduling, no metrics. What Envoy adds with it is the least any Python ext_proc picker adds.

    python bench/minimal_picker.py PORT 127.0.0.1:8000,127.0.0.1:8001
"""

from __future__ import annotations

import random
import sys

import grpc
import uvloop
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf import struct_pb2

DESTINATION = "x-gateway-destination-endpoint"


def _route(endpoint: str) -> pb.ProcessingResponse:
    metadata = struct_pb2.Struct()
    metadata.fields["envoy.lb"].struct_value.fields[DESTINATION].string_value = endpoint
    header = base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=DESTINATION, raw_value=endpoint.encode()),
                                        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD)
    return pb.ProcessingResponse(
        request_headers=pb.HeadersResponse(response=pb.CommonResponse(
            header_mutation=pb.HeaderMutation(set_headers=[header]), clear_route_cache=True)),
        dynamic_metadata=metadata)


def _body(phase: str, body: bytes, end_of_stream: bool) -> pb.ProcessingResponse:
    mutation = pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(body=body, end_of_stream=end_of_stream))
    return pb.ProcessingResponse(**{phase: pb.BodyResponse(response=pb.CommonResponse(body_mutation=mutation))})


class MinimalPicker(pb_grpc.ExternalProcessorServicer):
    """Random endpoint per request; every phase answered with the least the contract allows."""

    def __init__(self, endpoints: list[str]) -> None:
        self.routes = [_route(ep) for ep in endpoints]

    async def Process(self, request_iterator, context):  # noqa: N802
        parts: list[bytes] = []
        while (req := await context.read()) is not grpc.aio.EOF:
            kind = req.WhichOneof("request")
            if kind == "request_headers":
                if req.request_headers.end_of_stream:
                    await context.write(random.choice(self.routes))
            elif kind == "request_body":
                parts.append(req.request_body.body)
                if req.request_body.end_of_stream:
                    await context.write(random.choice(self.routes))
                    await context.write(_body("request_body", b"".join(parts), True))
            elif kind == "request_trailers":
                await context.write(pb.ProcessingResponse(request_trailers=pb.TrailersResponse()))
            elif kind == "response_headers":
                await context.write(pb.ProcessingResponse(response_headers=pb.HeadersResponse()))
            elif kind == "response_body":
                await context.write(_body("response_body", req.response_body.body, req.response_body.end_of_stream))
            elif kind == "response_trailers":
                await context.write(pb.ProcessingResponse(response_trailers=pb.TrailersResponse()))


async def serve(port: int, endpoints: list[str]) -> None:
    """Serve on 127.0.0.1:`port` until killed."""
    server = grpc.aio.server()
    pb_grpc.add_ExternalProcessorServicer_to_server(MinimalPicker(endpoints), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


if __name__ == "__main__":
    uvloop.run(serve(int(sys.argv[1]), sys.argv[2].split(",")))
