"""Sheddable requests and dead model servers, through ext_proc gRPC with real `/metrics` pods."""

from __future__ import annotations

import pytest

from tests.support.configs import endpoint_picker_config, objectives, plugin
from tests.support.extproc import (
    ExtProcClient,
    drop_reason_of,
    error_of,
    gie_body,
    immediate,
    request_body,
    request_headers,
    route,
)
from tests.support.pods import start_picker, start_pods, wait_for_scraped
from tests.support.wait import wait_until

# Staleness is widened from GIE's 200 ms to 1 s so that a busy test machine (the scraper shares
# the event loop with the gRPC server) cannot make a healthy pool look saturated.
CONFIG = endpoint_picker_config(
    ["queue-scorer", "kv-cache-utilization-scorer", plugin("utilization-detector", metricsStalenessThreshold="1s")],
    ["queue-scorer", "kv-cache-utilization-scorer"],
    saturationDetector={"pluginRef": "utilization-detector"}, objectives=objectives(batch=-1, critical=2))

SHED = (429, b"inference error: ResourceExhausted - system saturated, sheddable request dropped")
BATCH = ("x-gateway-inference-objective", "batch")
CRITICAL = ("x-gateway-inference-objective", "critical")


@pytest.fixture
async def pool():
    pods = await start_pods(3)
    server = await start_picker(CONFIG, [p.spec for p in pods])
    client = ExtProcClient(server.grpc_port)
    yield pods, server, client
    await client.close()
    await server.stop(0)
    for pod in pods:
        await pod.stop()


def shed_count(server) -> float:
    return server.metrics.registry.get_sample_value("epp_admission_shed_requests_total") or 0.0


async def test_sheddable_request_gets_429_only_while_the_pool_is_saturated(pool):
    pods, server, client = pool
    # Every pod over a threshold: max(6/5, .9/.8) = 1.2 each.
    for pod in pods:
        pod.set(6, .9)
    await wait_for_scraped(server, pods)
    [reply] = await client.exchange([request_headers(extra=[BATCH]), request_body(gie_body("m"))], expect=1)
    assert error_of(reply) == SHED
    assert drop_reason_of(reply) == "rejected-saturated"
    assert shed_count(server) == 1
    # Requests without a sheddable objective are still served.
    for extra in ([], [CRITICAL]):
        destination, _, _ = await route(client, gie_body("m"), extra=extra)
        assert destination in {p.hostport for p in pods}

    # Load drops: mean of max(q/5, kv/.8) = (.125 + .25 + .4) / 3; the sheddable request is routed,
    # to the pod the scorers prefer.
    pods[0].set(0, .1)
    pods[1].set(1, .2)
    pods[2].set(2, .3)
    await wait_for_scraped(server, pods)
    destination, _, _ = await route(client, gie_body("m"), extra=[BATCH])
    assert destination == pods[0].hostport
    assert shed_count(server) == 1

    # Saturated again: shed again.
    for pod in pods:
        pod.set(0, .95)
    await wait_for_scraped(server, pods)
    assert await immediate(client, [request_headers(extra=[BATCH]), request_body(gie_body("m"))]) == SHED
    assert shed_count(server) == 2


async def test_dead_metrics_server_takes_its_endpoint_out_until_it_answers_again(pool):
    pods, server, client = pool
    pods[0].set(0, .1)
    pods[1].set(3, .2)
    pods[2].set(10, .2)
    await wait_for_scraped(server, pods)
    assert (await route(client, gie_body("m")))[0] == pods[0].hostport

    await pods[0].stop()
    await wait_until(lambda: not server.endpoints.get(pods[0].hostport).healthy,
                     f"{pods[0].hostport} to be marked unhealthy")
    errors = sum(server.metrics.registry.get_sample_value(
        "epp_metrics_scrape_errors_total", {"endpoint": pods[0].hostport, "reason": reason}) or 0.0
        for reason in ("connect", "protocol", "timeout"))
    assert errors >= 3
    # The endpoint's last metrics still make it the best; being unhealthy keeps it out.
    for i in range(5):
        assert (await route(client, gie_body("m", f"p{i}")))[0] == pods[1].hostport

    await pods[0].start()
    await wait_for_scraped(server, pods)
    assert (await route(client, gie_body("m")))[0] == pods[0].hostport
