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

from bench.support.k8s_apiserver import inference_objective, inference_pool, pod
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


async def test_objective_priority_from_the_cluster_reaches_the_request(api, kubeconfig):
    """A sheddable objective (priority < 0) from an InferenceObjective is what admission sees."""
    api.apply(inference_pool("pool", {"app": "vllm"}, [8000]))
    api.apply(pod("p0", "10.1.0.1"))
    api.apply(inference_objective("batch", -5, "pool"))
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
        api.delete(inference_objective("batch", -5, "pool"))
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
        async with aiohttp.ClientSession() as session:
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
