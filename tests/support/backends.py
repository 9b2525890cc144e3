"""Small real HTTP backends for protocol tests: echo JSON, SSE streams, all on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from aiohttp import web

from tests.support.ports import free_port


class EchoBackend:
    """An OpenAI-shaped backend that reports what it received and who it is (header `x-backend`)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.port = free_port()
        self.received: list[dict] = []
        self._runner: web.AppRunner | None = None

    @property
    def hostport(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self) -> None:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/{tail:.*}", self.handle)
        app.router.add_get("/{tail:.*}", self.handle_get)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def handle_get(self, request: web.Request) -> web.Response:
        return web.json_response({"backend": self.name, "path": request.path}, headers={"x-backend": self.name})

    async def handle(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        body = json.loads(raw)
        self.received.append({"path": request.path, "headers": dict(request.headers), "size": len(raw)})
        if body.get("stream"):
            resp = web.StreamResponse(headers={"content-type": "text/event-stream", "x-backend": self.name})
            await resp.prepare(request)
            for i in range(int(body.get("events", 3))):
                event = {"model": body["model"], "choices": [{"index": 0, "text": f"t{i}"}], "sent": time.time()}
                await resp.write(f"data: {json.dumps(event)}\n\n".encode())
                await asyncio.sleep(float(body.get("delay", 0.2)))
            usage = {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3}}
            await resp.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
            await resp.write_eof()
            return resp
        return web.json_response(
            {"backend": self.name, "model": body.get("model"), "size": len(raw),
             "sha256": hashlib.sha256(raw).hexdigest(),
             "usage": {"prompt_tokens": 5, "completion_tokens": 1}},
            headers={"x-backend": self.name})


@contextlib.asynccontextmanager
async def completions_backend(
        handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> AsyncIterator[str]:
    """`handler` answering `POST /v1/completions` on a free loopback port; yields its base URL."""
    app = web.Application()
    app.router.add_post("/v1/completions", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    finally:
        await runner.cleanup()
