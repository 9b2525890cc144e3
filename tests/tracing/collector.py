"""A collector for tests: receives OTLP trace exports over gRPC and over HTTP (protobuf) on loopback ports,
as an OpenTelemetry Collector's `otlp` receiver does, and keeps each span's service, name and ids."""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc
from aiohttp import web
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as otlp
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as otlp_grpc


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str  # "" for a root span
    attributes: dict[str, object]
    resource: dict[str, object] = field(default_factory=dict)  # the exporting process's resource attributes


def _value(any_value) -> object:
    kind = any_value.WhichOneof("value")
    return getattr(any_value, kind) if kind else None


class OtlpCollector(otlp_grpc.TraceServiceServicer):
    """`start()` binds both receivers on free loopback ports; `spans` grows with every export."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.grpc_port = 0
        self.http_port = 0
        self._grpc: grpc.aio.Server | None = None
        self._http: web.AppRunner | None = None

    def _keep(self, request: otlp.ExportTraceServiceRequest) -> None:
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    self.spans.append(ReceivedSpan(
                        str(resource.get("service.name", "")), span.name, span.trace_id.hex(), span.span_id.hex(),
                        span.parent_span_id.hex(), {a.key: _value(a.value) for a in span.attributes}, resource))

    async def Export(self, request, context):  # noqa: N802 (the gRPC method's name)
        self._keep(request)
        return otlp.ExportTraceServiceResponse()

    async def _http_export(self, request: web.Request) -> web.Response:
        self._keep(otlp.ExportTraceServiceRequest.FromString(await request.read()))
        return web.Response(body=otlp.ExportTraceServiceResponse().SerializeToString(),
                            content_type="application/x-protobuf")

    async def start(self) -> OtlpCollector:
        self._grpc = grpc.aio.server()
        otlp_grpc.add_TraceServiceServicer_to_server(self, self._grpc)
        self.grpc_port = self._grpc.add_insecure_port("127.0.0.1:0")
        await self._grpc.start()
        app = web.Application()
        app.router.add_post("/v1/traces", self._http_export)
        self._http = web.AppRunner(app, access_log=None)
        await self._http.setup()
        site = web.TCPSite(self._http, "127.0.0.1", 0)
        await site.start()
        self.http_port = site._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        if self._grpc is not None:
            await self._grpc.stop(0)
        if self._http is not None:
            await self._http.cleanup()

    def named(self, name: str, service: str | None = None) -> list[ReceivedSpan]:
        return [s for s in self.spans if s.name == name and (service is None or s.service == service)]
