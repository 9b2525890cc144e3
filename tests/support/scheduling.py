"""Builders for scheduling tests: endpoints with given metrics, requests, plugins, and the real director."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

from prometheus_client import CollectorRegistry

from epp.config import LoadedConfig, load_config_text, load_default_config
from epp.datalayer.registry import EndpointRegistry, EndpointSpec
from epp.framework import (
    CycleState,
    Endpoint,
    EndpointMetrics,
    InferenceRequest,
    PluginContext,
    PluginRegistry,
    ResponseInfo,
    SchedulingResult,
)
from epp.framework.registry import default_registry
from epp.metrics import EppMetrics
from epp.requestcontrol.director import Director
from tests.support.requests import format_of


def endpoint(idx: int, queue: int = 0, kv: float = 0.0, active: Sequence[str] = (), waiting: Sequence[str] = (),
             *, running: int = 0, max_active: int = 0, labels: Mapping[str, str] | None = None, port: int = 8000,
             block_size: int = 0, num_blocks: int = 0) -> Endpoint:
    """Endpoint `192.168.1.<idx+1>:<port>` with the given metrics (GIE integration-test style `P(idx, q, kv)`)."""
    return Endpoint(
        f"192.168.1.{idx + 1}", port, MappingProxyType(dict(labels or {})),
        EndpointMetrics(waiting_queue_size=queue, running_requests_size=running, kv_cache_usage=kv,
                        active_models=frozenset(active), waiting_models=frozenset(waiting),
                        max_active_models=max_active, cache_block_size=block_size, cache_num_blocks=num_blocks,
                        update_time=1.0))


def request(prompt: Any = "hello", *, model: str = "my-model", target: str | None = None,
            headers: Mapping[str, str] | None = None, api: str = "completions",
            body: Mapping[str, Any] | None = None, cache_salt: str | None = None,
            request_id: str = "req-1") -> InferenceRequest:
    """A completions request for `prompt` (or any API with an explicit body)."""
    if body is None:
        body = {"model": model, "prompt": prompt}
    return InferenceRequest(request_id=request_id, api=api, model=model, target_model=target or model,
                            body=body, headers=dict(headers or {}), cache_salt=cache_salt, format=format_of(api))


def builtin_registry() -> PluginRegistry:
    """Every plugin this package installs (its `epp.plugins` entry points), as `epp serve` sees them."""
    return default_registry()


def make_plugin(type_name: str, parameters: Mapping[str, Any] | None = None, *, name: str | None = None,
                context: PluginContext | None = None):
    """A built-in plugin instance, built through the registry exactly as the loader does."""
    return builtin_registry().build(type_name, name or type_name, parameters, context or PluginContext())


class DirectorHarness:
    """The real `Director` over a config loaded here, driven without gRPC.

    Wired as `epp serve` wires its request path (the loaded config is the pipeline). Its plugins
    get this harness's context: its endpoint registry (the pool each request sees) and the
    in-flight ledger the director books picks in.
    """

    def __init__(self, config_text: str | None = None, *, plugins: PluginRegistry | None = None,
                 metrics_registry: CollectorRegistry | None = None, source: str = "test.yaml") -> None:
        self.endpoints = EndpointRegistry()
        self.metrics = EppMetrics(metrics_registry)
        self.context = PluginContext(metrics_registry=self.metrics.registry, endpoints=self.endpoints)
        plugins = plugins or builtin_registry()
        self.loaded: LoadedConfig = (
            load_default_config(registry=plugins, context=self.context) if config_text is None else
            load_config_text(config_text, source=source, registry=plugins, context=self.context))
        self.director = Director(self.loaded, self.endpoints, self.metrics, ledger=self.context.load)

    def set_pool(self, endpoints: Sequence[Endpoint]) -> None:
        """Make `endpoints` (with their metrics and health) the whole pool, in this order."""
        self.endpoints.set_endpoints(EndpointSpec(ep.address, ep.port, ep.labels, ep.metrics_port) for ep in endpoints)
        for ep in endpoints:
            self.endpoints.update(ep.name, metrics=ep.metrics, healthy=ep.healthy)

    async def pick(self, req: InferenceRequest,
                   endpoints: Sequence[Endpoint] | None = None) -> tuple[SchedulingResult, CycleState]:
        """Schedule `req` over `endpoints` (default: the pool as it is); its booking stays in flight."""
        if endpoints is not None:
            self.set_pool(endpoints)
        state = CycleState()
        return await self.director.schedule(state, req), state

    def answer(self, state: CycleState, req: InferenceRequest, result: SchedulingResult) -> None:
        """The picked endpoint's whole response came back: the director's completion path."""
        target = result.targets[0]
        self.director.response_complete(
            state, req, ResponseInfo(status="200", served_endpoint=target.hostport, end_of_stream=True), target)

    async def cycle(self, req: InferenceRequest,
                    endpoints: Sequence[Endpoint] | None = None) -> tuple[SchedulingResult, CycleState]:
        """One whole request: picked, then answered before it returns, as for a client that sends
        one request at a time (no booking of an earlier request weighs on the next pick)."""
        result, state = await self.pick(req, endpoints)
        self.answer(state, req, result)
        return result, state
