"""ext_proc for tests: `ProcessingRequest` builders, a started picker and a real gRPC client of it,
one request as GIE's integration tests send it, and the picker's own `/metrics` page as samples."""

from __future__ import annotations

import asyncio
import contextlib
import json
import urllib.request
from collections.abc import AsyncIterator, Iterable, Sequence

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf import struct_pb2

from epp.config import LoadedConfig, load_config_text
from epp.datalayer.registry import parse_endpoint_list
from epp.framework import Picker, Plugin, PluginRegistry, PluginSpec, ProfileHandler, ProfileRunResult, SchedulingResult
from epp.server.runner import EppServer, ServeOptions
from tests.support.configs import endpoint_picker_config


class FirstByNamePicker(Picker):
    """Deterministic picker for protocol tests: endpoints in name order, `count` of them."""

    type_name = "first-by-name-picker"

    def __init__(self, name=None, params=None, context=None) -> None:
        super().__init__(name)
        self.count = params.int("count", 1, minimum=1) if params is not None else 1

    def pick(self, state, request, scored):
        ordered = sorted((s.endpoint for s in scored), key=lambda ep: ep.name)
        return ProfileRunResult(tuple(ordered[: self.count]))


class OneProfile(ProfileHandler):
    type_name = "one-profile"

    def pick_profiles(self, state, request, profiles, results):
        return [] if results else list(profiles)

    def process_results(self, state, request, results):
        return SchedulingResult(results, "default")


def pipeline_of(plugins: Sequence[Plugin], count: int = 1) -> LoadedConfig:
    """A pipeline built by the config loader: the first-by-name picker, one profile, and `plugins` as they are."""
    registry = PluginRegistry()
    registry.register_class(FirstByNamePicker)
    registry.register_class(OneProfile)
    for plugin in plugins:
        registry.register(PluginSpec(plugin.type_name, lambda name, params, context, plugin=plugin: plugin))
    text = endpoint_picker_config([{"type": "first-by-name-picker", "parameters": {"count": count}}, "one-profile",
                                   *(p.type_name for p in plugins)], ["first-by-name-picker"])
    return load_config_text(text, source="<test pipeline>", registry=registry)


def simple_pipeline(count: int = 1, hooks: Sequence[Plugin] = ()) -> LoadedConfig:
    """The first `count` endpoints by name, with `hooks` in the pipeline."""
    return pipeline_of(hooks, count)


def options(endpoints: str = "10.0.0.1:8000,10.0.0.2:8000,10.0.0.3:8000", **kw) -> ServeOptions:
    return ServeOptions(grpc_port=0, grpc_health_port=0, metrics_port=0, bind_address="127.0.0.1",
                        endpoints=parse_endpoint_list(endpoints), scrape_metrics=False, grace_period_s=1,
                        **kw)


def header_map(headers: Iterable[tuple[str, str]]) -> base_pb2.HeaderMap:
    return base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in headers])


def subset_metadata(value) -> base_pb2.Metadata:
    hint = struct_pb2.Struct()
    hint.update({"x-gateway-destination-endpoint-subset": value})
    md = base_pb2.Metadata()
    md.filter_metadata["envoy.lb.subset_hint"].CopyFrom(hint)
    return md


def request_headers(path: str = "/v1/completions", extra: Iterable[tuple[str, str]] = (),
                    end_of_stream: bool = False, metadata: base_pb2.Metadata | None = None) -> pb.ProcessingRequest:
    headers = [(":method", "POST"), (":path", path), (":authority", "gw"), ("content-type", "application/json"),
               ("hi", "mom"), ("x-request-id", "test-request-id"), *extra]
    req = pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=header_map(headers), end_of_stream=end_of_stream))
    if metadata is not None:
        req.metadata_context.CopyFrom(metadata)
    return req


def request_body(body: bytes, end_of_stream: bool = True, metadata=None) -> pb.ProcessingRequest:
    req = pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=end_of_stream))
    if metadata is not None:
        req.metadata_context.CopyFrom(metadata)
    return req


def response_headers(headers: Iterable[tuple[str, str]], end_of_stream: bool = False,
                     served: str | None = None) -> pb.ProcessingRequest:
    req = pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=header_map(headers), end_of_stream=end_of_stream))
    if served is not None:
        req.metadata_context.filter_metadata["envoy.lb"].update({"x-gateway-destination-endpoint-served": served})
    return req


def response_body(body: bytes, end_of_stream: bool = False) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(response_body=pb.HttpBody(body=body, end_of_stream=end_of_stream))


class ExtProcClient:
    """A real gRPC client of a started picker: one `exchange` per ext_proc stream."""

    def __init__(self, port: int) -> None:
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        self.stub = pb_grpc.ExternalProcessorStub(self.channel)

    async def exchange(self, requests: Sequence[pb.ProcessingRequest], expect: int,
                       timeout: float = 10.0) -> list[pb.ProcessingResponse]:
        """Send all requests, then read `expect` responses, then close the stream."""
        call = self.stub.Process()
        for req in requests:
            await call.write(req)
        out = []
        async with asyncio.timeout(timeout):
            for _ in range(expect):
                resp = await call.read()
                assert resp is not grpc.aio.EOF, f"stream ended after {len(out)} responses"
                out.append(resp)
        await call.done_writing()
        return out

    async def open(self):
        return self.stub.Process()

    async def close(self) -> None:
        await self.channel.close()


async def started(pipeline: LoadedConfig | None = None, **kw) -> EppServer:
    server = EppServer(options(**kw), pipeline=pipeline or simple_pipeline())
    await server.start()
    return server


@contextlib.asynccontextmanager
async def serving(server: EppServer) -> AsyncIterator[ExtProcClient]:
    """Start `server` and yield a gRPC client of it; both are closed on the way out."""
    await server.start()
    client = ExtProcClient(server.grpc_port)
    try:
        yield client
    finally:
        await client.close()
        await server.stop(0)


def headers_of(mutation) -> dict[str, str]:
    return {h.header.key: h.header.raw_value.decode() for h in mutation.set_headers}


async def no_reply_within(call, seconds: float) -> asyncio.Future:
    """Assert the stream sends nothing for `seconds`; returns the pending read to await later.

    (Cancelling a read would cancel the whole RPC, so the read is kept, not timed out.)
    """
    pending = asyncio.ensure_future(call.read())
    done, _ = await asyncio.wait({pending}, timeout=seconds)
    assert not done, f"unexpected reply: {pending.result()}"
    return pending


def gie_body(model: str, prompt: str = "test1") -> bytes:
    """GIE's request builder body: compact JSON with sorted keys."""
    return json.dumps({"max_tokens": 100, "model": model, "prompt": prompt, "temperature": 0},
                      separators=(",", ":"), sort_keys=True).encode()


async def route(client: ExtProcClient, body: bytes, extra: Iterable[tuple[str, str]] = (),
                metadata=None, path: str = "/v1/completions") -> tuple[str, str, bytes]:
    """One buffered request that must be routed; returns (destination header, `envoy.lb` endpoint, body sent on)."""
    replies = await client.exchange([request_headers(path, extra=extra, metadata=metadata),
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


def error_of(reply: pb.ProcessingResponse) -> tuple[int, bytes]:
    """(HTTP status, error message) of the picker's own answer, checked to be OpenAI's JSON error shape."""
    assert reply.WhichOneof("response") == "immediate_response", reply
    answer = reply.immediate_response
    assert headers_of(answer.headers)["content-type"] == "application/json"
    error = json.loads(answer.body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"].startswith(f"inference error: {error['code']} - ")
    return answer.status.code, error["message"].encode()


def drop_reason_of(reply: pb.ProcessingResponse) -> str | None:
    """The `x-llm-d-request-dropped-reason` of the picker's own answer, if any."""
    return headers_of(reply.immediate_response.headers).get("x-llm-d-request-dropped-reason")


async def immediate(client: ExtProcClient, requests: Sequence[pb.ProcessingRequest]) -> tuple[int, bytes]:
    """A request the picker must answer itself; returns (HTTP status, error message)."""
    [reply] = await client.exchange(requests, expect=1)
    return error_of(reply)


def metric_samples(port: int) -> dict[str, float]:
    """A picker's `/metrics` page on this port as {'name{labels}': value}."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        page = resp.read().decode()
    samples = {}
    for line in page.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            samples[key] = float(value)
    return samples
