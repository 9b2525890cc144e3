"""The health services GIE's and llm-d's probes ask for (`liveness`, `readiness`, `inference-extension`),
grpc.health.v1 on the ext_proc port with `--health-checking`, and llm-d's drain window on SIGTERM."""

from __future__ import annotations

import asyncio
import os
import signal
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from epp.datalayer.registry import parse_endpoint_list
from epp.netutil import free_ports
from epp.server.health import HealthService
from tests.support.extproc import ExtProcClient, request_body, request_headers, started

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
BODY = b'{"model":"m","prompt":"hello"}'


async def status(port: int, service: str) -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                                 timeout=5)
    return reply.status


def test_each_service_follows_its_own_state():
    state = {"ready": False, "serving": False}
    health = HealthService(lambda: state["ready"], lambda: state["serving"])
    names = ("liveness", "readiness", "", "envoy.service.ext_proc.v3.ExternalProcessor", "inference-extension")
    assert [health.status_of(n) for n in names] == [SERVING, NOT_SERVING, NOT_SERVING, NOT_SERVING, NOT_SERVING]
    state["serving"] = True  # the pool is known, no Ready pod yet: the chart's one-replica probes pass
    assert [health.status_of(n) for n in names] == [SERVING, NOT_SERVING, NOT_SERVING, NOT_SERVING, SERVING]
    state["ready"] = True
    assert [health.status_of(n) for n in names] == [SERVING] * 5
    assert health.status_of("nope") is None


async def test_inference_extension_is_serving_once_discovery_synced_even_without_endpoints():
    """llm-d's chart probes `inference-extension` for liveness too: a pool whose pods are still loading
    their model must not get the picker restarted, so it does not wait for an endpoint."""
    server = await started(endpoints="")
    try:
        assert await status(server.health_port, "inference-extension") == SERVING
        assert await status(server.health_port, "readiness") == NOT_SERVING
        server.endpoints.set_endpoints(parse_endpoint_list("10.0.0.1:8000"))
        assert await status(server.health_port, "readiness") == SERVING
        await server.begin_drain()
        assert [await status(server.health_port, s) for s in ("inference-extension", "readiness", "liveness")] == [
            NOT_SERVING, NOT_SERVING, SERVING]
    finally:
        await server.stop(0)


@pytest.mark.parametrize("health_checking", [True, False])
async def test_health_checking_serves_grpc_health_on_the_ext_proc_port(health_checking):
    server = await started(health_checking=health_checking)
    try:
        if health_checking:
            assert await status(server.grpc_port, "envoy.service.ext_proc.v3.ExternalProcessor") == SERVING
        else:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await status(server.grpc_port, "envoy.service.ext_proc.v3.ExternalProcessor")
            assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
        assert await status(server.health_port, "readiness") == SERVING
    finally:
        await server.stop(0)


async def test_drain_timeout_keeps_taking_streams_while_not_serving_then_stops():
    """`--drain-timeout`: on SIGTERM health turns NOT_SERVING at once (liveness stays), new streams are
    still routed for the window (a gateway that has not seen the pod go keeps sending), then it exits."""
    grpc_port, health_port, metrics_port = free_ports(3)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "epp.cli", f"-grpc-port={grpc_port}", "--grpc-health-port", str(health_port),
        f"--metrics-port={metrics_port}", "--bind-address=127.0.0.1", "--endpoints=10.0.0.1:8000",
        "--refresh-metrics-interval=1m", "--drain-timeout=3s", "--grace-period=1s",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, env={**os.environ})
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 30)
        assert line.startswith(b"epp serve: ext_proc on 127.0.0.1:"), line
        assert await status(health_port, "readiness") == SERVING
        proc.send_signal(signal.SIGTERM)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 5
        while await status(health_port, "readiness") != NOT_SERVING:
            assert loop.time() < deadline, "still ready after SIGTERM"
            await asyncio.sleep(0.05)
        assert await status(health_port, "liveness") == SERVING
        assert await status(health_port, "inference-extension") == NOT_SERVING
        client = ExtProcClient(grpc_port)
        try:
            replies = await client.exchange([request_headers(), request_body(BODY)], expect=2)
        finally:
            await client.close()
        assert replies[0].HasField("request_headers")
        assert proc.returncode is None  # the window is still open
        await asyncio.wait_for(proc.wait(), 15)
        assert proc.returncode == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
