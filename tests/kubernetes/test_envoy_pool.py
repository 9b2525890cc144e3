"""Real Envoy → the picker with InferencePool discovery → HTTP servers playing the pool's pods.

Each "pod" is a small HTTP server on its own loopback address (127.0.0.2, 127.0.0.3, ...) and the
pool's target port; the local API server lists them as pods with those IPs.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

import aiohttp
import grpc
import pytest
from aiohttp import web
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.support.k8s_apiserver import READER_TOKEN, inference_objective, inference_pool, pod
from epp.config.compose import endpoint_picker_config
from epp.envoy import EnvoyProcess, render_config
from epp.netutil import free_ports
from epp.server.runner import EppServer, ServeOptions
from tests.support.configs import objectives
from tests.support.ports import free_port

pytestmark = [pytest.mark.envoy]

def random_picker_config(**sections) -> str:
    """A picker that picks at random; `sections`: further top-level fields."""
    return endpoint_picker_config(["random-picker"], ["random-picker"], **sections)


class PodServer:
    """An HTTP server on one loopback address answering with its pod name."""

    def __init__(self, name: str, ip: str, port: int) -> None:
        self.name, self.ip, self.port = name, ip, port
        self.hits = 0
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.ip, self.port).start()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def handle(self, request: web.Request) -> web.Response:
        await request.read()
        self.hits += 1
        return web.json_response({"pod": self.name}, headers={"x-pod": self.name})


async def send(session: aiohttp.ClientSession, url: str, i: int, headers: dict | None = None) -> str:
    body = json.dumps({"model": "m", "prompt": f"hello {i}"})
    async with session.post(url, data=body, headers={"content-type": "application/json", **(headers or {})}) as r:
        assert r.status == 200, await r.text()
        return r.headers["x-pod"]


async def test_requests_reach_exactly_the_ready_pods_of_the_pool(api, kubeconfig):
    port = free_port()
    servers = [PodServer(f"p{i}", f"127.0.0.{i + 2}", port) for i in range(5)]
    for s in servers:
        await s.start()
    api.apply(inference_pool("pool", {"app": "vllm"}, [port]))
    api.apply(pod("p0", "127.0.0.2"))
    api.apply(pod("p1", "127.0.0.3"))
    api.apply(pod("p2", "127.0.0.4"))
    api.apply(pod("p3", "127.0.0.5", ready=False))
    api.apply(pod("p4", "127.0.0.6", labels={"app": "other"}))  # not in the pool
    epp = EppServer(ServeOptions(
        grpc_port=0, grpc_health_port=0, metrics_port=0, bind_address="127.0.0.1",
        pool_name="pool", pool_namespace="default", kubeconfig=kubeconfig,
        config_text=random_picker_config(), scrape_metrics=False, grace_period_s=1))
    await epp.start()
    listen, admin = free_ports(2)
    envoy = EnvoyProcess(render_config(listen_port=listen, admin_port=admin, epp_port=epp.grpc_port), admin)
    await envoy.start()
    url = f"http://127.0.0.1:{listen}/v1/completions"
    try:
        assert epp.is_ready()
        async with aiohttp.ClientSession() as session:
            hit = {await send(session, url, i) for i in range(40)}
            assert hit == {"p0", "p1", "p2"}

            # p3 turns Ready: requests reach it within 2 s of the change.
            api.apply(pod("p3", "127.0.0.5", ready=True))
            loop = asyncio.get_running_loop()
            start = loop.time()
            i = 0
            while await send(session, url, i) != "p3":
                i += 1
                assert loop.time() - start < 2.0, "p3 not routed to within 2 s of turning Ready"

            # p0 is deleted: not one request reaches it afterwards.
            api.delete(pod("p0", None))
            await asyncio.sleep(0.2)
            before = servers[0].hits
            hit = {await send(session, url, i) for i in range(60)}
            assert hit == {"p1", "p2", "p3"}
            assert servers[0].hits == before
            assert servers[4].hits == 0
    finally:
        await envoy.stop()
        await epp.stop(0)
        for s in servers:
            await s.stop()


@pytest.mark.parametrize("group", ["inference.networking.x-k8s.io", "llm-d.ai"])
async def test_objective_priority_from_the_cluster_reaches_the_request(api, kubeconfig, group):
    """A sheddable objective (priority < 0) from an InferenceObjective is what admission sees: GIE's group,
    and llm-d.ai/v1alpha2, where the llm-d router chart creates `router.inferenceObjectives`."""
    api.apply(inference_pool("pool", {"app": "vllm"}, [8000]))
    api.apply(pod("p0", "10.1.0.1"))
    api.apply(inference_objective("batch", -5, "pool", group=group))
    epp = EppServer(ServeOptions(
        grpc_port=0, grpc_health_port=0, metrics_port=0, bind_address="127.0.0.1",
        pool_name="pool", kubeconfig=kubeconfig, scrape_metrics=False,
        config_text=random_picker_config(objectives=objectives(batch=3))))
    await epp.start()
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 3
        while epp.objectives.get("batch") != -5:
            assert loop.time() < deadline, "InferenceObjective not applied"
            await asyncio.sleep(0.01)
        from epp.request.parsing import RequestParser

        parser = RequestParser({"batch": 3})
        parser.objective_priorities = epp.objectives
        request, _ = parser.parse(request_id="r", headers={"x-gateway-inference-objective": "batch"},
                                  body=b'{"model": "m", "prompt": "hi"}', subset_hint=None)
        assert request.priority == -5
        api.delete(inference_objective("batch", -5, "pool", group=group))
        while epp.objectives.get("batch") != 3:  # back to the config's static value
            assert loop.time() < deadline + 3, "deleted InferenceObjective still applied"
            await asyncio.sleep(0.01)
    finally:
        await epp.stop(0)


async def readiness(port: int) -> int | None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="readiness"), timeout=1)
        except grpc.aio.AioRpcError:
            return None
        return reply.status


async def test_epp_serve_stays_not_serving_until_the_pool_exists(api, kubeconfig):
    grpc_port, health_port, metrics_port = free_ports(3)
    # The pool's namespace comes from $NAMESPACE (the downward API in the manifests).
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "epp.cli", "serve", "--grpc-port", str(grpc_port), "--grpc-health-port",
        str(health_port), "--metrics-port", str(metrics_port), "--bind-address", "127.0.0.1",
        "--pool-name", "late-pool", "--kubeconfig", kubeconfig,
        "--refresh-metrics-interval", "60", "--grace-period", "1",
        env={**os.environ, "NAMESPACE": "llm"}, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 30
        while (status := await readiness(health_port)) is None:
            assert loop.time() < deadline, "health port never answered"
            await asyncio.sleep(0.2)
        assert status == health_pb2.HealthCheckResponse.NOT_SERVING
        api.apply(pod("elsewhere", "10.1.0.9"))  # same labels, other namespace: not in the pool
        api.apply(pod("p0", "10.1.0.1", namespace="llm"))
        api.apply(inference_pool("late-pool", {"app": "vllm"}, [8000], namespace="llm"))
        deadline = loop.time() + 5
        while await readiness(health_port) != health_pb2.HealthCheckResponse.SERVING:
            assert loop.time() < deadline, "not ready after the pool was created"
            await asyncio.sleep(0.05)
        # With Kubernetes discovery /metrics wants a token the API accepts (--metrics-endpoint-auth's default).
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {READER_TOKEN}"}) as session:
            async with session.get(f"http://127.0.0.1:{metrics_port}/metrics") as r:
                text = await r.text()
        assert "epp_kubernetes_discovered_endpoints 1.0" in text
        proc.terminate()
        output = (await asyncio.wait_for(proc.communicate(), 15))[0].decode()
        assert proc.returncode == 0
        assert "InferencePool llm/late-pool (inference.networking.k8s.io/v1) does not exist" in output
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


def envoy_config(argv: list[str], capsys) -> tuple[int, str, str]:
    from epp.cli import main

    code = main(["envoy-config", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def envoy_accepts(config: str, tmp_path) -> None:
    import subprocess

    from epp.envoy import envoy_binary

    path = tmp_path / "envoy.yaml"
    path.write_text(config)
    out = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(path)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_envoy_config_from_an_inference_pool_file(capsys, tmp_path):
    """`epp envoy-config --inference-pool`: appProtocol and endpointPickerRef become the upstream
    codec, the picker's address and the failure mode; explicit flags win; Envoy accepts the result."""
    import yaml

    pool = inference_pool("vllm-pool", {"app": "vllm"}, [8000, 8001], namespace="llm")
    pool["spec"]["appProtocol"] = "kubernetes.io/h2c"
    pool["spec"]["endpointPickerRef"] = {"name": "epp", "port": {"number": 9002}, "failureMode": "FailOpen"}
    path = tmp_path / "pool.yaml"
    path.write_text(yaml.safe_dump_all([{"apiVersion": "v1", "kind": "Service", "metadata": {"name": "x"}}, pool]))
    code, out, _ = envoy_config(["--inference-pool", str(path),
                                 "--fail-open-endpoints", "vllm-pool-pods.llm.svc.cluster.local:8000"], capsys)
    assert code == 0
    config = yaml.safe_load(out)
    clusters = {c["name"]: c for c in config["static_resources"]["clusters"]}
    h2 = {"explicit_http_config": {"http2_protocol_options": {}}}
    options = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
    for name in ("original_destination_cluster", "fail_open"):
        assert {k: v for k, v in clusters[name]["typed_extension_protocol_options"][options].items()
                if k != "@type"} == h2
    assert clusters["fail_open"]["type"] == "STRICT_DNS"
    address = clusters["epp"]["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
    assert address["socket_address"] == {"address": "epp.llm.svc.cluster.local", "port_value": 9002}
    manager = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    ext_proc = next(f for f in manager["http_filters"] if f["name"] == "envoy.filters.http.ext_proc")
    assert ext_proc["typed_config"]["failure_mode_allow"] is True
    routes = manager["route_config"]["virtual_hosts"][0]["routes"]
    assert [r["route"]["cluster"] for r in routes] == ["original_destination_cluster", "fail_open"]
    envoy_accepts(out, tmp_path)

    code, out, _ = envoy_config(["--inference-pool", str(path), "--upstream-protocol", "http",
                                 "--epp-host", "10.0.0.9", "--fail-open-endpoints", "10.1.0.1:8000"], capsys)
    clusters = {c["name"]: c for c in yaml.safe_load(out)["static_resources"]["clusters"]}
    assert code == 0 and "typed_extension_protocol_options" not in clusters["original_destination_cluster"]
    assert clusters["epp"]["type"] == "STATIC" and clusters["fail_open"]["type"] == "STATIC"


@pytest.mark.parametrize("argv, message", [
    (["--upstream-protocol", "h3"], None),  # argparse's own choice error
    (["--fail-open-endpoints", "10.1.0.1:8000"], "fail-open endpoints need FailOpen"),
    (["--failure-mode-allow", "--fail-open-endpoints", "10.1.0.1"], "'10.1.0.1': expected host:port"),
    (["--inference-pool", "/nonexistent/pool.yaml"], "No such file"),
])
def test_envoy_config_refusals_name_what_is_wrong(argv, message, capsys):
    if message is None:
        with pytest.raises(SystemExit) as exit_info:
            envoy_config(argv, capsys)
        assert exit_info.value.code == 2 and "--upstream-protocol" in capsys.readouterr().err
        return
    code, out, err = envoy_config(argv, capsys)
    assert (code, out) == (2, "") and message in err and err.startswith("epp envoy-config: ")


@pytest.mark.parametrize("spec, message", [
    ({"appProtocol": "kubernetes.io/ws"}, "spec.appProtocol: 'kubernetes.io/ws' is not supported"),
    ({"endpointPickerRef": {"name": "epp", "port": {"number": 9002}, "failureMode": "Open"}},
     "spec.endpointPickerRef.failureMode: must be FailOpen or FailClose, not 'Open'"),
])
def test_envoy_config_refuses_a_pool_it_cannot_honour(spec, message, capsys, tmp_path):
    import yaml

    pool = inference_pool("p", {"app": "vllm"}, [8000])
    pool["spec"].update(spec)
    path = tmp_path / "pool.yaml"
    path.write_text(yaml.safe_dump(pool))
    code, _, err = envoy_config(["--inference-pool", str(path)], capsys)
    assert code == 2 and f"--inference-pool {path}: {message}" in err
    path.write_text(yaml.safe_dump({"kind": "Service"}))
    assert "expected one InferencePool, found 0" in envoy_config(["--inference-pool", str(path)], capsys)[2]
