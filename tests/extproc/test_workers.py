"""`epp serve --workers N`: N processes answer on one ext_proc port, one metrics page, dead workers replaced."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import ssl
import subprocess
import sys
import time

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from epp.netutil import free_ports
from epp.server.metrics_merge import merge_pages
from epp.server.workers import worker_count
from tests.support.configs import plugin, scorer_then_max_score
from tests.support.extproc import ExtProcClient, headers_of, metric_samples, request_body, request_headers
from tests.support.wait import wait_until_blocking

ENDPOINTS = "127.0.0.1:1,127.0.0.1:2,127.0.0.1:3,127.0.0.1:4"
BODY = json.dumps({"model": "m", "prompt": "hello", "max_tokens": 1}).encode()
DESTINATION = "x-gateway-destination-endpoint"


def ready_workers(metrics_port: int) -> float:
    """How many workers the supervisor counts ready (0 while its metrics page does not answer)."""
    try:
        return metric_samples(metrics_port).get('epp_workers{state="ready"}', 0.0)
    except OSError:
        return 0.0


def readiness(health_port: int, service: str = "readiness") -> int | None:
    with grpc.insecure_channel(f"127.0.0.1:{health_port}") as channel:
        try:
            return health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=1).status
        except grpc.RpcError:
            return None


APPROXIMATE = scorer_then_max_score(plugin("approx-prefix-cache-producer", autoTune=False, blockSizeTokens=4,
                                          charsPerToken=4))


@pytest.fixture
def two_workers(request):
    grpc_port, health_port, metrics_port = free_ports(3)
    variant = getattr(request, "param", "")
    config = ["--config-text", APPROXIMATE] if variant == "approximate" else \
        ["--no-worker-peer-link"] if variant == "nolink" else []
    proc = subprocess.Popen(
        [sys.executable, "-m", "epp.cli", "serve", "--workers", "2", "--grpc-port", str(grpc_port),
         "--grpc-health-port", str(health_port), "--metrics-port", str(metrics_port), "--bind-address",
         "127.0.0.1", "--endpoints", ENDPOINTS, "--refresh-metrics-interval", "60", "--grace-period", "1",
         *config],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        # The pod is ready with one worker ready; tests that kill a worker need the other one ready too.
        wait_until_blocking(lambda: readiness(health_port) == health_pb2.HealthCheckResponse.SERVING
                            and ready_workers(metrics_port) == 2, "the two workers to be ready", 60)
        yield proc, grpc_port, health_port, metrics_port
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


class FreshConnectionClient(ExtProcClient):
    """An ext_proc client on a TCP connection of its own (gRPC would otherwise reuse the process-wide
    pool's connection, and the kernel spreads connections, not streams, across workers)."""

    def __init__(self, port: int) -> None:
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1)])
        self.stub = pb_grpc.ExternalProcessorStub(self.channel)


async def route_once(port: int, body: bytes = BODY) -> str:
    """One request on a fresh connection."""
    client = FreshConnectionClient(port)
    try:
        replies = await client.exchange([request_headers(), request_body(body)], expect=2)
        return headers_of(replies[0].request_headers.response.header_mutation)[DESTINATION]
    finally:
        await client.close()


def worker_pids(metrics_port: int) -> dict[str, int]:
    samples = metric_samples(metrics_port)
    return {key.split('"')[1]: int(value) for key, value in samples.items() if key.startswith("epp_worker_pid{")}


async def test_two_workers_share_one_port_and_all_answer(two_workers):
    proc, grpc_port, health_port, metrics_port = two_workers
    # The supervisor answers the llm-d chart's probe too: its workers' discovery has synced.
    assert readiness(health_port, "inference-extension") == health_pb2.HealthCheckResponse.SERVING
    routed = [await route_once(grpc_port) for _ in range(24)]
    assert set(routed) <= set(ENDPOINTS.split(","))

    def page_with_both_workers() -> dict[str, float] | None:
        # A worker too slow to answer one scrape is left out of that page only: ask again.
        page = metric_samples(metrics_port)
        return page if all(f'epp_worker_requests{{worker="{w}"}}' in page for w in ("0", "1")) else None

    samples = await asyncio.to_thread(wait_until_blocking, page_with_both_workers, "a page with both workers", 20)
    taken = {w: samples[f'epp_worker_requests{{worker="{w}"}}'] for w in ("0", "1")}
    assert all(count > 0 for count in taken.values()), f"a worker took no request: {taken}"
    # Counters from both workers add up on the one page; gauges stay per worker.
    assert samples['epp_extproc_messages_total{phase="request_headers"}'] == 24
    assert {'inference_pool_ready_pods{worker="0"}', 'inference_pool_ready_pods{worker="1"}'} <= samples.keys()
    assert samples['epp_workers{state="ready"}'] == 2
    pids = worker_pids(metrics_port)
    assert len(set(pids.values())) == 2 and proc.pid not in pids.values()


@pytest.mark.slow
@pytest.mark.parametrize("two_workers", ["approximate"], indirect=True)
async def test_a_killed_worker_is_replaced_while_the_other_keeps_serving(two_workers):
    _proc, grpc_port, health_port, metrics_port = two_workers
    for i in range(6):  # prefix homes the replacement must learn from its sibling
        body = json.dumps({"model": "m", "prompt": f"tenant {i % 2} " + "shared rules " * 40, "max_tokens": 1})
        await route_once(grpc_port, body.encode())
    before = worker_pids(metrics_port)
    os.kill(before["0"], signal.SIGKILL)
    killed_at = time.monotonic()
    # Meanwhile requests are still answered (by worker 1) and the pod stays ready. A connection the
    # kernel queued on the dying worker's socket in the instant of its death is refused: that much
    # is lost with SO_REUSEPORT, and a client (Envoy) connects again.
    answered = refused = 0
    while worker_pids(metrics_port).get("0", 0) in (0, before["0"]):
        try:
            await route_once(grpc_port)
            answered += 1
        except grpc.aio.AioRpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAVAILABLE
            refused += 1
        assert refused <= 2, "requests kept failing after one worker died"
        assert readiness(health_port) == health_pb2.HealthCheckResponse.SERVING
        assert time.monotonic() - killed_at < 15, "worker 0 was not replaced within 15 s"
    after = worker_pids(metrics_port)
    assert after["1"] == before["1"] and after["0"] not in (0, before["0"])
    assert answered > 0
    samples = metric_samples(metrics_port)
    assert samples["epp_worker_restarts_total"] == 1
    await asyncio.to_thread(wait_until_blocking,
                            lambda: metric_samples(metrics_port)['epp_workers{state="ready"}'] == 2,
                            "the new worker to be ready", 30)
    # The replacement caught up from its sibling's snapshot before it reported ready.
    assert metric_samples(metrics_port)['epp_peer_snapshot_blocks{worker="0"}'] > 0
    # The replacement takes its share of new connections.
    taken_before = metric_samples(metrics_port)['epp_worker_requests{worker="0"}']
    for _ in range(24):
        await route_once(grpc_port)
    assert metric_samples(metrics_port)['epp_worker_requests{worker="0"}'] > taken_before


@pytest.mark.slow
@pytest.mark.parametrize("two_workers", ["approximate"], indirect=True)
async def test_workers_share_prefix_homes_so_a_group_stays_on_one_endpoint(two_workers):
    _proc, grpc_port, _health_port, metrics_port = two_workers
    systems = [f"Tenant {g:04d} assistant. " + " ".join(f"rule{g}x{i}" for i in range(60)) for g in range(5)]
    placed: dict[int, set[str]] = {}
    for i in range(30):
        group = i % len(systems)
        body = json.dumps({"model": "m", "prompt": f"{systems[group]} question {i}", "max_tokens": 1}).encode()
        placed.setdefault(group, set()).add(await route_once(grpc_port, body))
        await asyncio.sleep(0.1)  # staleness bound with room to spare on a loaded machine
    # Each worker applies the other's routes (waited for: a loaded machine delays the last ones).
    received = 'epp_peer_decisions_received_total{kind="prefix_routed"}'
    samples = await asyncio.to_thread(wait_until_blocking,
                                      lambda: (page := metric_samples(metrics_port)).get(received) == 30 and page,
                                      "each worker to apply the other's routes", 20)
    assert all(samples[f'epp_worker_requests{{worker="{w}"}}'] > 0 for w in ("0", "1"))
    # Each group kept one home whichever worker routed it.
    assert all(len(homes) == 1 for homes in placed.values()), placed


@pytest.mark.slow
@pytest.mark.parametrize("two_workers", ["nolink"], indirect=True)
async def test_workers_without_the_peer_link_share_nothing(two_workers):
    _proc, grpc_port, _health_port, metrics_port = two_workers
    for _ in range(8):
        await route_once(grpc_port)
    samples = metric_samples(metrics_port)
    assert samples['epp_extproc_messages_total{phase="request_headers"}'] == 8
    assert not any(key.startswith("epp_peer_") for key in samples)


@pytest.mark.slow
def test_sigterm_stops_every_worker(two_workers):
    proc, _grpc_port, _health_port, metrics_port = two_workers
    pids = worker_pids(metrics_port)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=20) == 0
    for pid in pids.values():
        wait_until_blocking(lambda pid=pid: not os.path.exists(f"/proc/{pid}"), f"worker {pid} to exit", 10)


def test_workers_flag_takes_a_number_or_auto():
    assert worker_count("3") == 3
    assert worker_count("auto") >= 1
    for bad in ("0", "-1", "two"):
        with pytest.raises(ValueError, match="--workers"):
            worker_count(bad)


def test_merged_page_sums_counters_and_histograms_and_labels_gauges_by_worker():
    page = ("# HELP reqs_total Requests.\n# TYPE reqs_total counter\nreqs_total{phase=\"a\"} 2.0\n"
            "# HELP lat Latency.\n# TYPE lat histogram\nlat_bucket{le=\"0.1\"} 1.0\nlat_bucket{le=\"+Inf\"} 3.0\n"
            "lat_count 3.0\nlat_sum 0.5\n# HELP open Open streams.\n# TYPE open gauge\nopen 4.0\n")
    merged = merge_pages([("0", page), ("1", page.replace("open 4.0", "open 1.0"))])
    lines = set(merged.splitlines())
    assert {'reqs_total{phase="a"} 4.0', 'lat_bucket{le="0.1"} 2.0', 'lat_bucket{le="+Inf"} 6.0', "lat_count 6.0",
            "lat_sum 1.0", 'open{worker="0"} 4.0', 'open{worker="1"} 1.0', "# TYPE lat histogram"} <= lines
    assert sum(line.startswith("# TYPE reqs_total") for line in merged.splitlines()) == 1


@pytest.mark.slow
def test_a_config_no_worker_can_load_stops_the_supervisor_with_the_reason():
    proc = subprocess.run([sys.executable, "-m", "epp.cli", "serve", "--workers", "2", "--config-text", "kind: Nope",
                           "--grpc-port", "0", "--grpc-health-port", "0", "--metrics-port", "0",
                           "--bind-address", "127.0.0.1", "--endpoints", ENDPOINTS],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "invalid configuration" in proc.stderr


@pytest.mark.slow
def test_workers_serve_tls_with_one_self_signed_certificate():
    grpc_port, health_port, metrics_port = free_ports(3)
    proc = subprocess.Popen(
        [sys.executable, "-m", "epp.cli", "serve", "--workers", "2", "--secure-serving", "--grpc-port", str(grpc_port),
         "--grpc-health-port", str(health_port), "--metrics-port", str(metrics_port), "--bind-address",
         "127.0.0.1", "--endpoints", ENDPOINTS, "--refresh-metrics-interval", "60", "--grace-period", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_until_blocking(lambda: readiness(health_port) == health_pb2.HealthCheckResponse.SERVING, "ready", 60)
        # Every fresh connection (the kernel spreads them over both workers) shows the same certificate,
        # so a client that pins it reaches either worker.
        certificates = {ssl.get_server_certificate(("127.0.0.1", grpc_port)) for _ in range(16)}
        assert len(certificates) == 1
        samples = metric_samples(metrics_port)
        assert all(samples[f'epp_worker_pid{{worker="{w}"}}'] > 0 for w in ("0", "1"))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=20)
