"""The `/debug` routes of `epp serve --workers N`, on the supervisor's metrics port.

Each worker is a whole picker with its own state, serving the debug routes on its private
loopback metrics port. The supervisor gathers them: `GET /debug/state` lists every worker's page
(`null` for one that is restarting or does not answer), and `POST /debug/explain` is answered by
the first serving worker, named in the answer's `worker` field (workers share routing decisions
over their peer link, but each has its own in-flight ledger).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, Protocol

import aiohttp
from aiohttp import web

from epp.debug.http import OFF_MESSAGE


class WorkerState(Protocol):
    """What the supervisor's routes read of a worker (`epp.server.workers.WorkerState`)."""

    index: int
    pid: int | None
    serving: bool
    metrics_port: int | None


def add_debug_routes(app: web.Application, workers: Sequence[WorkerState], http: aiohttp.ClientSession, *,
                     enabled: bool) -> None:
    """The supervisor's `/debug` routes: its workers' answers when enabled, else 404 saying how to enable them."""
    if not enabled:
        async def off(_request: web.Request) -> web.Response:
            return web.json_response({"error": OFF_MESSAGE}, status=404)

        app.router.add_route("*", "/debug{tail:.*}", off)
        return

    async def worker_state(worker: WorkerState, query: str) -> Any:
        if not worker.serving:
            return None
        try:
            async with http.get(f"http://127.0.0.1:{worker.metrics_port}/debug/state{query}") as resp:
                return await resp.json() if resp.status == 200 else None
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return None

    async def state(request: web.Request) -> web.Response:
        query = f"?{request.query_string}" if request.query_string else ""  # `?plugin=NAME` goes on to each worker
        states = await asyncio.gather(*(worker_state(w, query) for w in workers))
        return web.json_response({"workers": [{"worker": w.index, "pid": w.pid if w.serving else None, "state": s}
                                              for w, s in zip(workers, states)]})

    async def explain(request: web.Request) -> web.Response:
        worker = next((w for w in workers if w.serving), None)
        if worker is None:
            return web.json_response({"error": "no worker is serving"}, status=503)
        try:
            async with http.post(f"http://127.0.0.1:{worker.metrics_port}/debug/explain", data=await request.read(),
                                 headers={"Content-Type": "application/json"}) as resp:
                status, answer = resp.status, await resp.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return web.json_response({"error": f"worker {worker.index} did not answer"}, status=503)
        if status == 200:
            answer["worker"] = worker.index
        return web.json_response(answer, status=status)

    app.router.add_get("/debug/state", state)
    app.router.add_post("/debug/explain", explain)
