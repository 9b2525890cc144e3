"""Per-endpoint scraping of vLLM `/metrics` into the endpoint registry's immutable snapshots."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import random
import ssl
import time
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from epp.datalayer.http_get import FetchFailure, KeepAliveGetter
from epp.datalayer.promparse import VllmMetrics, parse_vllm_metrics
from epp.datalayer.registry import EndpointRegistry
from epp.framework.sharing import DecisionSharing
from epp.framework.types import Endpoint, EndpointMetrics

log = logging.getLogger(__name__)

_SCRAPE_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0)
_UNSUPPORTED_PROBE_INTERVAL_S = 30.0
FAILURE_REASONS = ("connect", "timeout", "http_status", "too_large", "no_metrics", "protocol", "internal")
# The optional families a `families` list may leave out (metrics-data-source), and the fields they fill.
_OPTIONAL_FAMILY_FIELDS = {"vllm:prefix_cache_queries": "prefix_cache_queries",
                           "vllm:prefix_cache_hits": "prefix_cache_hits",
                           "vllm:engine_sleep_state": "sleeping"}
# With peers, an endpoint another picker scrapes is scraped here too once nothing fresher than this
# many intervals came from it (the peer died, cannot reach the endpoint, or sees other peers).
_FALLBACK_INTERVALS = 3.0


class ScrapeFailure(FetchFailure):
    """One failed scrape; `reason` is one of FAILURE_REASONS (the error counter's label)."""


def to_endpoint_metrics(values: VllmMetrics, update_time: float,
                        sleeping: bool | None = None) -> EndpointMetrics:
    """Build the immutable snapshot; a series missing from the page keeps the field's default.

    `sleeping`, when given, is what `/is_sleeping` said for a page without the sleep-state series.
    """
    return EndpointMetrics(
        waiting_queue_size=int(values.waiting or 0),
        running_requests_size=int(values.running or 0),
        kv_cache_usage=values.kv_usage or 0.0,
        active_models=values.running_adapters or frozenset(),
        waiting_models=values.waiting_adapters or frozenset(),
        max_active_models=values.max_lora or 0,
        cache_block_size=values.block_size or 0,
        cache_num_blocks=values.num_gpu_blocks or 0,
        cache_num_cpu_blocks=values.num_cpu_blocks or 0,
        update_time=update_time,
        prefix_cache_queries=values.prefix_cache_queries or 0.0,
        prefix_cache_hits=values.prefix_cache_hits or 0.0,
        sleeping=bool(values.sleeping if values.sleeping is not None else sleeping),
    )


@dataclass(slots=True)
class _SleepProbe:
    """The last `/is_sleeping` answer of an endpoint whose `/metrics` lacks the sleep-state series."""

    checked_at: float = -math.inf
    sleeping: bool = False
    supported: bool = True


def scrape_ssl_context(insecure_skip_verify: bool = False, ca_cert_path: str | None = None,
                       client_cert_path: str | None = None, client_key_path: str | None = None) -> ssl.SSLContext:
    """The TLS settings of an https scrape: verify against `ca_cert_path` (else the system CAs) unless
    `insecure_skip_verify`; present a client certificate when given (mTLS)."""
    context = ssl.create_default_context(cafile=ca_cert_path)
    if insecure_skip_verify:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    if client_cert_path is not None:
        context.load_cert_chain(client_cert_path, client_key_path)
    return context


class MetricsScraper:
    """One asyncio task per endpoint polls `<scheme>://<metrics host:port><path>` and swaps the result
    into the registry. After `failure_threshold` consecutive failures an endpoint is marked
    unhealthy; the next successful scrape marks it healthy again. Tasks follow the registry:
    they start when endpoints are added and are cancelled when endpoints are removed.

    With `sharing` (the peer link), each endpoint is scraped by one picker of the pool, which
    publishes what it read; the others apply that and scrape only when it stops coming.
    """

    def __init__(
        self,
        registry: EndpointRegistry,
        *,
        interval: float = 0.05,
        timeout: float = 1.0,
        failure_threshold: int = 3,
        staleness_threshold: float = 2.0,
        metrics_registry: CollectorRegistry | None = None,
        path: str = "/metrics",
        scheme: str = "http",
        insecure_skip_verify: bool = False,
        ca_cert_path: str | None = None,
        client_cert_path: str | None = None,
        client_key_path: str | None = None,
        families: frozenset[str] | None = None,
        max_body_bytes: int = 4 * 1024 * 1024,
        max_scrapes_per_second: float | None = 2000.0,
        session: aiohttp.ClientSession | None = None,
        sleep_probe_interval: float = 1.0,
        sharing: DecisionSharing | None = None,
    ) -> None:
        if interval <= 0 or timeout <= 0 or failure_threshold < 1 or staleness_threshold <= 0:
            raise ValueError("interval, timeout and staleness_threshold must be > 0, failure_threshold >= 1")
        self.registry = registry
        self.interval = interval
        self.timeout = timeout
        self.failure_threshold = failure_threshold
        self.staleness_threshold = staleness_threshold
        if scheme not in ("http", "https"):
            raise ValueError(f"scheme must be http or https, got {scheme!r}")
        self.path = path if path.startswith("/") else "/" + path
        self.scheme = scheme
        self._ssl_context: ssl.SSLContext | None = None
        if scheme == "https":
            self._ssl_context = scrape_ssl_context(insecure_skip_verify, ca_cert_path, client_cert_path,
                                                   client_key_path)
        # Series of families the config leaves out are dropped, as if the page had none.
        self._dropped_fields = tuple(field for family, field in _OPTIONAL_FAMILY_FIELDS.items()
                                     if families is not None and family not in families)
        # Parsing runs on the event loop at ~1 ms per MB; the cap keeps one scrape's stall in the
        # low milliseconds (a single vLLM's page is ~40-100 KB).
        self.max_body_bytes = max_body_bytes
        if max_scrapes_per_second is not None and max_scrapes_per_second <= 0:
            raise ValueError("max_scrapes_per_second must be > 0 (or None for no budget)")
        # One scrape costs ~0.15-0.3 ms of CPU (the HTTP round trip, then parsing); the budget stops a large
        # pool at a short interval from eating the cores the request path needs. A pool larger
        # than budget × interval is polled at `len(pool) / budget` instead of `interval`.
        self.max_scrapes_per_second = max_scrapes_per_second
        self._stretched = False
        # vLLM exports `vllm:engine_sleep_state`; a server without it (older vLLM, another engine)
        # is asked `GET /is_sleeping` at this modest rate instead, so a sleeping replica is known
        # within about a second either way. A 404 (no dev routes) is re-checked only rarely.
        if sleep_probe_interval <= 0:
            raise ValueError("sleep_probe_interval must be > 0")
        self.sleep_probe_interval = sleep_probe_interval
        self.sharing = sharing
        self._sleep_probes: dict[str, _SleepProbe] = {}
        self._session = session
        self._owns_session = session is None
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._getters: dict[str, KeepAliveGetter] = {}  # per endpoint: its kept-alive /metrics connection
        self._failures: dict[str, int] = {}
        self._running = False
        metrics_registry = metrics_registry if metrics_registry is not None else CollectorRegistry()
        self.scrape_errors = Counter(
            "epp_metrics_scrape_errors", "Failed /metrics scrapes by endpoint and reason.",
            ["endpoint", "reason"], registry=metrics_registry)
        self.scrape_duration = Histogram(
            "epp_metrics_scrape_duration_seconds", "Duration of one /metrics scrape (fetch and parse).",
            buckets=_SCRAPE_BUCKETS, registry=metrics_registry)
        self.stale_gauge = Gauge(
            "epp_metrics_stale_endpoints",
            "Endpoints whose metrics are older than the staleness threshold (or never scraped).",
            registry=metrics_registry)
        self.stale_gauge.set_function(lambda: float(len(self.stale_endpoints())))
        self.interval_gauge = Gauge(
            "epp_metrics_scrape_interval_seconds",
            "Interval between two scrapes of one endpoint (stretched when over the scrape budget).",
            registry=metrics_registry)
        self.interval_gauge.set_function(self.effective_interval)
        self.scrapes = Counter(
            "epp_metrics_scrapes", "Scrapes started, by why this picker scraped: own (its share of the pool, or "
            "no peers) or fallback (a peer's share that sent nothing fresh).", ["reason"], registry=metrics_registry)
        self.peer_scrapes = Counter(
            "epp_metrics_peer_scrapes", "Peers' scrapes received, by outcome: applied, older (than what this "
            "picker holds) or unknown_endpoint.", ["outcome"], registry=metrics_registry)

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Open the shared HTTP session and start scraping every endpoint the registry holds."""
        if self._running:
            return
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, enable_cleanup_closed=True),
                # Compressing a page on loopback or a pod network costs more CPU than it saves.
                headers={"Accept-Encoding": "identity"},
            )
        self._running = True
        if self.sharing is not None:
            self.sharing.share_loads(self._apply_peer_scrape)
        self.registry.add_listener(self._on_endpoints_changed)
        for endpoint in self.registry.snapshot():
            self._start_task(endpoint.name)
        self._log_budget()

    async def stop(self) -> None:
        """Cancel every scrape task and close the session this scraper opened."""
        if not self._running:
            return
        self._running = False
        self.registry.remove_listener(self._on_endpoints_changed)
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for getter in self._getters.values():
            getter.close()
        self._getters.clear()
        if self._owns_session and self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> MetricsScraper:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # -- staleness ---------------------------------------------------------------------------

    def stale_endpoints(self, now: float | None = None) -> list[str]:
        """Names of endpoints whose metrics are older than `staleness_threshold` or missing."""
        now = time.monotonic() if now is None else now
        return [ep.name for ep in self.registry.snapshot()
                if ep.metrics.is_stale(self.staleness_threshold, now)]

    def is_stale(self, endpoint: Endpoint, now: float | None = None) -> bool:
        """Whether this endpoint's metrics are too old to trust."""
        return endpoint.metrics.is_stale(self.staleness_threshold, now)

    def effective_interval(self) -> float:
        """The interval in force: `interval`, or longer when the pool exceeds the scrape budget."""
        if self.max_scrapes_per_second is None:
            return self.interval
        return max(self.interval, len(self._tasks) / self.max_scrapes_per_second)

    @property
    def scraping(self) -> Sequence[str]:
        """Names of the endpoints with a live scrape task."""
        return tuple(name for name, task in self._tasks.items() if not task.done())

    # -- internals ---------------------------------------------------------------------------

    def _on_endpoints_changed(self, added: tuple[Endpoint, ...], removed: tuple[Endpoint, ...]) -> None:
        for endpoint in removed:
            task = self._tasks.pop(endpoint.name, None)
            if task is not None:
                task.cancel()
            getter = self._getters.pop(endpoint.name, None)
            if getter is not None:
                getter.close()
            self._failures.pop(endpoint.name, None)
            self._sleep_probes.pop(endpoint.name, None)
            for reason in FAILURE_REASONS:
                try:
                    self.scrape_errors.remove(endpoint.name, reason)
                except KeyError:
                    pass
        for endpoint in added:
            self._start_task(endpoint.name)
        self._log_budget()

    def _log_budget(self) -> None:
        stretched = self.effective_interval() > self.interval
        if stretched != self._stretched:
            self._stretched = stretched
            if stretched:
                log.warning("%d endpoints exceed the scrape budget of %g/s: scraping every %.0f ms "
                            "instead of %.0f ms", len(self._tasks), self.max_scrapes_per_second,
                            self.effective_interval() * 1e3, self.interval * 1e3)
            else:
                log.info("scraping every %.0f ms again", self.interval * 1e3)

    def _start_task(self, name: str) -> None:
        old = self._tasks.get(name)
        if old is not None and not old.done():
            return
        self._tasks[name] = asyncio.get_running_loop().create_task(
            self._scrape_loop(name), name=f"scrape {name}")

    async def _scrape_loop(self, name: str) -> None:
        loop = asyncio.get_running_loop()
        first = True
        while True:
            started = loop.time()
            endpoint = self.registry.get(name)
            if endpoint is None:
                return
            reason = self._scrape_reason(endpoint)
            if reason is not None:
                self.scrapes.labels(reason).inc()
                try:
                    await self.scrape_once(endpoint)
                except Exception as exc:  # a bug must not end this endpoint's polling for good
                    log.exception("scrape of %s failed unexpectedly", name)
                    self._record_failure(endpoint, ScrapeFailure("internal", repr(exc)))
            # A random phase after the first scrape keeps many endpoints from polling in lockstep.
            interval = self.effective_interval()
            if first:
                delay = interval * random.random()
                first = False
            else:
                delay = max(0.0, started + interval - loop.time())
            await asyncio.sleep(delay)

    def _scrape_reason(self, endpoint: Endpoint) -> str | None:
        """Why this picker scrapes `endpoint` now; None when a peer's scrape of it is fresh enough."""
        if self.sharing is None or self.sharing.scrapes(endpoint.name):
            return "own"
        if endpoint.metrics.age() > _FALLBACK_INTERVALS * self.effective_interval():
            return "fallback"
        return None

    def _apply_peer_scrape(self, name: str, metrics: EndpointMetrics, age: float) -> None:
        """A peer's scrape: kept when newer than what this picker holds."""
        current = self.registry.get(name)
        if current is None:
            self.peer_scrapes.labels("unknown_endpoint").inc()
            return
        read_at = time.monotonic() - age
        if read_at <= current.metrics.update_time:
            self.peer_scrapes.labels("older").inc()
            return
        self.peer_scrapes.labels("applied").inc()
        # The endpoint answers the peer; where this picker's own scrapes are the share, they judge health.
        shared_out = self.sharing is not None and not self.sharing.scrapes(name)
        healthy = True if not current.healthy and shared_out else None
        if healthy:
            self._failures[name] = 0
            log.info("endpoint %s answers a peer's scrapes again: healthy", name)
        self.registry.update(name, metrics=dataclasses.replace(metrics, update_time=read_at), healthy=healthy)

    async def scrape_once(self, endpoint: Endpoint) -> bool:
        """Scrape one endpoint now and record the outcome; True on success."""
        t0 = time.perf_counter()
        try:
            page = await self._fetch(endpoint)
            values = parse_vllm_metrics(page)
            if self._dropped_fields:
                values = dataclasses.replace(values, **dict.fromkeys(self._dropped_fields))
            if not values.found_any:
                raise ScrapeFailure("no_metrics", "no vLLM series on the page")
            sleeping = None if values.sleeping is not None else await self._probe_sleeping(endpoint)
        except FetchFailure as failure:
            self.scrape_duration.observe(time.perf_counter() - t0)
            self._record_failure(endpoint, failure)
            return False
        self.scrape_duration.observe(time.perf_counter() - t0)
        self._failures[endpoint.name] = 0
        current = self.registry.get(endpoint.name)
        healthy = True if current is not None and not current.healthy else None
        if healthy:
            log.info("endpoint %s answers /metrics again: healthy", endpoint.name)
        metrics = to_endpoint_metrics(values, time.monotonic(), sleeping)
        self.registry.update(endpoint.name, metrics=metrics, healthy=healthy)
        if self.sharing is not None:
            self.sharing.publish_load(endpoint.name, metrics)
        return True

    async def _probe_sleeping(self, endpoint: Endpoint) -> bool:
        """`GET /is_sleeping` at most every `sleep_probe_interval`; the last answer in between."""
        probe = self._sleep_probes.setdefault(endpoint.name, _SleepProbe())
        now = time.monotonic()
        interval = self.sleep_probe_interval if probe.supported else _UNSUPPORTED_PROBE_INTERVAL_S
        if now - probe.checked_at < interval or self._session is None:
            return probe.sleeping
        probe.checked_at = now
        url = f"{self.scheme}://{endpoint.hostport}/is_sleeping"
        try:
            async with asyncio.timeout(self.timeout):
                async with self._session.get(url, allow_redirects=False, ssl=self._ssl_context or True) as response:
                    if response.status in (404, 405):
                        probe.supported, probe.sleeping = False, False
                        return False
                    if response.status != 200:
                        return probe.sleeping
                    answer = await response.json(content_type=None)
        except (TimeoutError, aiohttp.ClientError, OSError, ValueError) as exc:
            log.debug("GET %s failed: %r; keeping the last sleep state", url, exc)
            return probe.sleeping
        value = answer.get("is_sleeping") if isinstance(answer, dict) else None
        if isinstance(value, bool):
            probe.supported, probe.sleeping = True, value
        return probe.sleeping

    async def _fetch(self, endpoint: Endpoint) -> bytes:
        if not self._running:
            raise RuntimeError("MetricsScraper.start() was not called")
        port = endpoint.metrics_port or endpoint.port
        getter = self._getters.get(endpoint.name)
        if getter is None or (getter.host, getter.port) != (endpoint.address, port):
            if getter is not None:
                getter.close()
            getter = self._getters[endpoint.name] = KeepAliveGetter(
                endpoint.address, port, self.path, ssl_context=self._ssl_context, max_body_bytes=self.max_body_bytes)
        status, page = await getter.get(self.timeout)  # FetchFailure counts as a failed scrape
        if status != 200:
            raise ScrapeFailure("http_status", f"HTTP {status}")
        return page

    def _record_failure(self, endpoint: Endpoint, failure: FetchFailure) -> None:
        self.scrape_errors.labels(endpoint.name, failure.reason).inc()
        count = self._failures.get(endpoint.name, 0) + 1
        self._failures[endpoint.name] = count
        current = self.registry.get(endpoint.name)
        if count >= self.failure_threshold and current is not None and current.healthy:
            log.warning("endpoint %s failed %d scrapes in a row (%s): unhealthy",
                        endpoint.name, count, failure)
            self.registry.update(endpoint.name, healthy=False)
        else:
            log.debug("scrape of %s failed: %s", endpoint.name, failure)
