"""Fixtures for the data-layer tests: real loopback `/metrics` servers, stopped after each test."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from bench.support.metrics_server import MetricsServer


@pytest.fixture
async def metrics_servers() -> AsyncIterator[Callable[[str], Awaitable[MetricsServer]]]:
    """Factory: `await metrics_servers(page)` starts a server; all are stopped at teardown."""
    started: list[MetricsServer] = []

    async def start(page: str = "") -> MetricsServer:
        server = await MetricsServer(page).start()
        started.append(server)
        return server

    yield start
    for server in started:
        await server.stop()
