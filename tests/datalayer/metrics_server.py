"""A real loopback HTTP server serving a `/metrics` page that a test can change, slow down or kill."""

from __future__ import annotations

import asyncio

from aiohttp import web


class MetricsServer:
    """Serves `page` at `/metrics` on 127.0.0.1; `status` and `delay` shape the answers."""

    def __init__(self, page: str = "") -> None:
        self.page = page
        self.status = 200
        self.delay = 0.0
        self.hits = 0
        self.hit_times: list[float] = []
        self.port = 0
        self._runner: web.AppRunner | None = None

    async def _metrics(self, request: web.Request) -> web.Response:
        self.hits += 1
        self.hit_times.append(asyncio.get_running_loop().time())
        if self.delay:
            await asyncio.sleep(self.delay)
        return web.Response(text=self.page, status=self.status,
                            content_type="text/plain", charset="utf-8")

    async def start(self) -> MetricsServer:
        """Listen on a free port the first time, on the same port after a stop()."""
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port, reuse_address=True)
        await site.start()
        self.port = self._runner.addresses[0][1]
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    @property
    def hostport(self) -> str:
        return f"127.0.0.1:{self.port}"
