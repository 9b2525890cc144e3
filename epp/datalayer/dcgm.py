"""llm-d's GPU-utilization data: `dcgm-data-source` and `dcgm-extractor`.

`dcgm-data-source` scrapes NVIDIA's DCGM Exporter beside each endpoint (`scheme://<endpoint
address>:port/path`, default `http`, 9400, `/metrics`) every `interval` (1s) and hands the page to the
extractors `dataLayer.sources` pairs with it. `dcgm-extractor` reads `DCGM_FI_DEV_GPU_UTIL`, the
highest GPU of the endpoint (0-100, as a fraction), as the endpoint's attribute `GPUUtilization`,
published before scheduling under its own name (`<extractor>/GPUUtilization`, in
`ENDPOINT_ATTRIBUTES`, which `endpoint-attribute-filter` and `-scorer` read). An endpoint whose
scrape fails, or whose last page is older than three intervals, has no attribute.

With the exporter as a DaemonSet (`useNodeAddress: true`) llm-d scrapes the node and keeps the
samples of the endpoint's pod; here endpoints know neither their node nor their pod name, so the
exporter must run beside each endpoint (a sidecar, llm-d's default).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import ssl
import time
from collections.abc import Mapping, Sequence
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from epp.datalayer.http_get import FetchFailure, KeepAliveGetter
from epp.framework import (
    ConfigError,
    CycleState,
    DataProducer,
    Endpoint,
    InferenceRequest,
    Plugin,
    PluginContext,
    PluginParams,
    PluginRegistry,
)
from epp.scorers.endpoint_attributes import ENDPOINT_ATTRIBUTES

log = logging.getLogger(__name__)

GPU_UTIL_METRIC = "DCGM_FI_DEV_GPU_UTIL"
GPU_UTILIZATION = "GPUUtilization"
MAX_PAGE_BYTES = 8 << 20


def _fail(name: str, key: str, message: str) -> ConfigError:
    return ConfigError(f"plugin {name!r}: parameter {key!r} {message}")


def gpu_utilization(page: str) -> float | None:
    """The highest `DCGM_FI_DEV_GPU_UTIL` of a DCGM Exporter page, as a fraction; None without one."""
    values = [sample.value for family in text_string_to_metric_families(page) for sample in family.samples
              if sample.name == GPU_UTIL_METRIC and math.isfinite(sample.value)]
    return max(values) / 100.0 if values else None


class DcgmExtractor(DataProducer):
    """`GPUUtilization` of each endpoint from its DCGM Exporter page (the highest GPU, 0-1)."""

    type_name = "dcgm-extractor"

    def __init__(self, name: str, params: PluginParams | None = None, context: PluginContext | None = None) -> None:
        super().__init__(name)
        self.values: dict[str, tuple[float, float]] = {}  # endpoint -> (utilization, when)
        self.max_age_s = math.inf  # the paired source sets three of its intervals

    def produces(self) -> frozenset[str]:
        return frozenset({ENDPOINT_ATTRIBUTES})

    def extract(self, endpoint: str, page: str | None, now: float) -> None:
        value = gpu_utilization(page) if page is not None else None
        if value is None:
            self.values.pop(endpoint, None)
        else:
            self.values[endpoint] = (value, now)

    def forget(self, endpoint: str) -> None:
        self.values.pop(endpoint, None)

    async def prepare(self, state: CycleState, request: InferenceRequest, endpoints: Sequence[Endpoint]) -> None:
        now = time.monotonic()
        key = f"{self.name}/{GPU_UTILIZATION}"
        for ep in endpoints:
            found = self.values.get(ep.name)
            if found is None or now - found[1] > self.max_age_s:
                continue
            current = dict(state.endpoint_data(ENDPOINT_ATTRIBUTES, ep.name) or {})
            current[key] = found[0]
            state.put_endpoint_data(ENDPOINT_ATTRIBUTES, ep.name, current)

    def debug_state(self) -> Mapping[str, Any]:
        return {name: round(value, 3) for name, (value, _) in sorted(self.values.items())}


class DcgmDataSource(Plugin):
    """Scrapes each endpoint's DCGM Exporter and hands the page to its extractors."""

    type_name = "dcgm-data-source"

    def __init__(self, name: str, params: PluginParams, context: PluginContext) -> None:
        super().__init__(name)
        self.scheme = params.str("scheme", "http", choices=("http", "https"))
        self.path = params.str("path", "/metrics")
        if not self.path.startswith("/"):
            raise _fail(name, "path", f"must start with '/', got {self.path!r}")
        self.port = params.int("port", 9400, minimum=1)
        if self.port > 65535:
            raise _fail(name, "port", f"must be a port number, got {self.port}")
        self.insecure = params.bool("insecureSkipVerify", True)
        if params.bool("useNodeAddress", False):
            raise _fail(name, "useNodeAddress", "true is not supported: endpoints here know neither their node's "
                        "address nor their pod's name; run the DCGM Exporter beside each endpoint (a sidecar)")
        self.interval_s = params.duration("interval", 1.0)
        if self.interval_s <= 0:
            raise _fail(name, "interval", f"must be > 0, got {self.interval_s:g}s")
        self.extractors: list[DcgmExtractor] = []
        self._endpoints = context.endpoints
        self._getters: dict[str, KeepAliveGetter] = {}
        self._task: asyncio.Task[None] | None = None

    def describe(self) -> str:
        return f"{self.scheme}://<endpoint>:{self.port}{self.path} every {self.interval_s:g}s"

    def attach(self, extractors: Sequence[Plugin]) -> None:
        """The extractors `dataLayer.sources` pairs with this source."""
        for extractor in extractors:
            if isinstance(extractor, DcgmExtractor):
                extractor.max_age_s = 3 * self.interval_s
                self.extractors.append(extractor)

    async def start(self) -> None:
        if self._endpoints is not None and self.extractors:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for getter in self._getters.values():
            getter.close()
        self._getters.clear()

    def _getter(self, ep: Endpoint) -> KeepAliveGetter:
        getter = self._getters.get(ep.name)
        if getter is None:
            context = None
            if self.scheme == "https":
                context = ssl.create_default_context()
                if self.insecure:
                    context.check_hostname = False
                    context.verify_mode = ssl.CERT_NONE
            getter = self._getters[ep.name] = KeepAliveGetter(ep.address, self.port, self.path, ssl_context=context,
                                                              max_body_bytes=MAX_PAGE_BYTES)
        return getter

    async def scrape(self, ep: Endpoint) -> str | None:
        try:
            status, body = await self._getter(ep).get(timeout=min(self.interval_s, 5.0))
        except (FetchFailure, OSError) as exc:
            log.debug("DCGM scrape of %s failed: %s", ep.name, exc)
            return None
        return body.decode("utf-8", "replace") if status == 200 else None

    async def poll_once(self) -> None:
        assert self._endpoints is not None
        endpoints = self._endpoints.snapshot()
        current = {ep.name for ep in endpoints}
        for name in [n for n in self._getters if n not in current]:
            self._getters.pop(name).close()
            for extractor in self.extractors:
                extractor.forget(name)
        pages = await asyncio.gather(*(self.scrape(ep) for ep in endpoints))
        now = time.monotonic()
        for ep, page in zip(endpoints, pages, strict=True):
            for extractor in self.extractors:
                try:
                    extractor.extract(ep.name, page, now)
                except ValueError as exc:  # not Prometheus text
                    log.debug("DCGM page of %s unreadable: %s", ep.name, exc)
                    extractor.forget(ep.name)

    async def _run(self) -> None:
        while True:
            started = time.monotonic()
            try:
                await self.poll_once()
            except Exception:  # a broken poll must not end the loop
                log.exception("DCGM poll failed")
            await asyncio.sleep(max(0.0, self.interval_s - (time.monotonic() - started)))


def register(registry: PluginRegistry) -> None:
    """Entry point of the `epp.plugins` group: registers the DCGM source and its extractor."""
    registry.register_class(DcgmDataSource)
    registry.register_class(DcgmExtractor)
