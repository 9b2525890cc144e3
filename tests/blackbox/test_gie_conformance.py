"""GIE v1.6's conformance behaviours through an endpoint picker, as our own black-box tests.

GIE's suite (`conformance/tests/*.go`) runs against a gateway in a cluster, with GIE's own test
picker. Here the gateway is a real Envoy rendered from the InferencePool object the way
`epp envoy-config --inference-pool` does it, the picker is ours with the test plugins GIE's picker
has (`header-based-testing-filter`, `destination-endpoint-served-verifier`), the cluster is the
local API server (bench/support/k8s_apiserver.py) and the pods are real HTTP servers on loopback
addresses. Each test's docstring names the suite test it mirrors; docs/inferencepool.md maps them.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import urllib.request
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from bench.support.k8s_apiserver import FakeApiServer, inference_pool, pod
from epp.config.compose import endpoint_picker_config
from epp.datalayer.inference_pool import envoy_options, pool_view_of
from epp.engine.sim import FleetConfig, SimFleet
from epp.engine.sim.fleet import default_tokenizer_dir
from epp.envoy import EnvoyProcess, render_config
from epp.netutil import free_ports
from epp.server.runner import EppServer, ServeOptions
from tests.support.pods import common_free_port, pod_address
from tests.support.wait import wait_until

pytestmark = [pytest.mark.envoy]

SELECTION = "test-epp-endpoint-selection"
SERVED = "x-conformance-test-served-endpoint"
# GIE's conformance picker: keep what the selection header lists, pick one of those.
CONFORMANCE_CONFIG = endpoint_picker_config(
    ["header-based-testing-filter", "random-picker", "destination-endpoint-served-verifier"],
    ["header-based-testing-filter", "random-picker"])
BODY = json.dumps({"model": "conformance-fake-model",
                   "prompt": "Answer with no disclaimers: What are the advantages of genetically modified food?"})


class EchoPort:
    """One model-server port of a pod (a data-parallel rank): answers with the pod and port that served."""

    def __init__(self, pod_name: str, ip: str, port: int) -> None:
        self.pod_name, self.ip, self.port = pod_name, ip, port
        self.hits = 0
        self._runner: web.AppRunner | None = None

    @property
    def hostport(self) -> str:
        return f"{self.ip}:{self.port}"

    async def start(self) -> EchoPort:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.ip, self.port).start()
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _handle(self, request: web.Request) -> web.Response:
        await request.read()
        self.hits += 1
        return web.json_response({"pod": self.pod_name, "httpPort": self.port})


@dataclass
class Reply:
    status: int
    pod: str | None
    port: int | None
    served: str | None


@pytest.fixture
async def servers():
    """Start EchoPorts as the test asks for them; all stopped at the end."""
    started: list[EchoPort] = []

    async def start(pod_name: str, ip: str, ports: Sequence[int]) -> list[EchoPort]:
        ranks = [await EchoPort(pod_name, ip, port).start() for port in ports]
        started.extend(ranks)
        return ranks

    yield start
    for server in started:
        await server.stop()


class Gateway:
    """The picker serving one InferencePool, and an Envoy rendered from that pool in front of it."""

    def __init__(self, epp: EppServer, envoy: EnvoyProcess, port: int) -> None:
        self.epp, self.envoy, self.url = epp, envoy, f"http://127.0.0.1:{port}/v1/completions"
        self.picker_up = True

    async def stop_picker(self) -> None:
        """The picker goes away (as the suite makes the picker's Service unavailable)."""
        self.picker_up = False
        await self.epp.stop(0)

    async def restart_picker(self) -> None:
        """A new picker on the same port, serving the same pool."""
        self.epp = EppServer(dataclasses.replace(self.epp.options, grpc_port=self.epp.grpc_port))
        await self.epp.start()
        self.picker_up = True
        await wait_until(self.epp.is_ready, "the new picker to list the pool's pods")

    async def send(self, session: aiohttp.ClientSession, selection: str | None = None,
                   headers: dict[str, str] | None = None) -> Reply:
        sent = {"content-type": "application/json", **(headers or {})}
        if selection is not None:
            sent[SELECTION] = selection
        async with session.post(self.url, data=BODY, headers=sent) as r:
            answer = await r.json(content_type=None) if r.status == 200 else {}
            return Reply(r.status, answer.get("pod"), answer.get("httpPort"), r.headers.get(SERVED))

    async def send_many(self, session: aiohttp.ClientSession, selection: str, total: int = 30,
                        concurrency: int = 10) -> list[Reply]:
        """`total` requests, `concurrency` at a time (the suite sends 100, 10 at a time)."""
        gate = asyncio.Semaphore(concurrency)

        async def one() -> Reply:
            async with gate:
                return await self.send(session, selection)

        return list(await asyncio.gather(*(one() for _ in range(total))))


@contextlib.asynccontextmanager
async def gateway(api: FakeApiServer, kubeconfig: str, pool: dict[str, Any], secure: bool = False,
                  scrape: bool = False, **envoy_overrides: Any) -> AsyncIterator[Gateway]:
    """Apply `pool`, serve it with the picker (over TLS if `secure`, scraping `/metrics` if
    `scrape`), and put Envoy in front as the pool asks (plus `envoy_overrides`)."""
    api.apply(pool)
    epp = EppServer(ServeOptions(
        grpc_port=0, grpc_health_port=0, metrics_port=0, bind_address="127.0.0.1",
        pool_name=pool["metadata"]["name"], pool_namespace=pool["metadata"]["namespace"],
        kubeconfig=kubeconfig, config_text=CONFORMANCE_CONFIG, scrape_metrics=scrape,
        grace_period_s=1, secure_serving=secure))
    await epp.start()
    options = envoy_options(pool_view_of(pool), pool["metadata"]["namespace"])
    # The picker listens on loopback here, not at the Service the ref names.
    options.update(epp_host="127.0.0.1", epp_port=epp.grpc_port, epp_tls=secure, **envoy_overrides)
    listen, admin = free_ports(2)
    envoy = EnvoyProcess(render_config(listen_port=listen, admin_port=admin, **options), admin)
    gw: Gateway | None = None
    try:
        await envoy.start()
        await wait_until(epp.is_ready, "the picker to list the pool's pods")
        gw = Gateway(epp, envoy, listen)
        yield gw
    finally:
        await envoy.stop()
        if gw is None or gw.picker_up:
            await (gw.epp if gw else epp).stop(0)


def envoy_stat(envoy: EnvoyProcess, name: str) -> int:
    """One counter from Envoy's admin `/stats` (0 if absent)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{envoy.admin_port}/stats?filter=^{name}$", timeout=2) as r:
        text = r.read().decode()
    return int(text.partition(": ")[2] or 0)


def apply_pods(api: FakeApiServer, names_and_ips: Iterable[tuple[str, str]]) -> None:
    """Ready pods labelled app=vllm (the pools' selector) at these IPs."""
    for name, ip in names_and_ips:
        api.apply(pod(name, ip))


def pool_of(ports: Sequence[int], **spec: Any) -> dict[str, Any]:
    pool = inference_pool("pool", {"app": "vllm"}, ports)
    pool["spec"].update(spec)
    return pool


async def three_pods(api: FakeApiServer, servers, ports_per_pod: int = 1) -> tuple[list[str], list[int]]:
    """Pods p0-p2 at 127.0.0.2-4, each serving the same `ports_per_pod` ports; (IPs, ports)."""
    ips = [pod_address(i) for i in range(3)]
    ports: list[int] = []
    while len(ports) < ports_per_pod:
        port = common_free_port(ips)
        if port not in ports:
            ports.append(port)
    for i, ip in enumerate(ips):
        await servers(f"p{i}", ip, ports)
    apply_pods(api, ((f"p{i}", ip) for i, ip in enumerate(ips)))
    return ips, ports


async def test_traffic_reaches_only_the_pods_the_picker_returned(api, kubeconfig, servers):
    """Mirrors GatewayFollowingEPPRouting: the picker returns one, two or all pods (selection
    header with pod IPs) and every request is served by one of those pods only."""
    ips, [port] = await three_pods(api, servers)
    async with gateway(api, kubeconfig, pool_of([port])) as gw, aiohttp.ClientSession() as session:
        for i, ip in enumerate(ips):  # each pod alone first, as the suite's warm-up does
            assert (await gw.send(session, ip)).pod == f"p{i}"
        for chosen in ([2], [0, 1], [0, 1, 2]):
            replies = await gw.send_many(session, ",".join(ips[i] for i in chosen))
            assert {r.status for r in replies} == {200}
            assert {r.pod for r in replies} <= {f"p{i}" for i in chosen}
        assert {r.pod for r in replies} == {"p0", "p1", "p2"}  # 30 requests over three pods reach all


async def test_the_served_endpoint_is_reported_as_pod_ip_and_port(api, kubeconfig, servers):
    """Mirrors GatewayDestinationEndpointServed: Envoy reports where it sent the request
    (`envoy.lb` metadata on the response) and the picker echoes it in
    `x-conformance-test-served-endpoint`, which equals `podIP:port` of the selected pod."""
    ips, [port] = await three_pods(api, servers)
    async with gateway(api, kubeconfig, pool_of([port])) as gw, aiohttp.ClientSession() as session:
        for i, ip in enumerate(ips):
            reply = await gw.send(session, ip)
            assert (reply.status, reply.pod, reply.served) == (200, f"p{i}", f"{ip}:{port}")
        # A client cannot write the served endpoint: its copy is stripped before ext_proc.
        reply = await gw.send(session, ips[0], {"x-gateway-destination-endpoint-served": "10.9.9.9:1"})
        assert reply.served == f"{ips[0]}:{port}"


async def test_data_parallel_ranks_are_routed_per_rank(api, kubeconfig, servers):
    """Mirrors GatewayFollowingEPPRoutingWithDataParallelism: three targetPorts (DP ranks) per pod;
    the picker returns a pod (any rank), a pod's one rank, or pods with some ranks, and each request
    reaches exactly the pod and port the picker chose (the served echo equals the server's own
    address)."""
    ips, ports = await three_pods(api, servers, ports_per_pod=3)
    p3000, p3002, p3004 = ports
    async with gateway(api, kubeconfig, pool_of(ports)) as gw, aiohttp.ClientSession() as session:
        assert len(gw.epp.endpoints) == 9  # one endpoint per pod and rank
        cases = [
            # (selection, {ip: ports allowed})
            (ips[1], {ips[1]: set(ports)}),
            (f"{ips[0]},{ips[2]}:{p3002}", {ips[0]: set(ports), ips[2]: {p3002}}),
            (f"{ips[0]},{ips[1]}:{p3000},{ips[1]}:{p3004},{ips[2]}",
             {ips[0]: set(ports), ips[1]: {p3000, p3004}, ips[2]: set(ports)}),
        ]
        for selection, allowed in cases:
            replies = await gw.send_many(session, selection)
            assert {r.status for r in replies} == {200}, selection
            for r in replies:
                ip = ips[int(r.pod[1:])]
                assert r.port in allowed.get(ip, ()), (selection, r)
                assert r.served == f"{ip}:{r.port}"  # Envoy went where the picker said
        # A pod named by IP alone is three endpoints: every rank of it gets requests.
        replies = await gw.send_many(session, ips[1])
        assert {(r.pod, r.port) for r in replies} == {("p1", port) for port in ports}


H2C_FRONT = """\
static_resources:
  listeners:
  - name: model-server
    address: {{ socket_address: {{ address: {ip}, port_value: {port} }} }}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: model_server
          codec_type: AUTO
          route_config:
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:
              - match: {{ prefix: "/" }}
                route: {{ cluster: sim, timeout: 0s }}
              response_headers_to_add:
              - header: {{ key: x-model-server-protocol, value: "%PROTOCOL%" }}
          http_filters:
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
  clusters:
  - name: sim
    type: STATIC
    connect_timeout: 2s
    load_assignment:
      cluster_name: sim
      endpoints:
      - lb_endpoints:
        - endpoint: {{ address: {{ socket_address: {{ address: 127.0.0.1, port_value: {sim_port} }} }} }}
admin:
  address: {{ socket_address: {{ address: 127.0.0.1, port_value: {admin_port} }} }}
"""


@pytest.mark.parametrize("app_protocol, seen", [("kubernetes.io/h2c", "HTTP/2"), ("http", "HTTP/1.1"),
                                                (None, "HTTP/1.1")])
async def test_the_pool_app_protocol_is_what_the_model_server_sees(api, kubeconfig, app_protocol, seen):
    """Mirrors InferencePoolAppProtocol: `kubernetes.io/h2c` and `http` are honoured and an omitted
    appProtocol means HTTP/1.1. The model server is the vLLM simulator behind a real Envoy that
    accepts HTTP/1.1 and HTTP/2 with prior knowledge (h2c) on one port and reports which one it was
    spoken to in; the picker scrapes its `/metrics` over HTTP/1.1 on the same port either way."""
    async with SimFleet(FleetConfig(replicas=1, tokenizer_dir=default_tokenizer_dir(), kv_events=False,
                                    kv_replay=False)) as fleet:
        ip = pod_address(0)
        [port] = free_ports(1, ip)
        sim_port = int(fleet.endpoints[0].rpartition(":")[2])
        front_admin = free_ports(1)[0]
        front = EnvoyProcess(H2C_FRONT.format(ip=ip, port=port, sim_port=sim_port, admin_port=front_admin),
                             front_admin)
        await front.start()
        apply_pods(api, [("sim-0", ip)])
        spec = {} if app_protocol is None else {"appProtocol": app_protocol}
        pool = pool_of([port], **spec)
        try:
            async with gateway(api, kubeconfig, pool, scrape=True) as gw, aiohttp.ClientSession() as session:
                def scraped() -> bool:
                    endpoint = gw.epp.endpoints.get(f"{ip}:{port}")
                    return endpoint is not None and endpoint.healthy and endpoint.metrics.update_time > 0
                await wait_until(scraped, "the picker to scrape the model server through its h2c-capable port")
                body = {"model": "sim-model", "prompt": "Describe San Francisco in one sentence.", "max_tokens": 4}
                async with session.post(gw.url, json=body, headers={SELECTION: f"{ip}:{port}"}) as r:
                    assert r.status == 200, await r.text()
                    assert r.headers["x-model-server-protocol"] == seen
                    assert r.headers[SERVED] == f"{ip}:{port}"
                    assert (await r.json())["choices"][0]["text"]
        finally:
            await front.stop()


async def test_a_pool_without_an_endpoint_picker_ref_is_served(api, kubeconfig, servers):
    """Mirrors InferencePoolMissingEPPRef: `endpointPickerRef` is optional since v1.6; our discovery
    accepts such a pool (no error, ready) and requests are routed. The Envoy it renders fails closed
    (the default) and reaches the picker at the address the operator gives."""
    ips, [port] = await three_pods(api, servers)
    pool = pool_of([port])
    del pool["spec"]["endpointPickerRef"]
    assert envoy_options(pool_view_of(pool), "default") == {"upstream_protocol": "http",
                                                             "failure_mode_allow": False}
    async with gateway(api, kubeconfig, pool) as gw, aiohttp.ClientSession() as session:
        assert gw.epp.is_ready()
        assert (await gw.send(session, ips[2])).pod == "p2"


def fail_mode_pool(port: int, mode: str) -> dict[str, Any]:
    return pool_of([port], endpointPickerRef={"name": "epp", "port": {"number": 9002}, "failureMode": mode})


async def test_fail_open_keeps_requests_flowing_while_the_picker_is_down(api, kubeconfig, servers):
    """Mirrors EppUnAvailableFailOpen: with `failureMode: FailOpen`, requests still succeed after
    the picker goes away, served by the pool's pods. What Envoy (1.40, FULL_DUPLEX_STREAMED bodies)
    really does: the one request that finds the picker gone fails closed (500: its body was already
    streamed to the picker); Envoy then keeps the picker out and every later request fails open
    (the suite, too, only expects success eventually). When the picker is back, it picks again. A
    request that names its own destination gets no upstream, picker or not."""
    ips, [port] = await three_pods(api, servers)
    outsider_ip = pod_address(5)
    [outsider] = await servers("outsider", outsider_ip, free_ports(1, outsider_ip))  # not in the pool
    fail_open_to = [f"{ip}:{port}" for ip in ips]  # a headless Service of the pool, in a cluster
    async with gateway(api, kubeconfig, fail_mode_pool(port, "FailOpen"), fail_open_endpoints=fail_open_to) as gw, \
            aiohttp.ClientSession() as session:
        before = await gw.send(session, ips[0])
        assert (before.status, before.pod, before.served) == (200, "p0", f"{ips[0]}:{port}")

        await gw.stop_picker()  # the picker is unavailable
        assert [(await gw.send(session, ips[0])).status for _ in range(3)] == [500, 200, 200]
        replies = []
        for _ in range(15):  # over several of Envoy's health-check rounds: not one more request lost
            replies += await gw.send_many(session, ips[0], total=4)
            await asyncio.sleep(0.2)
        assert {r.status for r in replies} == {200}
        assert {r.pod for r in replies} == {"p0", "p1", "p2"}  # Envoy's own round-robin, not the header
        assert {r.served for r in replies} == {None}  # no picker saw these requests
        async with session.get(gw.url.replace("/v1/completions", "/v1/models")) as r:
            assert r.status == 200  # body-less requests fail open too
        forged = await gw.send(session, ips[0], {"x-gateway-destination-endpoint": outsider.hostport})
        assert forged.status == 503 and outsider.hits == 0

        await gw.restart_picker()
        deadline = asyncio.get_running_loop().time() + 10
        while (reply := await gw.send(session, ips[2])).served is None:  # until Envoy's check sees it
            assert reply.status == 200
            assert asyncio.get_running_loop().time() < deadline, "Envoy never went back to the picker"
            await asyncio.sleep(0.1)
        assert {(r.pod, r.served) for r in await gw.send_many(session, ips[2], total=10)} == {
            ("p2", f"{ips[2]}:{port}")}
        forged = await gw.send(session, ips[0], {"x-gateway-destination-endpoint": outsider.hostport})
        assert forged.pod == "p0" and outsider.hits == 0


async def test_fail_open_checks_a_tls_picker_and_uses_it_while_it_is_up(api, kubeconfig, servers):
    """FailOpen's health check of the picker (a TCP connect) passes for a picker serving TLS, so
    requests are picked, not silently routed around it."""
    ips, [port] = await three_pods(api, servers)
    async with gateway(api, kubeconfig, fail_mode_pool(port, "FailOpen"), secure=True,
                       fail_open_endpoints=[f"{ip}:{port}" for ip in ips]) as gw, aiohttp.ClientSession() as session:
        await wait_until(lambda: envoy_stat(gw.envoy, "cluster.epp.health_check.success") >= 2,
                         "two passed health checks of the picker")
        replies = await gw.send_many(session, ips[1], total=10)
        assert {(r.pod, r.served) for r in replies} == {("p1", f"{ips[1]}:{port}")}


async def test_fail_close_refuses_requests_while_the_picker_is_down(api, kubeconfig, servers):
    """The counterpart of EppUnAvailableFailOpen (the default `failureMode: FailClose`): with the
    picker gone nothing reaches a pod; requests are refused, not routed around the picker."""
    ips, [port] = await three_pods(api, servers)
    async with gateway(api, kubeconfig, fail_mode_pool(port, "FailClose")) as gw, \
            aiohttp.ClientSession() as session:
        assert (await gw.send(session, ips[1])).pod == "p1"
        await gw.stop_picker()
        replies = [await gw.send(session, ips[1]) for _ in range(5)]
        assert {r.status for r in replies} == {500}
