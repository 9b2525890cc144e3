"""The fault table (bench/notes/2026-12-hostile-input-faults-soak-issue18.md#fault-table): each fault under
load through real Envoy, its outcome, and how many requests fail. Only requests in flight on the part that
died may fail."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import shutil
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from epp.datalayer.registry import parse_endpoint_list
from epp.engine.kv_publisher import KVEventPublisher
from epp.engine.sim import FleetConfig, SimFleet
from epp.engine.sim.fleet import default_tokenizer_dir
from epp.envoy import EnvoyProcess, render_config
from epp.netutil import free_ports
from epp.server.runner import EppServer, ServeOptions
from tests.reliability.test_faults import Backend, eventually_zero_running
from tests.support.configs import endpoint_picker_config, plugin
from tests.support.precise import fleet_specs

pytestmark = [pytest.mark.envoy, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]


@dataclass
class Outcome:
    """One request through Envoy: when it ran, where it went, whether it completed."""

    started: float
    ended: float = 0.0
    backend: str | None = None
    status: int | None = None
    complete: bool = False
    lines: int = 0
    error: str = ""


async def stream(session: aiohttp.ClientSession, url: str, prompt: str, events: int, delay: float,
                 out: Outcome | None = None) -> Outcome:
    """One streamed completion; complete only when `[DONE]` arrived. `out` fills in as it goes."""
    out = out or Outcome(time.monotonic())
    out.started = time.monotonic()
    try:
        async with session.post(url + "/v1/completions", json={"model": "m", "prompt": prompt, "stream": True,
                                                                "events": events, "delay": delay}) as resp:
            out.status, out.backend = resp.status, resp.headers.get("x-backend")
            if resp.status == 200:
                async for line in resp.content:
                    out.lines += 1
                    if line.startswith(b"data: [DONE]"):
                        out.complete = True
            else:
                await resp.read()
    except (TimeoutError, aiohttp.ClientError) as exc:
        out.error = type(exc).__name__
    out.ended = time.monotonic()
    return out


@dataclass
class Load:
    """Open-loop load: `rate` short streams per second until stopped (a failure does not speed it up)."""

    url: str
    rate: float = 20.0
    outcomes: list[Outcome] = field(default_factory=list)

    async def run(self, stop: asyncio.Event) -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
            tasks = []
            i = 0
            while not stop.is_set():
                out = Outcome(time.monotonic())
                self.outcomes.append(out)
                tasks.append(asyncio.create_task(stream(session, self.url, f"r{i}", 4, 0.05, out)))
                i += 1
                await asyncio.sleep(1 / self.rate)
            await asyncio.gather(*tasks)

    def failed(self) -> list[Outcome]:
        return [o for o in self.outcomes if not o.complete]

    def in_flight_at(self, t: float) -> list[Outcome]:
        return [o for o in self.outcomes if o.started <= t < o.ended]


@pytest.fixture
async def backends():
    ports = free_ports(2)
    started = [Backend(f"b{i}", ports[i]) for i in range(2)]
    await asyncio.gather(*(b.start() for b in started))
    yield started
    for b in started:
        await b.stop()


def picker_options(backends, **kw) -> ServeOptions:
    return ServeOptions(grpc_port=0, grpc_health_port=0, metrics_port=0, bind_address="127.0.0.1",
                        endpoints=parse_endpoint_list(",".join(b.hostport for b in backends)), scrape_metrics=True,
                        refresh_metrics_interval_s=0.05, grace_period_s=1, **kw)


@contextlib.asynccontextmanager
async def envoy_in_front(epp_port: int):
    listen, admin = free_ports(2)
    envoy = EnvoyProcess(render_config(listen_port=listen, admin_port=admin, epp_port=epp_port), admin)
    await envoy.start()
    try:
        yield envoy, f"http://127.0.0.1:{listen}"
    finally:
        await envoy.stop()


# ---- a replica dies ------------------------------------------------------------------------------------

async def test_replica_sigkilled_under_load_fails_only_its_in_flight_requests(backends):
    epp = EppServer(picker_options(backends))
    await epp.start()
    try:
        async with envoy_in_front(epp.grpc_port) as (_, url):
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as session:
                outcomes = [Outcome(0.0) for _ in range(8)]
                tasks = [asyncio.create_task(stream(session, url, f"p{i}", 40, 0.05, outcomes[i])) for i in range(8)]
                deadline = time.monotonic() + 10
                while not all(o.lines for o in outcomes):  # every stream is in flight
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.02)
                on = {b.name: sum(1 for o in outcomes if o.backend == b.name) for b in backends}
                victim = max(backends, key=lambda b: on[b.name])  # the replica serving the most of them
                victim.kill()
                await asyncio.gather(*tasks)
                failed = [o for o in outcomes if not o.complete]
                assert len(failed) == on[victim.name]  # exactly the victim's in-flight streams
                assert all(o.backend == victim.name for o in failed)
                await eventually_zero_running(epp)
                survivor = next(b for b in backends if b is not victim)
                for _ in range(100):  # failed scrapes take the dead replica out
                    ep = epp.endpoints.get(victim.hostport)
                    if ep is not None and not ep.healthy:
                        break
                    await asyncio.sleep(0.05)
                after = await asyncio.gather(*(stream(session, url, f"after{i}", 2, 0) for i in range(6)))
                assert all(o.complete and o.backend == survivor.name for o in after)
                print(f"replica SIGKILL: {len(failed)} of 8 in-flight streams failed, all on the victim")
    finally:
        await epp.stop(0)


# ---- a replica's /metrics misbehaves -----------------------------------------------------------------------

@pytest.mark.parametrize(("mode", "reason"), [("hang", "timeout"), ("garbage", "no_metrics"),
                                              ("huge", "too_large"), ("500", "http_status")])
async def test_replica_metrics_fault_takes_it_out_of_rotation_and_fails_no_request(backends, mode, reason):
    epp = EppServer(picker_options(backends))
    await epp.start()
    sick, healthy = backends
    try:
        async with envoy_in_front(epp.grpc_port) as (_, url):
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as session:
                async with session.post(f"http://{sick.hostport}/fault", json={"metrics": mode}) as resp:
                    assert resp.status == 200
                stop = asyncio.Event()
                load = Load(url)
                runner = asyncio.create_task(load.run(stop))
                deadline = time.monotonic() + 15
                while epp.endpoints.get(sick.hostport).healthy:
                    assert time.monotonic() < deadline, "the replica with broken /metrics stayed in rotation"
                    await asyncio.sleep(0.05)
                out_at = time.monotonic()
                await asyncio.sleep(1.0)
                errors = epp.metrics.registry.get_sample_value(
                    "epp_metrics_scrape_errors_total", {"endpoint": sick.hostport, "reason": reason})
                assert errors and errors >= 3
                # The operator's view keeps working.
                async with session.get(f"http://127.0.0.1:{epp.metrics_port}/metrics") as resp:
                    assert resp.status == 200
                async with session.post(f"http://{sick.hostport}/fault", json={"metrics": "ok"}) as resp:
                    assert resp.status == 200
                deadline = time.monotonic() + 10
                while not epp.endpoints.get(sick.hostport).healthy:
                    assert time.monotonic() < deadline, "the replica did not come back"
                    await asyncio.sleep(0.05)
                await asyncio.sleep(0.5)
                stop.set()
                await runner
        assert load.outcomes and load.failed() == []
        # While out of rotation (after the requests in flight there finished), nothing new went there.
        assert all(o.backend == healthy.name for o in load.outcomes if o.started > out_at + 0.3
                   and o.ended < out_at + 1.0)
    finally:
        await epp.stop(0)


# ---- the picker dies and comes back ---------------------------------------------------------------------

async def _serving(health_port: int, timeout: float = 30.0) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{health_port}") as channel:
                reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""),
                                                                      timeout=1)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return time.monotonic()
        except grpc.aio.AioRpcError:
            pass
        await asyncio.sleep(0.05)
    raise AssertionError("the picker never reported SERVING")


async def _start_picker_process(backends, grpc_port: int, health_port: int) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "epp.cli", "serve", "--grpc-port", str(grpc_port), "--grpc-health-port",
        str(health_port), "--metrics-port", "0", "--bind-address", "127.0.0.1",
        "--endpoints", ",".join(b.hostport for b in backends), cwd=REPO,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)


async def test_picker_sigkilled_and_restarted_under_load_fails_only_requests_during_the_outage(backends):
    grpc_port, health_port = free_ports(2)
    picker = await _start_picker_process(backends, grpc_port, health_port)
    try:
        await _serving(health_port)
        async with envoy_in_front(grpc_port) as (_, url):
            stop = asyncio.Event()
            load = Load(url)
            runner = asyncio.create_task(load.run(stop))
            await asyncio.sleep(2.0)
            killed_at = time.monotonic()
            os.kill(picker.pid, signal.SIGKILL)
            await picker.wait()
            await asyncio.sleep(1.0)
            picker = await _start_picker_process(backends, grpc_port, health_port)
            back_at = await _serving(health_port)
            await asyncio.sleep(3.0)
            stop.set()
            await runner
        before = [o for o in load.outcomes if o.ended < killed_at]
        after = [o for o in load.outcomes if o.started > back_at + 0.5]
        failed = load.failed()
        assert before and after and failed
        assert all(o.complete for o in before) and all(o.complete for o in after)
        # Envoy fails closed: requests in flight at the kill and those sent while the picker was
        # down (or before Envoy's ext_proc connection came back) fail; none outside that window.
        assert all(o.ended >= killed_at and o.started <= back_at + 0.5 for o in failed)
        assert {o.status for o in failed if o.status is not None} <= {200, 500, 503}
        print(f"picker outage: {len(failed)} of {len(load.outcomes)} requests failed at {load.rate:g} req/s: "
              f"{len(load.in_flight_at(killed_at))} in flight at the kill, outage {back_at - killed_at:.1f}s")
    finally:
        if picker.returncode is None:
            picker.terminate()
            await picker.wait()


# ---- Envoy dies and comes back -------------------------------------------------------------------------

async def test_envoy_restarted_under_load_fails_its_in_flight_requests_and_the_picker_lets_go(backends):
    epp = EppServer(picker_options(backends))
    await epp.start()
    try:
        async with envoy_in_front(epp.grpc_port) as (envoy, url):
            stop = asyncio.Event()
            load = Load(url)
            runner = asyncio.create_task(load.run(stop))
            await asyncio.sleep(2.0)
            killed_at = time.monotonic()
            assert envoy.process is not None
            os.killpg(envoy.process.pid, signal.SIGKILL)
            await envoy.process.wait()
            await eventually_zero_running(epp)  # the picker releases the streams Envoy dropped
            await envoy.start()  # the same config, the same ports
            back_at = time.monotonic()
            await asyncio.sleep(2.0)
            stop.set()
            await runner
        failed = load.failed()
        assert all(o.ended >= killed_at and o.started <= back_at for o in failed)
        assert all(o.complete for o in load.outcomes if o.started > back_at)
        assert any(o.started > back_at for o in load.outcomes)
        print(f"envoy restart: {len(failed)} of {len(load.outcomes)} requests failed at {load.rate:g} req/s: "
              f"{len(load.in_flight_at(killed_at))} in flight at the kill, down {back_at - killed_at:.1f}s")
    finally:
        await epp.stop(0)


# ---- the tokenizer files are missing ---------------------------------------------------------------------

def precise_config(model: str, tokenizer_dir: Path | str) -> str:
    """Precise prefix (16-token blocks, `model`'s tokenizer in `tokenizer_dir`) at weight 3, queue at 1."""
    producer = plugin("precise-prefix-cache-producer", blockSizeTokens=16, tokenizers={model: str(tokenizer_dir)})
    return endpoint_picker_config([producer, "prefix-cache-scorer", "queue-scorer"],
                                  {"prefix-cache-scorer": 3, "queue-scorer": None})


async def test_missing_tokenizer_files_route_on_without_prefix_scores_and_recover_when_they_appear(
        backends, tmp_path, caplog):
    tokenizer_dir = tmp_path / "tokenizer"  # configured, but the files are not there (yet)
    tokenizer_dir.mkdir()
    epp = EppServer(picker_options(backends, config_text=precise_config("m", tokenizer_dir)))
    await epp.start()  # before the fix: the preload raised and the picker did not start
    try:
        [producer] = [e.plugin for e in epp.director.pipeline.plugins if getattr(e.plugin, "tokenizers", None) is not None]
        producer.tokenizers.retry_s = 0.2
        async with envoy_in_front(epp.grpc_port) as (_, url):
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as session:
                first = await asyncio.gather(*(stream(session, url, f"prompt {i} " * 100, 2, 0) for i in range(6)))
                assert all(o.complete for o in first)
                unavailable = epp.metrics.registry.get_sample_value(
                    "epp_tokenization_failures_total", {"reason": "tokenizer_unavailable"})
                assert unavailable and unavailable >= 1
                for name in ("tokenizer.json", "tokenizer_config.json"):
                    src = Path(default_tokenizer_dir()) / name
                    if src.exists():
                        shutil.copy(src, tokenizer_dir / name)
                await asyncio.sleep(0.3)
                second = await asyncio.gather(*(stream(session, url, f"prompt {i} " * 100, 2, 0) for i in range(6)))
                assert all(o.complete for o in second)
                assert epp.metrics.registry.get_sample_value("epp_tokenization_cache_tokens") > 0  # tokenized
        errors = [r for r in caplog.records if r.levelname == "ERROR" and "tokenizer" in r.getMessage()]
        assert len(errors) == 1  # one line for the outage, not one per request
    finally:
        await epp.stop(0)


# ---- a replica's KV-event publisher restarts, or loses messages ----------------------------------------------

async def _sim_load(url: str, stop: asyncio.Event, rate: float = 20.0) -> list[bool]:
    """Open-loop streamed completions to simulated replicas; True per request that completed."""
    results: list[bool] = []

    async def one(session: aiohttp.ClientSession, i: int) -> None:
        # A shared tenant prefix and a unique question of several blocks: every request stores new blocks.
        body = {"model": "sim-model", "prompt": f"tenant {i % 5} " * 40 + f"question {i} " * 24, "max_tokens": 4,
                "stream": True}
        try:
            async with session.post(url + "/v1/completions", json=body) as resp:
                text = await resp.text()
                results.append(resp.status == 200 and "[DONE]" in text)
        except (TimeoutError, aiohttp.ClientError):
            results.append(False)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        tasks, i = [], 0
        while not stop.is_set():
            tasks.append(asyncio.create_task(one(session, i)))
            i += 1
            await asyncio.sleep(1 / rate)
        await asyncio.gather(*tasks)
    return results


async def _complete_directly(endpoint: str, prompt: str) -> None:
    """One completion sent straight to a replica (not through the picker), so that it publishes."""
    async with aiohttp.ClientSession() as session:
        body = {"model": "sim-model", "prompt": prompt, "max_tokens": 1}
        async with session.post(f"http://{endpoint}/v1/completions", json=body) as resp:
            assert resp.status == 200


@pytest.mark.parametrize("fault", ["restart", "gap"])
async def test_kv_event_publisher_restart_or_gap_fails_no_request_and_the_index_recovers(fault):
    tokenizer_dir = default_tokenizer_dir()
    config = FleetConfig(replicas=2, tokenizer_dir=tokenizer_dir, block_size=16, num_gpu_blocks=256)
    async with SimFleet(config) as fleet:
        epp = EppServer(ServeOptions(grpc_port=0, grpc_health_port=0, metrics_port=0, bind_address="127.0.0.1",
                                     config_text=precise_config("sim-model", tokenizer_dir), endpoints=fleet_specs(fleet.info),
                                     scrape_metrics=True, refresh_metrics_interval_s=0.05, grace_period_s=1))
        await epp.start()
        registry = epp.metrics.registry

        def sample(name: str, labels: dict | None = None) -> float:
            return registry.get_sample_value(name, labels or {}) or 0.0

        try:
            async with envoy_in_front(epp.grpc_port) as (_, url):
                stop = asyncio.Event()
                load = asyncio.create_task(_sim_load(url, stop))
                # The faulty replica must have published before the fault, or there is nothing to
                # break: the picker would meet its first message after the fault as a first contact.
                for n in range(3):
                    await _complete_directly(fleet.info[0]["endpoint"], f"before {n} " * 40)
                await asyncio.sleep(1.5)
                replica = fleet.replicas[0]
                old = replica.publisher
                assert old is not None
                if fault == "restart":  # a new process: the same sockets, sequence numbers from 0
                    replica.engine.publisher = None
                    await asyncio.to_thread(old.close)
                    info = fleet.info[0]
                    new = KVEventPublisher(info["kv_events_endpoint"], replay_endpoint=info["kv_replay_endpoint"],
                                           topic=old.topic, bind=True)
                    replica.publisher = replica.engine.publisher = new
                else:  # ten batches lost on the way: the replica's buffer cannot replay them either
                    old._seq = itertools.count(next(old._seq) + 10)
                applied_at_fault = sample("epp_kv_index_events_applied_total")

                def noticed() -> bool:
                    if fault == "restart":
                        return sample("epp_kv_events_publisher_restarts_total") >= 1
                    return sample("epp_kv_events_endpoint_resets_total", {"reason": "gap_unrepairable"}) >= 1

                # The picker can only notice once the faulty replica publishes again; the routed load
                # may all go to the other replica, so the faulty one is also asked directly.
                deadline, n = time.monotonic() + 15, 0
                while not noticed() and time.monotonic() < deadline:
                    n += 1
                    await _complete_directly(fleet.info[0]["endpoint"], f"after {n} " * 40)
                    await asyncio.sleep(0.25)
                await asyncio.sleep(1.0)  # routed load keeps going over the rebuilt view
                stop.set()
                results = await load
            assert results and all(results), f"{results.count(False)} of {len(results)} requests failed"
            if fault == "restart":
                assert sample("epp_kv_events_publisher_restarts_total") >= 1
            else:
                assert sample("epp_kv_events_sequence_gaps_total") >= 1
                assert sample("epp_kv_events_endpoint_resets_total", {"reason": "gap_unrepairable"}) >= 1
            assert sample("epp_kv_index_events_applied_total") > applied_at_fault  # the view is rebuilt
            assert sample("epp_kv_index_entries") > 0
        finally:
            await epp.stop(0)
