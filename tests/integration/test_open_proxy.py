"""No Envoy config we ship lets a client choose its upstream (issue #18 item 1, open proxy).

The original input: `epp envoy-config --failure-mode-allow`, the picker down, and a body-less
`GET /v1/models` carrying the client's own `x-gateway-destination-endpoint: <host:port>`; the
ORIGINAL_DST cluster forwarded it there. Here the named host is a loopback listener the test
started, and it must never see a connection, in any mode, with the picker down or up.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest
import pytest_asyncio
import yaml

from epp.datalayer.registry import parse_endpoint_list
from epp.envoy import CLIENT_STRIPPED_HEADERS, RESPONSE_MODES, EnvoyProcess, render_config
from epp.server.runner import EppServer, ServeOptions
from tests.support.backends import EchoBackend
from tests.support.ports import free_port

pytestmark = [pytest.mark.envoy]
module_loop = pytest.mark.asyncio(loop_scope="module")

REPO = Path(__file__).resolve().parents[2]
FORGED = ("x-gateway-destination-endpoint", "x-gateway-destination-endpoint-served")


class Listener:
    """A loopback TCP listener that only counts the connections it accepts."""

    def __init__(self) -> None:
        self.connections = 0
        self.server: asyncio.Server | None = None
        self.port = 0

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 7\r\nx-backend: victim\r\n\r\nhijack!")
        await writer.drain()
        writer.close()

    @property
    def hostport(self) -> str:
        return f"127.0.0.1:{self.port}"


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def parts():
    victim, pool = Listener(), EchoBackend("pool")
    await victim.start()
    await pool.start()
    epp = EppServer(ServeOptions(grpc_port=0, grpc_health_port=0, metrics_port=0, bind_address="127.0.0.1",
                                 endpoints=parse_endpoint_list(pool.hostport), scrape_metrics=False,
                                 grace_period_s=1))
    await epp.start()
    yield victim, pool, epp
    await epp.stop(0)
    await pool.stop()
    victim.server.close()


async def _through_envoy(epp_port: int, requests, **config) -> list[tuple[int, str | None]]:
    listen, admin = free_port(), free_port()
    envoy = EnvoyProcess(render_config(listen_port=listen, admin_port=admin, epp_port=epp_port, **config), admin)
    await envoy.start()
    outcomes = []
    try:
        async with aiohttp.ClientSession() as session:
            for method, path, headers, body in requests:
                async with session.request(method, f"http://127.0.0.1:{listen}{path}", headers=headers,
                                           data=body) as r:
                    await r.read()
                    outcomes.append((r.status, r.headers.get("x-backend")))
    finally:
        await envoy.stop()
    return outcomes


def _forged_requests(victim: Listener):
    requests = []
    for header in FORGED:
        forged = {header: victim.hostport}
        requests.append(("GET", "/v1/models", forged, None))
        requests.append(("POST", "/v1/completions", {**forged, "content-type": "application/json"},
                         b'{"model":"m","prompt":"hi"}'))
    both = {name: victim.hostport for name in FORGED}
    requests.append(("GET", "/v1/models", both, None))
    return requests


@pytest.mark.parametrize("responses", RESPONSE_MODES)
@pytest.mark.parametrize("fail_open", [False, True], ids=["fail-closed", "failure-mode-allow"])
@module_loop
async def test_forged_destination_never_reaches_its_host_with_the_picker_down(parts, fail_open, responses):
    victim, _, _ = parts
    dead_picker = free_port()
    outcomes = await _through_envoy(dead_picker, _forged_requests(victim), failure_mode_allow=fail_open,
                                    responses=responses)
    assert victim.connections == 0
    # Nothing picked: Envoy has no upstream to use and answers itself, never with the victim's reply.
    assert all(status >= 500 and backend is None for status, backend in outcomes), outcomes


@pytest.mark.parametrize("responses", RESPONSE_MODES)
@pytest.mark.parametrize("fail_open", [False, True], ids=["fail-closed", "failure-mode-allow"])
@module_loop
async def test_forged_destination_is_replaced_by_the_pick_with_the_picker_up(parts, fail_open, responses):
    victim, pool, epp = parts
    before = len(pool.received)
    outcomes = await _through_envoy(epp.grpc_port, _forged_requests(victim), failure_mode_allow=fail_open,
                                    responses=responses)
    assert victim.connections == 0
    assert outcomes == [(200, "pool")] * len(outcomes)
    for seen in pool.received[before:]:
        assert seen["headers"]["x-gateway-destination-endpoint"] == pool.hostport
        assert "x-gateway-destination-endpoint-served" not in seen["headers"]


def _filters_of(config: dict) -> list[dict]:
    listeners = config["static_resources"]["listeners"]
    return [f for listener in listeners for chain in listener["filter_chains"] for hcm in chain["filters"]
            for f in hcm["typed_config"].get("http_filters", [])]


def _envoy_configs_in(path: Path) -> list[dict]:
    """Envoy bootstraps in a YAML file: the file itself, or embedded in a ConfigMap's data."""
    found = []
    for doc in yaml.safe_load_all(path.read_text()):
        if not isinstance(doc, dict):
            continue
        if "static_resources" in doc:
            found.append(doc)
        for value in (doc.get("data") or {}).values() if doc.get("kind") == "ConfigMap" else ():
            try:
                inner = yaml.safe_load(value)
            except yaml.YAMLError:
                continue
            if isinstance(inner, dict) and "static_resources" in inner:
                found.append(inner)
    return found


SHIPPED = sorted(str(p.relative_to(REPO)) for p in (REPO / "deploy").rglob("*.yaml"))


@pytest.mark.parametrize("source", ["rendered", *SHIPPED])
def test_every_shipped_config_strips_client_routing_headers_before_ext_proc(source):
    if source == "rendered":
        configs = [yaml.safe_load(render_config(failure_mode_allow=a, responses=b))
                   for a in (False, True) for b in RESPONSE_MODES]
    else:
        configs = _envoy_configs_in(REPO / source)
    assert set(FORGED) <= set(CLIENT_STRIPPED_HEADERS)
    for config in configs:
        filters = _filters_of(config)
        names = [f["name"] for f in filters]
        if "envoy.filters.http.ext_proc" not in names:
            continue
        strip = names.index("envoy.filters.http.header_mutation")
        assert strip < names.index("envoy.filters.http.ext_proc")
        removed = {m["remove"] for m in filters[strip]["typed_config"]["mutations"]["request_mutations"]}
        assert set(FORGED) <= removed
