"""Builders for scheduling tests: endpoints with given metrics, requests, plugins, and one full cycle."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

from epp.config import LoadedConfig
from epp.framework import (
    ApiKind,
    CycleState,
    Endpoint,
    EndpointMetrics,
    InferenceRequest,
    PluginContext,
    PluginRegistry,
    SchedulingResult,
)
from epp.scorers import register_builtin_plugins


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
            headers: Mapping[str, str] | None = None, api: ApiKind = ApiKind.COMPLETIONS,
            body: Mapping[str, Any] | None = None, cache_salt: str | None = None,
            request_id: str = "req-1") -> InferenceRequest:
    """A completions request for `prompt` (or any API with an explicit body)."""
    if body is None:
        body = {"model": model, "prompt": prompt}
    return InferenceRequest(request_id=request_id, api=api, model=model, target_model=target or model,
                            body=body, headers=dict(headers or {}), cache_salt=cache_salt)


def builtin_registry() -> PluginRegistry:
    registry = PluginRegistry()
    register_builtin_plugins(registry)
    return registry


def make_plugin(type_name: str, parameters: Mapping[str, Any] | None = None, *, name: str | None = None,
                context: PluginContext | None = None):
    """A built-in plugin instance, built through the registry exactly as the loader does."""
    return builtin_registry().build(type_name, name or type_name, parameters, context or PluginContext())


async def run_cycle(loaded: LoadedConfig, req: InferenceRequest,
                    endpoints: Sequence[Endpoint]) -> tuple[SchedulingResult, CycleState]:
    """Producers, scheduler and pre-request hooks, as the director runs them for one request."""
    state = CycleState()
    for producer in loaded.data_producers:
        await producer.prepare(state, req, endpoints)
    for admitter in loaded.admitters:
        admitter.admit(state, req, endpoints)
    result = loaded.scheduler.schedule(state, req, endpoints)
    for hook in loaded.pre_request_hooks:
        hook.pre_request(state, req, result)
    return result, state
