"""`epp serve --workers N`: N picker processes share the ext_proc port (SO_REUSEPORT) under one supervisor.

The supervisor serves what a pod shows outside: gRPC health (ready while any worker is ready and it
is not draining) and one Prometheus page merging every worker's metrics with its own. Each worker
is a whole picker (its own pipeline, discovery and scrapers) whose health and metrics bind private
loopback ports it reports up a pipe. A worker that exits is started again at once (with a backoff
when it keeps dying young); a worker whose supervisor disappears stops itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import multiprocessing
import os
import signal
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import aiohttp
import grpc
from aiohttp import web
from grpc_health.v1 import health_pb2_grpc
from prometheus_client import CollectorRegistry, generate_latest

from epp.debug.http import MAX_EXPLAIN_BYTES
from epp.debug.supervisor import add_debug_routes
from epp.logutil import JsonLogFormatter
from epp.server.event_loop import run_event_loop
from epp.server.health import HealthService
from epp.server.metrics_auth import MetricsAuth, aiohttp_guard, metrics_auth_from
from epp.server.metrics_merge import merge_pages
from epp.server.ports import BindError, bind_grpc_port, probe_port
from epp.server.runner import ServeOptions, freeze_startup_heap, start_server
from epp.server.tls import metrics_ssl_context

log = logging.getLogger(__name__)

# A worker that dies sooner than this after its start counts as crashing: restarts back off.
_YOUNG_DEATH_S = 5.0
_MAX_BACKOFF_S = 5.0
_MONITOR_INTERVAL_S = 0.1
_READY_POLL_S = 0.2


def worker_count(text: str) -> int:
    """`--workers` value: a positive number, or `auto` (one per usable CPU); ValueError otherwise."""
    if text == "auto":
        try:
            return max(1, len(os.sched_getaffinity(0)))
        except AttributeError:  # not Linux
            return max(1, os.cpu_count() or 1)
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"--workers: {text!r} is not a positive number or 'auto'")
    return int(text)


class WorkerStartError(Exception):
    """The first start of a worker failed (bad config, unreachable discovery): the message says why."""


# ---------------------------------------------------------------- the worker process


def _worker_main(options: ServeOptions, conn: Connection, log_level: int) -> None:
    """Entry point of one worker process (spawned: nothing of the supervisor's gRPC state is inherited)."""
    if options.log_json:
        handler = logging.StreamHandler()
        handler.setFormatter(JsonLogFormatter({"worker": str(options.worker_index)}))
        logging.basicConfig(level=log_level, handlers=[handler])
    else:
        logging.basicConfig(level=log_level,
                            format=f"%(asctime)s %(levelname)s worker{options.worker_index} %(name)s: %(message)s")
    try:
        run_event_loop(_worker_serve(options, conn))
    except Exception as exc:  # reported to the supervisor, which decides whether that is fatal
        from epp.framework.errors import ConfigError

        reason = f"invalid configuration: {exc}" if isinstance(exc, ConfigError) else str(exc) or type(exc).__name__
        try:
            conn.send(("failed", reason))
        except OSError:
            pass
        raise SystemExit(1) from None


async def _worker_serve(options: ServeOptions, conn: Connection) -> None:
    server = await start_server(options)
    freeze_startup_heap()
    conn.send(("started", os.getpid(), server.health_port, server.metrics_port, len(server.endpoints)))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    def supervisor_spoke() -> None:
        # The supervisor never writes: readable means its end closed, i.e. it is gone.
        try:
            conn.recv()
        except (EOFError, OSError):
            loop.remove_reader(conn.fileno())
            stop.set()

    loop.add_reader(conn.fileno(), supervisor_spoke)

    async def report_readiness() -> None:
        last: tuple[bool, bool] | None = None
        while True:
            state = (server.is_ready(), server.is_serving())
            if state != last:
                conn.send(("ready", *state))
                last = state
            await asyncio.sleep(_READY_POLL_S)

    reporter = asyncio.create_task(report_readiness())
    await stop.wait()
    reporter.cancel()
    try:
        conn.send(("ready", False, False))
    except OSError:
        pass
    await server.stop()


# ---------------------------------------------------------------- the supervisor


@dataclass
class WorkerState:
    """What the supervisor knows of one worker slot."""

    index: int
    process: Any = None
    conn: Connection | None = None
    pid: int = 0
    started_at: float = 0.0
    health_port: int = 0
    metrics_port: int = 0
    endpoints: int = 0
    serving: bool = False
    ready: bool = False
    synced: bool = False  # its discovery has synced (the `inference-extension` health service)
    failure: str = ""
    restarts: int = 0
    backoff_s: float = 0.0
    restart_at: float = 0.0


class WorkerSupervisor:
    """Starts N workers, keeps N alive, serves the pod's health and merged metrics."""

    def __init__(self, options: ServeOptions, workers: int, *, log_level: int = logging.WARNING) -> None:
        self.options = options
        self.count = workers
        self.log_level = log_level
        self.workers = [WorkerState(i) for i in range(workers)]
        self.draining = False
        self.grpc_port = options.grpc_port
        self.health_port = 0
        self.metrics_port = 0
        self._context = multiprocessing.get_context("spawn")
        self._health: grpc.aio.Server | None = None
        self._metrics_runner: web.AppRunner | None = None
        self._http: aiohttp.ClientSession | None = None
        self._monitor: asyncio.Task[None] | None = None
        self._changed = asyncio.Event()
        self._sibling_ports: list[int] = []
        self._cert_dir: tempfile.TemporaryDirectory[str] | None = None
        # The supervisor's own series beside the workers' (the metrics port's auth).
        self._registry = CollectorRegistry()
        self.metrics_auth: MetricsAuth | None = None

    @property
    def endpoints(self) -> list[int]:
        """Endpoint count as the start line reads it (`len()`), from the first worker that reported."""
        return [0] * max((w.endpoints for w in self.workers), default=0)

    def is_ready(self) -> bool:
        """Ready while not draining and at least one worker is ready (the kernel only hands
        connections to workers listening, and a worker listens once it has started)."""
        return not self.draining and any(w.ready for w in self.workers)

    def is_serving(self) -> bool:
        """Serving the pool while not draining and some worker's discovery has synced (`inference-extension`)."""
        return not self.draining and any(w.synced for w in self.workers)

    async def start(self, *, first_start_timeout_s: float = 120.0) -> None:
        """Check and bind the pod's ports, start every worker, and wait until each has started once."""
        opts = self.options
        if opts.ha_enable_leader_election:
            raise BindError("--ha-enable-leader-election needs --workers 1 (workers of one pod would "
                            "compete for the pool's lease)")
        if opts.peer_port is not None or opts.peers:
            raise BindError("--peer-port/--peers need --workers 1 (the workers of one pod share their decisions "
                            "among themselves over loopback)")
        from epp.netutil import free_ports

        if opts.secure_serving and not opts.cert_path:
            # One self-signed pair for every worker: a client that pins it must reach any of them.
            from epp.server.tls import self_signed_pair

            self._cert_dir = tempfile.TemporaryDirectory(prefix="epp-tls-")  # 0700: the key stays private
            key, cert = self_signed_pair()
            (Path(self._cert_dir.name) / "tls.key").write_bytes(key)
            (Path(self._cert_dir.name) / "tls.crt").write_bytes(cert)
        # Each worker serves its decisions on a loopback port of its own and follows its siblings.
        self._sibling_ports = free_ports(self.count)
        if opts.grpc_port == 0:
            self.grpc_port = free_ports(1, "127.0.0.1" if opts.bind_address == "0.0.0.0" else opts.bind_address)[0]
        else:
            probe_port(opts.bind_address, opts.grpc_port, "--grpc-port")
        self._health = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(HealthService(self.is_ready, self.is_serving), self._health)
        self.health_port = bind_grpc_port(self._health, opts.bind_address, opts.grpc_health_port, "--grpc-health-port")
        await self._health.start()
        # Within Prometheus' default scrape timeout (10 s), with room for a loaded worker.
        self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5))
        middlewares = []
        if opts.metrics_auth:
            self.metrics_auth = await metrics_auth_from(opts.kubeconfig, self._registry)
            middlewares.append(aiohttp_guard(self.metrics_auth))
        app = web.Application(client_max_size=MAX_EXPLAIN_BYTES, middlewares=middlewares)
        app.router.add_get("/metrics", self._serve_metrics)
        app.router.add_get("/", self._serve_metrics)
        add_debug_routes(app, self.workers, self._http, enabled=opts.enable_debug_endpoint)
        self._metrics_runner = web.AppRunner(app, access_log=None)
        await self._metrics_runner.setup()
        ssl_context = (metrics_ssl_context(opts.metrics_cert_dir, opts.metrics_client_ca_file)
                       if opts.metrics_cert_dir else None)
        site = web.TCPSite(self._metrics_runner, opts.bind_address, opts.metrics_port, ssl_context=ssl_context)
        try:
            await site.start()
        except OSError as exc:
            raise BindError(f"cannot listen on {opts.bind_address}:{opts.metrics_port} (--metrics-port): "
                            f"{exc.strerror or exc}") from None
        self.metrics_port = self._metrics_runner.addresses[0][1]
        for worker in self.workers:
            self._spawn(worker)
        deadline = time.monotonic() + first_start_timeout_s
        while not all(w.serving for w in self.workers):
            failed = next((w for w in self.workers if w.failure), None)
            if failed is not None:
                raise WorkerStartError(failed.failure)
            dead = next((w for w in self.workers if not w.serving and w.process.exitcode is not None), None)
            if dead is not None:
                raise WorkerStartError(f"worker {dead.index} exited with code {dead.process.exitcode} "
                                       "before it served")
            if time.monotonic() > deadline:
                raise WorkerStartError(f"workers did not start within {first_start_timeout_s:.0f}s")
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), 0.2)
            except TimeoutError:
                pass
        self._monitor = asyncio.create_task(self._keep_alive())
        log.info("epp supervisor: %d workers on ext_proc :%d, health :%d, metrics :%d",
                 self.count, self.grpc_port, self.health_port, self.metrics_port)

    def _spawn(self, worker: WorkerState) -> None:
        parent_end, child_end = self._context.Pipe()
        options = dataclasses.replace(self.options, grpc_port=self.grpc_port, worker_index=worker.index)
        if self.options.worker_peer_link:
            peers = [f"127.0.0.1:{port}" for i, port in enumerate(self._sibling_ports) if i != worker.index]
            options = dataclasses.replace(options, peer_port=self._sibling_ports[worker.index], peers=peers)
        if self._cert_dir is not None:
            options = dataclasses.replace(options, cert_path=self._cert_dir.name)
        process = self._context.Process(target=_worker_main, args=(options, child_end, self.log_level),
                                        name=f"epp-worker-{worker.index}", daemon=False)
        process.start()
        child_end.close()
        worker.process, worker.conn = process, parent_end
        worker.pid, worker.started_at = process.pid or 0, time.monotonic()
        worker.serving = worker.ready = worker.synced = False
        worker.failure = ""
        asyncio.get_running_loop().add_reader(parent_end.fileno(), self._on_message, worker)

    def _on_message(self, worker: WorkerState) -> None:
        conn = worker.conn
        assert conn is not None
        try:
            message = conn.recv()
        except (EOFError, OSError):
            asyncio.get_running_loop().remove_reader(conn.fileno())
            worker.ready = worker.synced = False
            self._changed.set()
            return
        kind = message[0]
        if kind == "started":
            _, worker.pid, worker.health_port, worker.metrics_port, worker.endpoints = message
            worker.serving = True
        elif kind == "ready":
            worker.ready, worker.synced = bool(message[1]), bool(message[2])
        elif kind == "failed":
            worker.failure = str(message[1])
            log.warning("%s", worker.failure)
        self._changed.set()

    async def _keep_alive(self) -> None:
        """Replace workers that exited; the backoff doubles while they die young, resets when they live."""
        while not self.draining:
            now = time.monotonic()
            for worker in self.workers:
                process = worker.process
                if process is None or process.exitcode is None:
                    continue
                if worker.restart_at == 0.0:
                    lived = now - worker.started_at
                    worker.backoff_s = (min(_MAX_BACKOFF_S, max(0.25, worker.backoff_s * 2))
                                        if lived < _YOUNG_DEATH_S else 0.0)
                    worker.restart_at = now + worker.backoff_s
                    log.warning("worker %d (pid %d) exited with code %s after %.1fs; restarting in %.2fs",
                                worker.index, worker.pid, process.exitcode, lived, worker.backoff_s)
                    self._close_conn(worker)
                    worker.ready = worker.serving = worker.synced = False
                if now >= worker.restart_at:
                    worker.restart_at = 0.0
                    worker.restarts += 1
                    process.close()
                    self._spawn(worker)
            await asyncio.sleep(_MONITOR_INTERVAL_S)

    def _close_conn(self, worker: WorkerState) -> None:
        if worker.conn is not None:
            try:
                asyncio.get_running_loop().remove_reader(worker.conn.fileno())
            except (ValueError, OSError):
                pass
            worker.conn.close()
            worker.conn = None

    async def _serve_metrics(self, _request: web.Request) -> web.Response:
        pages = await asyncio.gather(*(self._worker_page(w) for w in self.workers))
        merged = merge_pages([(str(w.index), page) for w, page in zip(self.workers, pages) if page is not None])
        own = self._own_metrics(pages) + generate_latest(self._registry).decode()
        return web.Response(text=merged + own, content_type="text/plain",
                            charset="utf-8", headers={"X-Content-Type-Options": "nosniff"})

    async def _worker_page(self, worker: WorkerState) -> str | None:
        if not worker.serving or self._http is None:
            return None
        try:
            async with self._http.get(f"http://127.0.0.1:{worker.metrics_port}/metrics") as resp:
                return await resp.text()
        except (aiohttp.ClientError, TimeoutError):
            return None  # died or stuck: its share is missing from this scrape, not the whole page

    def _own_metrics(self, pages: list[str | None]) -> str:
        lines = ["# HELP epp_workers Worker processes of this picker, by state.", "# TYPE epp_workers gauge"]
        counts = {"configured": self.count, "serving": sum(w.serving for w in self.workers),
                  "ready": sum(w.ready for w in self.workers)}
        lines += [f'epp_workers{{state="{state}"}} {value}.0' for state, value in counts.items()]
        lines += ["# HELP epp_worker_restarts_total Workers started again after they exited.",
                  "# TYPE epp_worker_restarts_total counter",
                  f"epp_worker_restarts_total {float(sum(w.restarts for w in self.workers))}",
                  "# HELP epp_worker_pid The process id serving each worker slot (0 while restarting).",
                  "# TYPE epp_worker_pid gauge"]
        lines += [f'epp_worker_pid{{worker="{w.index}"}} {float(w.pid if w.serving else 0)}' for w in self.workers]
        # Each worker's share of the load (the summed counter above hides how the kernel spread it).
        lines += ["# HELP epp_worker_requests Requests (ext_proc request headers) each worker process has taken "
                  "since it started.", "# TYPE epp_worker_requests gauge"]
        for worker, page in zip(self.workers, pages):
            if page is not None:
                lines.append(f'epp_worker_requests{{worker="{worker.index}"}} {_requests_taken(page)}')
        return "\n".join(lines) + "\n"

    async def stop(self, grace: float | None = None) -> None:
        """Report not ready, SIGTERM every worker (each drains its streams), wait, then stop serving."""
        self.draining = True
        grace = self.options.grace_period_s if grace is None else grace
        if self._monitor is not None:
            self._monitor.cancel()
        for worker in self.workers:
            if worker.process is not None and worker.process.exitcode is None:
                worker.process.terminate()
        deadline = time.monotonic() + grace + 5.0
        for worker in self.workers:
            if worker.process is None:
                continue
            while worker.process.exitcode is None and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if worker.process.exitcode is None:
                log.warning("worker %d did not stop within the grace period; killing it", worker.index)
                worker.process.kill()
                await asyncio.to_thread(worker.process.join, 5)
            self._close_conn(worker)
        if self._health is not None:
            await self._health.stop(0)
        if self._metrics_runner is not None:
            await self._metrics_runner.cleanup()
        if self._http is not None:
            await self._http.close()
        if self.metrics_auth is not None:
            await self.metrics_auth.close()
            self.metrics_auth = None
        if self._cert_dir is not None:
            self._cert_dir.cleanup()


_REQUESTS_SAMPLE = 'epp_extproc_messages_total{phase="request_headers"} '


def _requests_taken(page: str) -> float:
    """The request-headers message count on one worker's metrics page (0 when absent)."""
    start = page.find(_REQUESTS_SAMPLE)
    if start < 0:
        return 0.0
    end = page.find("\n", start)
    return float(page[start + len(_REQUESTS_SAMPLE):end if end >= 0 else None])


async def supervise_forever(options: ServeOptions, workers: int, *, log_level: int = logging.WARNING,
                            on_started: Callable[[Any], None] | None = None) -> None:
    """Run N workers until SIGTERM/SIGINT, then drain them within the grace period."""
    supervisor = WorkerSupervisor(options, workers, log_level=log_level)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await supervisor.start()
    except BaseException:
        await supervisor.stop(0)
        raise
    if on_started is not None:
        on_started(supervisor)
    await stop.wait()
    if options.drain_timeout_s > 0:  # as serve_forever: NOT_SERVING, the workers still take streams
        supervisor.draining = True
        stop.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), options.drain_timeout_s)
    log.info("shutting down %d workers: draining for up to %.1fs", workers, options.grace_period_s)
    await supervisor.stop()
