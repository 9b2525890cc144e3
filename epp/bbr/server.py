"""The body-based router as a process: ext_proc, gRPC health and Prometheus metrics, the mapping watcher."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2_grpc

from epp.bbr.adapters import EMPTY, AdapterMap, AdapterWatcher
from epp.bbr.service import BbrMetrics, BodyRouter
from epp.debug.http import metrics_app, start_metrics_http
from epp.limits import Limits
from epp.server.health import HealthService
from epp.server.ports import BindError, bind_grpc_port
from epp.server.tls import server_credentials
from epp.server.transport import DEFAULT_MAX_BODY_BYTES

log = logging.getLogger(__name__)

# GIE's body-based router listens on these by default.
DEFAULT_GRPC_PORT = 9004
DEFAULT_HEALTH_PORT = 9005
DEFAULT_METRICS_PORT = 9090


@dataclass(frozen=True)
class BbrOptions:
    """Everything `epp bbr` takes."""

    grpc_port: int = DEFAULT_GRPC_PORT
    grpc_health_port: int = DEFAULT_HEALTH_PORT
    metrics_port: int = DEFAULT_METRICS_PORT
    bind_address: str = "0.0.0.0"
    adapters: tuple[str, ...] = ()  # mapping files or folders (a mounted ConfigMap)
    adapters_poll_interval_s: float = 1.0
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    limits: Limits = field(default_factory=Limits)
    secure_serving: bool = False
    cert_path: str | None = None
    grace_period_s: float = 10.0


class BbrServer:
    """`await start()`, then the ports are bound; `await stop()`."""

    def __init__(self, options: BbrOptions) -> None:
        self.options = options
        self.metrics = BbrMetrics()
        self.watcher = AdapterWatcher(options.adapters, options.adapters_poll_interval_s, on_reload=self._reloaded)
        self.service = BodyRouter(self.mapping, self.metrics, max_body_bytes=options.max_body_bytes,
                                  limits=options.limits)
        self.grpc_port = self.health_port = self.metrics_port = 0
        self._grpc: grpc.aio.Server | None = None
        self._health: grpc.aio.Server | None = None
        self._metrics_http = None
        self._stopping = False

    def mapping(self) -> AdapterMap:
        """The adapter mapping in use now."""
        return self.watcher.current if self.options.adapters else EMPTY

    def is_ready(self) -> bool:
        """Serving and not draining (the mapping, if any, loaded at start: it had to)."""
        return self._grpc is not None and not self._stopping

    def _reloaded(self, outcome: str) -> None:
        self.metrics.reloads.labels(outcome).inc()
        self.metrics.adapters.set(len(self.mapping()))

    async def start(self) -> None:
        """Load the mapping (AdapterMapError when it cannot be used), bind the ports, start polling."""
        opts = self.options
        if opts.adapters:
            await asyncio.to_thread(self.watcher.load_now)
            self.metrics.adapters.set(len(self.mapping()))
        self._grpc = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 * 1024 * 1024),
                                              ("grpc.max_send_message_length", 64 * 1024 * 1024)])
        pb_grpc.add_ExternalProcessorServicer_to_server(self.service, self._grpc)
        credentials = server_credentials(opts.cert_path) if opts.secure_serving else None
        self.grpc_port = bind_grpc_port(self._grpc, opts.bind_address, opts.grpc_port, "--grpc-port", credentials)
        self._health = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(HealthService(self.is_ready), self._health)
        self.health_port = bind_grpc_port(self._health, opts.bind_address, opts.grpc_health_port,
                                          "--grpc-health-port")
        await self._grpc.start()
        await self._health.start()
        try:
            self._metrics_http = start_metrics_http(opts.bind_address, opts.metrics_port,
                                                    metrics_app(self.metrics.registry, None))
        except OSError as exc:
            raise BindError(f"cannot listen on {opts.bind_address}:{opts.metrics_port} (--metrics-port): "
                            f"{exc.strerror or exc}") from None
        self.metrics_port = self._metrics_http.server_port
        if opts.adapters:
            self.watcher.start()
        log.info("epp bbr serving ext_proc on :%d, health on :%d, metrics on :%d, %d adapter(s) mapped",
                 self.grpc_port, self.health_port, self.metrics_port, len(self.mapping()))

    async def stop(self, grace: float | None = None) -> None:
        """Stop polling, drain the streams for the grace period, close every port."""
        self._stopping = True
        await self.watcher.stop()
        if self._grpc is not None:
            await self._grpc.stop(self.options.grace_period_s if grace is None else grace)
        if self._health is not None:
            await self._health.stop(0)
        if self._metrics_http is not None:
            self._metrics_http.shutdown()
            self._metrics_http.server_close()


async def serve_forever(options: BbrOptions, on_started: Callable[[BbrServer], None] | None = None) -> None:
    """Run until SIGTERM/SIGINT, then drain."""
    server = BbrServer(options)
    try:
        await server.start()
    except BaseException:
        await server.stop(0)
        raise
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if on_started is not None:
        on_started(server)
    await stop.wait()
    await server.stop()


__all__ = ["BbrOptions", "BbrServer", "serve_forever"]
