"""HTTP side of the disk-tier manager: /metrics, /ready (for probes) and /status."""

from __future__ import annotations

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from epp.engine.disk_tier.manager import DiskTierManager


def build_app(manager: DiskTierManager) -> web.Application:
    """An aiohttp app serving the manager's metrics and readiness.

    /ready is 200 once the first scan finished, whether the tier is healthy or skipped: a
    failed disk must not take the replica out of service (vLLM recomputes instead). The body
    says which; alerting uses `epp_disk_tier_healthy`.
    """

    async def metrics(_request: web.Request) -> web.Response:
        body = generate_latest(manager.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def ready(_request: web.Request) -> web.Response:
        status = 200 if manager.ready.is_set() else 503
        return web.json_response(manager.status(), status=status)

    async def status(_request: web.Request) -> web.Response:
        return web.json_response(manager.status())

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/ready", ready)
    app.router.add_get("/status", status)
    return app
