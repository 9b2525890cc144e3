"""Suite-wide hooks: markers applied from the fixtures and processes that need them, and each
marker's requirement checked before its tests run (tests/support/require.py)."""

from __future__ import annotations

import pytest
import pytest_asyncio

from bench.support.k8s_apiserver import FakeApiServer
from tests.support.markers import FIXTURE_MARKERS, PROCESS_MARKERS, SpawnWatch
from tests.support.require import REQUIREMENTS, require

_spawns = SpawnWatch()


def pytest_configure(config: pytest.Config) -> None:
    _spawns.install()


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        for fixture in set(getattr(item, "fixturenames", ())) & FIXTURE_MARKERS.keys():
            item.add_marker(FIXTURE_MARKERS[fixture])


def pytest_runtest_setup(item: pytest.Item) -> None:
    _spawns.take()  # whatever an earlier test left running started is not this test's
    require(*(name for name in REQUIREMENTS if item.get_closest_marker(name) is not None))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> pytest.TestReport:
    report = yield
    unmarked = sorted(m for m in _spawns.take() if m in PROCESS_MARKERS and item.get_closest_marker(m) is None)
    if unmarked:
        message = (f"{item.nodeid} started {', '.join(unmarked)} but is not marked "
                   f"{' / '.join(f'@pytest.mark.{m}' for m in unmarked)}: mark it (or its module) so "
                   f"`-m \"not {unmarked[0]}\"` leaves it out")
        if report.passed:
            report.outcome = "failed"
            report.longrepr = message
        else:
            report.sections.append(("unmarked real processes", message))
    return report


@pytest_asyncio.fixture
async def api():
    """A local Kubernetes API server (bench/support/k8s_apiserver.py)."""
    server = FakeApiServer(bookmark_interval=0.2)
    await server.start()
    yield server
    await server.stop()


@pytest.fixture
def kubeconfig(api, tmp_path) -> str:
    """A kubeconfig pointing at `api`."""
    return api.write_kubeconfig(str(tmp_path / "kubeconfig"))
