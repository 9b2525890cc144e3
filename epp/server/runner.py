"""Assembles and runs the picker: discovery, metrics scraping, the pipeline, gRPC and metrics servers."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2_grpc
from prometheus_client import start_http_server

from epp.datalayer.registry import EndpointRegistry, EndpointSpec
from epp.director import AdmissionPolicy, Director, Pipeline
from epp.framework.plugin import PluginContext
from epp.load_metrics import register_ledger_metrics
from epp.metrics import EppMetrics
from epp.request.parsing import RequestParser
from epp.server.extproc import DEFAULT_MAX_BODY_BYTES, ExtProcService
from epp.server.health import HealthService
from epp.server.tls import server_credentials

log = logging.getLogger(__name__)


@dataclass
class ServeOptions:
    """Everything `epp serve` can be told; port 0 binds a free port (tests)."""

    grpc_port: int = 9002
    grpc_health_port: int = 9003
    metrics_port: int = 9090
    bind_address: str = "0.0.0.0"
    config_text: str | None = None
    config_file: str | None = None
    endpoints: list[EndpointSpec] = field(default_factory=list)
    endpoints_file: str | None = None
    secure_serving: bool = False
    cert_path: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    grace_period_s: float = 10.0
    refresh_metrics_interval_s: float = 0.05
    scrape_metrics: bool = True
    disable_endpoint_subset_filter: bool = False


class EppServer:
    """One running picker. `start()` binds every port; `stop()` drains in-flight streams."""

    def __init__(self, options: ServeOptions, *, pipeline: Pipeline | None = None,
                 admission: AdmissionPolicy | None = None) -> None:
        self.options = options
        self.metrics = EppMetrics()
        self.endpoints = EndpointRegistry()
        self.context = PluginContext(metrics_registry=self.metrics.registry, endpoints=self.endpoints)
        self._pipeline = pipeline
        self._admission = admission
        self.grpc_port = 0
        self.health_port = 0
        self.metrics_port = 0
        self._grpc: grpc.aio.Server | None = None
        self._health: grpc.aio.Server | None = None
        self._metrics_http: Any = None
        self._background: list[Any] = []
        self.draining = False
        self.director: Director | None = None

    def is_ready(self) -> bool:
        """Ready once discovery produced endpoints, until shutdown starts."""
        return not self.draining and self.endpoints.synced and len(self.endpoints) > 0

    async def start(self) -> None:
        opts = self.options
        pipeline, admission, objectives = self._build_pipeline()
        self.director = Director(pipeline, self.endpoints, self.metrics, admission,
                                 use_subset_hint=not opts.disable_endpoint_subset_filter,
                                 ledger=self.context.load)
        register_ledger_metrics(self.context.load, self.endpoints, self.metrics.registry)
        await self._start_discovery()
        for plugin in pipeline.plugins:
            await plugin.start()
        service = ExtProcService(self.director, RequestParser(objectives), self.metrics,
                                 max_body_bytes=opts.max_body_bytes)
        # Large bodies arrive in Envoy-sized pieces; the cap on whole messages only needs headroom.
        grpc_options = [("grpc.max_receive_message_length", 64 * 1024 * 1024),
                        ("grpc.max_send_message_length", 64 * 1024 * 1024)]
        self._grpc = grpc.aio.server(options=grpc_options)
        pb_grpc.add_ExternalProcessorServicer_to_server(service, self._grpc)
        address = f"{opts.bind_address}:{opts.grpc_port}"
        if opts.secure_serving:
            self.grpc_port = self._grpc.add_secure_port(address, server_credentials(opts.cert_path))
        else:
            self.grpc_port = self._grpc.add_insecure_port(address)
        self._health = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(HealthService(self.is_ready), self._health)
        self.health_port = self._health.add_insecure_port(f"{opts.bind_address}:{opts.grpc_health_port}")
        await self._grpc.start()
        await self._health.start()
        self._metrics_http, _thread = start_http_server(opts.metrics_port, opts.bind_address,
                                                        registry=self.metrics.registry)
        self.metrics_port = self._metrics_http.server_port
        self.metrics.ready_endpoints.set_function(
            lambda: sum(1 for ep in self.endpoints.snapshot() if ep.healthy))
        log.info("epp serving ext_proc on :%d, health on :%d, metrics on :%d, %d endpoint(s)",
                 self.grpc_port, self.health_port, self.metrics_port, len(self.endpoints))

    def _build_pipeline(self) -> tuple[Pipeline, AdmissionPolicy | None, dict[str, int]]:
        if self._pipeline is not None:
            return self._pipeline, self._admission, {}
        from epp.server.pipeline import load_pipeline

        return load_pipeline(self.options, self.context)

    async def _start_discovery(self) -> None:
        from epp.server.pipeline import start_data_layer

        self._background.extend(await start_data_layer(self.options, self.endpoints, self.metrics))

    async def stop(self, grace: float | None = None) -> None:
        """Stop taking new streams, let in-flight ones finish within `grace` seconds, then stop all."""
        self.draining = True
        grace = self.options.grace_period_s if grace is None else grace
        if self._grpc is not None:
            await self._grpc.stop(grace)
        if self._health is not None:
            await self._health.stop(0)
        for item in reversed(self._background):
            await item.stop()
        if self.director is not None:
            for plugin in self.director.pipeline.plugins:
                try:
                    await plugin.stop()
                except Exception:
                    log.exception("stopping plugin %s failed", plugin.name)
        if self._metrics_http is not None:
            self._metrics_http.shutdown()
            self._metrics_http.server_close()

    async def wait(self) -> None:
        if self._grpc is not None:
            await self._grpc.wait_for_termination()


async def serve_forever(options: ServeOptions) -> None:
    """Run until SIGTERM/SIGINT, then drain within the grace period."""
    import signal

    server = EppServer(options)
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("shutting down: draining in-flight streams for up to %.1fs", options.grace_period_s)
    await server.stop()
