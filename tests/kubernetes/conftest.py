"""Fixtures: a local API server (bench/support/k8s_apiserver.py) and a kubeconfig pointing at it."""

from __future__ import annotations

import pytest
import pytest_asyncio

from bench.support.k8s_apiserver import FakeApiServer


@pytest_asyncio.fixture
async def api():
    server = FakeApiServer(bookmark_interval=0.2)
    await server.start()
    yield server
    await server.stop()


@pytest.fixture
def kubeconfig(api, tmp_path) -> str:
    return api.write_kubeconfig(str(tmp_path / "kubeconfig"))
