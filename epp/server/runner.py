"""Assembles and runs the picker: discovery, metrics scraping, the pipeline, gRPC and metrics servers."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2_grpc

from epp.config import LoadedConfig, load_config_or_default
from epp.datalayer.freshness import freshness_window
from epp.datalayer.objectives import ObjectivePriorities
from epp.datalayer.registry import EndpointRegistry, EndpointSpec
from epp.debug.explain import ExplainInput, explain
from epp.debug.http import DebugRoutes, metrics_app, start_metrics_http
from epp.debug.state import StateSnapshot, collect_state, server_summary
from epp.framework.plugin import PluginContext, ResponseCompleteHook
from epp.limits import Limits
from epp.load_metrics import register_ledger_metrics
from epp.metrics import EppMetrics, GcPauseRecorder
from epp.request.parsing import RequestParser
from epp.requestcontrol.director import Director
from epp.server.extproc import ExtProcService
from epp.server.health import HealthService
from epp.server.metrics_auth import MetricsAuth, guard_wsgi, metrics_auth_from
from epp.server.ports import BindError, bind_grpc_port
from epp.server.tls import metrics_ssl_context, server_credentials
from epp.server.transport import DEFAULT_MAX_BODY_BYTES
from epp.tracing import RequestTracing

if TYPE_CHECKING:
    from epp.datalayer.scraper import MetricsScraper

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
    # Re-read `cert_path`'s pair when it changes (checked at each new connection).
    enable_cert_reload: bool = False
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    # The ext_proc port's largest gRPC messages (large bodies arrive in Envoy-sized pieces: headroom only).
    grpc_max_recv_bytes: int = 64 * 1024 * 1024
    grpc_max_send_bytes: int = 64 * 1024 * 1024
    grace_period_s: float = 10.0
    # On SIGTERM: keep taking new streams this long while health says NOT_SERVING (llm-d's drain), then stop.
    drain_timeout_s: float = 0.0
    refresh_metrics_interval_s: float = 0.05
    # Metrics older than this pass an endpoint over while others are fresher; None: freshness_window's rule.
    metrics_staleness_s: float | None = None
    scrape_metrics: bool = True
    disable_endpoint_subset_filter: bool = False
    # grpc.health.v1 on the ext_proc port too (llm-d's --health-checking).
    health_checking: bool = False
    # /metrics (and /debug) behind a bearer token the Kubernetes API reviews (TokenReview, SubjectAccessReview).
    metrics_auth: bool = False
    # TLS on the metrics port from this directory's tls.crt/tls.key; with a client CA, client certificates too.
    metrics_cert_dir: str | None = None
    metrics_client_ca_file: str | None = None
    # Log lines as JSON objects (`--zap-encoder json`); workers log as their supervisor does.
    log_json: bool = False
    # Kubernetes discovery: an InferencePool, or standalone a label selector and target ports.
    pool_name: str | None = None
    pool_namespace: str = "default"
    pool_group: str = "inference.networking.k8s.io"
    endpoint_selector: dict[str, str] | None = None
    endpoint_target_ports: tuple[int, ...] = ()
    kubeconfig: str | None = None
    # Active-passive HA (GIE): only the holder of the pool's Lease reports ready.
    ha_enable_leader_election: bool = False
    # The Lease's name; None: the pool's (standalone mode names the Deployment's).
    ha_lease_name: str | None = None
    limits: Limits = field(default_factory=Limits)
    # Cached-token accounting: whose tokens (fairness | objective | header:<name> | none).
    token_accounting_tenant: str = "fairness"
    # Prefill tokens/s one replica can compute; > 0 adds the pool's prefill capacity gauges.
    prefill_capacity_tokens_per_s: float = 0.0
    # Set in a worker of `epp serve --workers N`: the ext_proc port is shared with the other workers
    # (SO_REUSEPORT, checked free by the supervisor), health and metrics bind private loopback ports.
    worker_index: int | None = None
    # Peer link (epp.peer): serve this picker's decisions on this port (None: no link) and follow these pickers.
    peer_port: int | None = None
    peers: list[str] = field(default_factory=list)
    # With --workers N: whether the workers share their decisions over loopback peer links.
    worker_peer_link: bool = True
    # With peers: each endpoint is scraped by one picker, which shares the page (False: all scrape all).
    shared_scrapes: bool = True
    # The pick's scores in the headers reply's `envoy.lb` metadata: None (off), "totals" or "scorers".
    emit_endpoint_scores: str | None = None
    # GET /debug/state and POST /debug/explain on the metrics port (epp.debug).
    enable_debug_endpoint: bool = False
    # OpenTelemetry spans per request, exported as the OTEL_* environment says (epp.tracing).
    tracing: bool = False


class EppServer:
    """One running picker. `start()` binds every port; `stop()` drains in-flight streams."""

    def __init__(self, options: ServeOptions, *, pipeline: LoadedConfig | None = None,
                 tracing: RequestTracing | None = None) -> None:
        self.options = options
        # Tracing given beforehand (tests: an in-memory exporter); else made at start with `options.tracing`.
        self.tracing = tracing
        self._owns_tracing = False
        self.metrics = EppMetrics(max_label_value_length=options.limits.max_label_value_length)
        self.endpoints = EndpointRegistry()
        self.context = PluginContext(metrics_registry=self.metrics.registry, endpoints=self.endpoints)
        # A pipeline loaded beforehand (tests); None: the loader builds it from the options at start.
        self._pipeline = pipeline
        self.pipeline: LoadedConfig | None = None
        self.grpc_port = 0
        self.health_port = 0
        self.metrics_port = 0
        self._grpc: grpc.aio.Server | None = None
        self._health: grpc.aio.Server | None = None
        self._metrics_http: Any = None
        self._background: list[Any] = []
        self.draining = False
        self.director: Director | None = None
        self.objectives = ObjectivePriorities()
        self.leader: Any = None
        self.peer: Any = None
        self._gc_pauses = GcPauseRecorder(self.metrics)
        self.parser: RequestParser | None = None
        self.metrics_auth: MetricsAuth | None = None

    def is_ready(self) -> bool:
        """Ready once discovery produced endpoints (and, with leader election, while leader), until shutdown."""
        return not self.draining and self.endpoints.synced and len(self.endpoints) > 0 and \
            (self.leader is None or self.leader.is_leader) and \
            (self.peer is None or self.peer.caught_up.is_set())

    def is_serving(self) -> bool:
        """Serving its pool: discovery has synced (Ready pods or not) and it is not draining (`inference-extension`)."""
        return not self.draining and self.endpoints.synced

    async def start(self) -> None:
        opts = self.options
        if opts.ha_enable_leader_election and not (opts.pool_name or opts.ha_lease_name):
            raise ValueError("--ha-enable-leader-election needs --pool-name (the lease is the pool's)")
        if opts.peer_port is not None:
            # Before the pipeline is built: plugins take the sharing service from their context.
            from epp.peer.node import PeerNode

            self.peer = PeerNode(host="127.0.0.1" if opts.worker_index is not None else opts.bind_address,
                                 port=opts.peer_port, peers=opts.peers, metrics_registry=self.metrics.registry)
            self.context.sharing = self.peer
            # The peers' in-flight bookings count beside this picker's own (and its own go to them).
            self.context.load = self.peer.shared_ledger()
        pipeline = self._pipeline or load_config_or_default(opts.config_file, opts.config_text, context=self.context)
        self.pipeline = pipeline
        objectives = dict(pipeline.objectives)
        # Static objectives from the config; Kubernetes discovery layers InferenceObjectives over them.
        self.objectives = ObjectivePriorities(objectives)
        scraping = opts.scrape_metrics and pipeline.scrape is not None
        freshness = None
        if scraping:
            freshness = opts.metrics_staleness_s or freshness_window(opts.refresh_metrics_interval_s)
        self.director = Director(pipeline, self.endpoints, self.metrics, server_hooks=(self._accounting(),),
                                 use_subset_hint=not opts.disable_endpoint_subset_filter,
                                 metrics_freshness_s=freshness, ledger=self.context.load)
        register_ledger_metrics(self.context.load, self.endpoints, self.metrics.registry)
        await self._start_discovery()
        if opts.ha_enable_leader_election:
            from epp.server.leader_election import LeaderElection, lease_name

            name = opts.ha_lease_name or lease_name(opts.pool_namespace, opts.pool_name or "")
            self.leader = LeaderElection(namespace=opts.pool_namespace, name=name,
                                         kubeconfig=opts.kubeconfig, metrics_registry=self.metrics.registry)
            await self.leader.start()
        await pipeline.start()
        if self.peer is not None:
            try:
                await self.peer.start()
            except OSError as exc:
                raise BindError(str(exc)) from None
        if opts.tracing and self.tracing is None:
            self.tracing, self._owns_tracing = RequestTracing.from_environment(), True
        limits = opts.limits
        parser = RequestParser(objectives, parsers=pipeline.parsers, max_json_depth=limits.max_json_depth,
                               max_prompt_chars=limits.max_prompt_chars)
        parser.objective_priorities = self.objectives  # a live view: InferenceObjectives change at run time
        self.parser = parser
        if opts.emit_endpoint_scores is not None:
            pipeline.scheduler.record_scores(detailed=opts.emit_endpoint_scores == "scorers")
        service = ExtProcService(self.director, parser, self.metrics, max_body_bytes=opts.max_body_bytes,
                                 limits=limits, emit_endpoint_scores=opts.emit_endpoint_scores is not None,
                                 tracing=self.tracing)
        grpc_options = [("grpc.max_receive_message_length", opts.grpc_max_recv_bytes),
                        ("grpc.max_send_message_length", opts.grpc_max_send_bytes)]
        worker = opts.worker_index is not None
        if worker:
            grpc_options.append(("grpc.so_reuseport", 1))
        self._grpc = grpc.aio.server(options=grpc_options)
        pb_grpc.add_ExternalProcessorServicer_to_server(service, self._grpc)
        health = HealthService(self.is_ready, self.is_serving)
        if opts.health_checking:  # a proxy may health-check the picker on the port it calls
            health_pb2_grpc.add_HealthServicer_to_server(health, self._grpc)
        credentials = (server_credentials(opts.cert_path, reload=opts.enable_cert_reload)
                       if opts.secure_serving else None)
        self.grpc_port = bind_grpc_port(self._grpc, opts.bind_address, opts.grpc_port, "--grpc-port", credentials,
                               shared=worker)
        private_host = "127.0.0.1" if worker else opts.bind_address
        self._health = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(health, self._health)
        self.health_port = bind_grpc_port(self._health, private_host, 0 if worker else opts.grpc_health_port,
                                 "--grpc-health-port")
        await self._grpc.start()
        await self._health.start()
        debug = self._debug_routes() if opts.enable_debug_endpoint else None
        app = metrics_app(self.metrics.registry, debug)
        ssl_context = None
        if not worker:  # a worker's page is private (loopback); its supervisor guards the pod's port
            if opts.metrics_auth:
                self.metrics_auth = await metrics_auth_from(opts.kubeconfig, self.metrics.registry)
                app = guard_wsgi(app, self.metrics_auth, asyncio.get_running_loop())
            if opts.metrics_cert_dir:
                ssl_context = metrics_ssl_context(opts.metrics_cert_dir, opts.metrics_client_ca_file)
        try:
            self._metrics_http = start_metrics_http(private_host, 0 if worker else opts.metrics_port, app,
                                                    ssl_context)
        except OSError as exc:
            raise BindError(f"cannot listen on {opts.bind_address}:{opts.metrics_port} (--metrics-port): "
                            f"{exc.strerror or exc}") from None
        self.metrics_port = self._metrics_http.server_port
        gc.callbacks.append(self._gc_pauses)
        self.metrics.ready_endpoints.set_function(
            lambda: sum(1 for ep in self.endpoints.snapshot() if ep.healthy))
        log.info("epp serving ext_proc on :%d, health on :%d, metrics on :%d, %d endpoint(s)",
                 self.grpc_port, self.health_port, self.metrics_port, len(self.endpoints))

    def _debug_routes(self) -> DebugRoutes:
        """The `/debug` routes, run on this server's event loop."""
        assert self.pipeline is not None and self.director is not None and self.parser is not None
        pipeline, director, parser = self.pipeline, self.director, self.parser

        async def state() -> StateSnapshot:
            summary = server_summary(pipeline, ready=self.is_ready(), draining=self.draining)
            return collect_state(pipeline, self.endpoints, director.ledger,
                                 freshness_s=director.metrics_freshness_s, server=summary)

        async def explained(given: ExplainInput) -> dict[str, Any]:
            return await explain(director, parser, given)

        return DebugRoutes(asyncio.get_running_loop(), state, explained)

    @property
    def scraper(self) -> MetricsScraper | None:
        """The `/metrics` scraper this server started; None when it does not scrape."""
        from epp.datalayer.scraper import MetricsScraper

        return next((item for item in self._background if isinstance(item, MetricsScraper)), None)

    def _accounting(self) -> ResponseCompleteHook:
        """Token accounting and the pool's scaling gauges are on for every configuration."""
        from epp.fleet.accounting import TokenAccounting
        from epp.fleet.pool_gauges import PoolGauges

        opts = self.options
        self.pool_gauges = PoolGauges(self.endpoints, prefill_capacity_tokens_per_s=opts.prefill_capacity_tokens_per_s)
        self.pool_gauges.register(self.metrics.registry)
        self.accounting = TokenAccounting(self.metrics.registry, tenant_source=opts.token_accounting_tenant,
                                          on_prefill=self.pool_gauges.record_prefill,
                                          label_value=self.metrics.label_value)
        return self.accounting

    async def _start_discovery(self) -> None:
        from epp.server.datalayer_startup import start_data_layer

        sharing = self.peer if self.peer is not None and self.options.shared_scrapes else None
        scrape = self.pipeline.scrape if self.pipeline is not None else None
        discovery = self.pipeline.discovery if self.pipeline is not None else None
        self._background.extend(await start_data_layer(self.options, self.endpoints, self.metrics, self.objectives,
                                                       sharing=sharing, scrape=scrape,
                                                       discovery_plugin=discovery))

    async def begin_drain(self) -> None:
        """Report NOT_SERVING (but alive) and hand the lease over, still taking streams (llm-d's drain window)."""
        self.draining = True
        if self.leader is not None:  # hand the lease over first: a standby becomes ready meanwhile
            await self.leader.stop()

    async def stop(self, grace: float | None = None) -> None:
        """Stop taking new streams, let in-flight ones finish within `grace` seconds, then stop all."""
        self.draining = True
        if self.pipeline is not None and self.pipeline.flow_controller is not None:
            self.pipeline.flow_controller.close()  # queued requests are answered now, not cut off after the drain
        if self.leader is not None:
            await self.leader.stop()
        grace = self.options.grace_period_s if grace is None else grace
        if self._grpc is not None:
            await self._grpc.stop(grace)
        if self._health is not None:
            await self._health.stop(0)
        if self.peer is not None:
            await self.peer.stop()
        for item in reversed(self._background):
            await item.stop()
        if self.pipeline is not None:
            await self.pipeline.stop()
        if self._metrics_http is not None:
            self._metrics_http.shutdown()
            self._metrics_http.server_close()
        if self.metrics_auth is not None:
            await self.metrics_auth.close()
            self.metrics_auth = None
        if self._gc_pauses in gc.callbacks:
            gc.callbacks.remove(self._gc_pauses)
        if self._owns_tracing and self.tracing is not None:
            await asyncio.to_thread(self.tracing.shutdown)  # exports the spans still pending

    async def wait(self) -> None:
        if self._grpc is not None:
            await self._grpc.wait_for_termination()


async def start_server(options: ServeOptions) -> EppServer:
    """A started `EppServer`; if starting fails, what did start (discovery, scrapers, plugins) is stopped first."""
    server = EppServer(options)
    try:
        await server.start()
    except BaseException:
        await server.stop(0)
        raise
    return server


def freeze_startup_heap() -> None:
    """Keep what start-up allocated (modules, config, plugins, indexes) out of every later garbage collection.

    It lives as long as the process; without this each full collection walks all of it again
    (1-12 % of the CPU per routed request in bench/extproc_cpu.py:
    bench/notes/2026-12-cost-and-pickers-issue14-round2-s4-s6.md, "A quiet machine"). Only for
    processes that serve until they exit: a reference cycle among frozen objects is never collected.
    """
    gc.collect()
    gc.freeze()


async def serve_forever(options: ServeOptions, on_started: Callable[[EppServer], None] | None = None) -> None:
    """Run until SIGTERM/SIGINT, then drain within the grace period; `on_started` is called once serving."""
    import signal

    server = await start_server(options)
    freeze_startup_heap()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    # Handlers first: whoever reads the start line may signal at once, and must get a drain, not a kill.
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if on_started is not None:
        on_started(server)
    await stop.wait()
    if options.drain_timeout_s > 0:
        # llm-d's drain: NOT_SERVING and the lease released at once, new streams still taken for a while
        # (a gateway that has not yet seen the pod go keeps sending); a second signal ends the window.
        log.info("draining: NOT_SERVING, still taking streams for %.1fs", options.drain_timeout_s)
        stop.clear()
        await server.begin_drain()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), options.drain_timeout_s)
    log.info("shutting down: draining in-flight streams for up to %.1fs", options.grace_period_s)
    await server.stop()
