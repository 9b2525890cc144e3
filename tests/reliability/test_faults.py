"""Faults on the request path through real Envoy: clients that go away, replicas that die mid-request."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import aiohttp
import pytest

from epp.datalayer.registry import parse_endpoint_list
from epp.envoy import EnvoyProcess, render_config
from epp.netutil import free_ports
from epp.server.runner import EppServer, ServeOptions

pytestmark = pytest.mark.envoy
REPO = Path(__file__).resolve().parents[2]


class Backend:
    """tests/reliability/backend_process.py in a subprocess."""

    def __init__(self, name: str, port: int) -> None:
        self.name, self.port = name, port
        self.proc: asyncio.subprocess.Process | None = None

    @property
    def hostport(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self) -> None:
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "tests.reliability.backend_process", str(self.port), self.name,
            cwd=REPO, stdout=asyncio.subprocess.PIPE)
        assert await asyncio.wait_for(self.proc.stdout.readline(), 30) == b"ready\n"
        for _ in range(100):  # the line comes just before the listening socket
            try:
                _, writer = await asyncio.open_connection("127.0.0.1", self.port)
                writer.close()
                return
            except OSError:
                await asyncio.sleep(0.05)

    def kill(self) -> None:
        if self.proc and self.proc.returncode is None:
            os.kill(self.proc.pid, signal.SIGKILL)

    async def stop(self) -> None:
        self.kill()
        if self.proc:
            await self.proc.wait()


async def running(epp: EppServer) -> float:
    return sum(s.value for s in epp.metrics.running_requests.collect()[0].samples)


async def eventually_zero_running(epp: EppServer, timeout: float = 5.0) -> None:
    for _ in range(int(timeout / 0.05)):
        if await running(epp) == 0:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"requests still counted in flight: {await running(epp)}")


@pytest.fixture
async def stack():
    ports = free_ports(5)
    backends = [Backend(f"b{i}", ports[i]) for i in range(2)]
    await asyncio.gather(*(b.start() for b in backends))
    epp = EppServer(ServeOptions(
        grpc_port=0, grpc_health_port=0, metrics_port=0, bind_address="127.0.0.1",
        endpoints=parse_endpoint_list(",".join(b.hostport for b in backends)), scrape_metrics=True,
        refresh_metrics_interval_s=0.05, grace_period_s=1))
    await epp.start()
    envoy = EnvoyProcess(render_config(listen_port=ports[3], admin_port=ports[4], epp_port=epp.grpc_port), ports[4])
    await envoy.start()
    yield backends, epp, f"http://127.0.0.1:{ports[3]}"
    await envoy.stop()
    await epp.stop(0)
    for b in backends:
        await b.stop()


async def test_a_client_that_disconnects_mid_stream_is_released(stack):
    _, epp, url = stack
    async with aiohttp.ClientSession() as session:
        resp = await session.post(url + "/v1/completions",
                                  json={"model": "m", "prompt": "hi", "stream": True, "events": 50, "delay": 0.1})
        assert resp.status == 200
        await resp.content.readline()  # the stream has started
        assert await running(epp) == 1
        resp.close()  # the client goes away
    await eventually_zero_running(epp)


async def test_a_replica_that_dies_mid_request_fails_that_request_only(stack):
    backends, epp, url = stack
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as session:
        resp = await session.post(url + "/v1/completions",
                                  json={"model": "m", "prompt": "hi", "stream": True, "events": 50, "delay": 0.1})
        assert resp.status == 200
        victim = next(b for b in backends if b.name == resp.headers["x-backend"])
        await resp.content.readline()
        victim.kill()
        with pytest.raises(aiohttp.ClientError):  # truncated: the client sees an error, not a hang
            async for _ in resp.content:
                pass
            raise aiohttp.ClientPayloadError("stream ended without [DONE]")
        await eventually_zero_running(epp)
        # Scraping marks the dead replica unhealthy; new requests all go to the survivor.
        survivor = next(b for b in backends if b is not victim)
        for _ in range(100):
            ep = epp.endpoints.get(victim.hostport)
            if ep is not None and not ep.healthy:
                break
            await asyncio.sleep(0.05)
        for i in range(6):
            async with session.post(url + "/v1/completions",
                                    json={"model": "m", "prompt": f"p{i}", "stream": True, "events": 1,
                                          "delay": 0}) as r:
                assert r.status == 200 and r.headers["x-backend"] == survivor.name
                await r.read()
