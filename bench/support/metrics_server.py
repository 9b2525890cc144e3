"""A real loopback HTTP server serving a `/metrics` page that a test or benchmark can change, slow down or stop."""

from __future__ import annotations

import asyncio

from aiohttp import web


class MetricsServer:
    """Serves `page` at `/metrics` on `host` (127.0.0.1 by default); `status` and `delay` shape the answers."""

    def __init__(self, page: str = "", *, host: str = "127.0.0.1", port: int = 0) -> None:
        self.page = page
        self.host = host
        self.status = 200
        self.delay = 0.0
        self.hits = 0
        self.hit_times: list[float] = []
        self.port = port
        self._runner: web.AppRunner | None = None

    async def _metrics(self, request: web.Request) -> web.Response:
        self.hits += 1
        self.hit_times.append(asyncio.get_running_loop().time())
        if self.delay:
            await asyncio.sleep(self.delay)
        return web.Response(text=self.render(), status=self.status,
                            content_type="text/plain", charset="utf-8")

    def render(self) -> str:
        """The page to serve now: `page` (a subclass may build it per scrape)."""
        return self.page

    async def start(self) -> MetricsServer:
        """Listen on `port` (a free one when 0) the first time, on the same port after a stop()."""
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port, reuse_address=True)
        await site.start()
        self.port = self._runner.addresses[0][1]
        return self

    async def stop(self) -> None:
        """Stop answering: connections are refused until the next start()."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    @property
    def hostport(self) -> str:
        """host:port, as an endpoint list names it."""
        return f"{self.host}:{self.port}"
