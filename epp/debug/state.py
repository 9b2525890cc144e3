"""`GET /debug/state`: the running picker's state as JSON, never request content.

Read in two steps so that the event loop only does the reading: `collect_state` runs on the
loop (the plugins' `debug_state`, the ledger, each endpoint's in-flight load) and copies what
it reads into fresh containers; `render_state` turns that copy into JSON on the metrics server's
thread. Each plugin's part is bounded (`MAX_PLUGIN_STATE_BYTES`; larger is replaced by its size),
and a plugin whose `debug_state` fails shows the error's type, so one plugin cannot break the page.
`?plugin=NAME` gives that plugin's part alone, up to `MAX_NAMED_PLUGIN_STATE_BYTES` (a prediction
trace of thousands of picks is larger than a page's share).
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from epp.framework.load import EndpointLoad, InflightLedger
from epp.framework.types import Endpoint
from epp.logutil import log_failure
from epp.requestcontrol.pipeline import plugin_kinds

if TYPE_CHECKING:
    from epp.datalayer.registry import EndpointRegistry
    from epp.requestcontrol.pipeline import LoadedConfig

log = logging.getLogger(__name__)

# A plugin's part of the page at most (per-endpoint maps of a 2,000-endpoint pool fit).
MAX_PLUGIN_STATE_BYTES = 256 * 1024
# One plugin's part asked for by name: still bounded, since each plugin bounds its own state.
MAX_NAMED_PLUGIN_STATE_BYTES = 32 * 1024 * 1024
# Nesting kept of a plugin's state; deeper values are shown as their type name.
MAX_DEPTH = 6


def json_ready(value: Any, depth: int = 0) -> Any:
    """A copy of `value` that JSON can hold: mappings and sequences copied, non-finite floats as null."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if depth >= MAX_DEPTH:
        return f"<{type(value).__name__}>"
    if isinstance(value, Mapping):
        return {str(k): json_ready(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [json_ready(v, depth + 1) for v in value]
    return str(value)


@dataclass(frozen=True)
class StateSnapshot:
    """What `collect_state` read on the loop: copies and immutable snapshots only."""

    server: dict[str, Any]
    plugins: list[dict[str, Any]]
    ledger: dict[str, Any]
    flow_control: dict[str, Any] | None
    endpoints: tuple[Endpoint, ...]
    loads: tuple[EndpointLoad, ...]
    freshness_s: float | None
    read_at: float  # time.monotonic(), for the scrape ages


def _plugin_state(entry_name: str, plugin: Any) -> dict[str, Any]:
    try:
        return {"state": json_ready(plugin.debug_state())}
    except Exception as exc:  # one broken plugin must not take the page down
        log_failure(log, logging.ERROR, "debug_state of plugin %s failed", exc, entry_name)
        return {"error": f"debug_state failed: {type(exc).__name__}"}


def collect_state(pipeline: LoadedConfig, registry: EndpointRegistry, ledger: InflightLedger, *,
                  freshness_s: float | None, server: Mapping[str, Any]) -> StateSnapshot:
    """Read the picker's state (on the event loop: plugins change their structures only there)."""
    plugins = [{"name": entry.name, "type": entry.type_name, "kinds": plugin_kinds(entry.plugin),
                **_plugin_state(entry.name, entry.plugin)} for entry in pipeline.plugins]
    controller = pipeline.flow_controller
    endpoints = registry.snapshot()
    now = time.monotonic()
    return StateSnapshot(
        server=json_ready(server), plugins=plugins, ledger=json_ready(ledger.debug_state()),
        flow_control=json_ready(controller.debug_state()) if controller is not None else None,
        endpoints=endpoints, loads=tuple(ledger.load(ep, now) for ep in endpoints),
        freshness_s=freshness_s, read_at=now)


def _endpoint(ep: Endpoint, load: EndpointLoad, freshness_s: float | None, now: float) -> dict[str, Any]:
    m = ep.metrics
    age = m.age(now)
    return {
        "endpoint": ep.name,
        "healthy": ep.healthy,
        "labels": dict(ep.labels),
        "metrics": {
            "waiting_queue_size": m.waiting_queue_size, "running_requests_size": m.running_requests_size,
            "kv_cache_usage": m.kv_cache_usage, "cache_block_size": m.cache_block_size,
            "cache_num_blocks": m.cache_num_blocks, "active_models": sorted(m.active_models),
            "waiting_models": sorted(m.waiting_models), "max_active_models": m.max_active_models,
            "sleeping": m.sleeping,
        },
        "scrape_age_s": round(age, 3) if math.isfinite(age) else None,
        # Whether the director counts it as fresh (None: the picker does not scrape).
        "fresh": None if freshness_s is None else age <= freshness_s,
        "inflight": {
            "requests": load.inflight_requests, "unseen_requests": load.unseen_requests,
            "prefilling_requests": load.prefilling_requests, "prefill_tokens": load.prefill_tokens,
            "prefill_backlog_tokens": round(load.prefill_backlog_tokens, 1),
            "prefill_backlog_requests": round(load.prefill_backlog_requests, 3),
        },
    }


def _bounded(plugin: dict[str, Any], limit: int) -> dict[str, Any]:
    if "state" not in plugin:
        return plugin
    size = len(json.dumps(plugin["state"]))
    if size <= limit:
        return plugin
    return {**plugin, "state": {"truncated": True, "bytes": size, "limit_bytes": limit}}


def plugin_names(snapshot: StateSnapshot) -> list[str]:
    """The names of the plugins whose state the snapshot holds, in config order."""
    return [p["name"] for p in snapshot.plugins]


def render_state(snapshot: StateSnapshot, plugin: str | None = None) -> bytes:
    """The `/debug/state` document, or with `plugin` one plugin's part alone (safe on any thread: the
    snapshot shares nothing with the loop)."""
    if plugin is not None:
        named = [_bounded(p, MAX_NAMED_PLUGIN_STATE_BYTES) for p in snapshot.plugins if p["name"] == plugin]
        return json.dumps({"server": snapshot.server, "plugins": named}, indent=1).encode()
    document = {
        "server": snapshot.server,
        "plugins": [_bounded(p, MAX_PLUGIN_STATE_BYTES) for p in snapshot.plugins],
        "endpoints": [_endpoint(ep, load, snapshot.freshness_s, snapshot.read_at)
                      for ep, load in zip(snapshot.endpoints, snapshot.loads)],
        "inflight_ledger": snapshot.ledger,
        "flow_control": snapshot.flow_control,
    }
    return json.dumps(document, indent=1).encode()


def server_summary(pipeline: LoadedConfig, *, ready: bool, draining: bool) -> dict[str, Any]:
    """The `server` part: which process, which config, and whether it takes traffic."""
    return {"pid": os.getpid(), "config": pipeline.source, "ready": ready, "draining": draining,
            "profiles": list(pipeline.scheduler.profiles)}
