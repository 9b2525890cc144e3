"""Flow control through real gRPC: a picker scraping a simulated replica's `/metrics` page.

The replica reports `num_requests_waiting`; with `queueDepthThreshold: 1` one waiting request
saturates it. Each test opens ext_proc streams as Envoy does and watches what comes back.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from epp.config.compose import endpoint_picker_config, plugin
from epp.server.runner import EppServer
from tests.support.configs import objectives
from tests.support.extproc import (
    ExtProcClient,
    drop_reason_of,
    error_of,
    no_reply_within,
    options,
    request_body,
    request_headers,
)
from tests.support.pods import FakeVllmPod
from tests.support.ports import free_port
from tests.support.wait import wait_until

pytestmark = pytest.mark.timeout(60)

BODY = json.dumps({"model": "tiny", "prompt": "hello", "max_tokens": 4}).encode()


@pytest.fixture
async def replica():
    """A replica that only serves its vLLM `/metrics` page; `state.waiting` is what the picker scrapes."""
    pod = FakeVllmPod("127.0.0.1", free_port()).set(queue=1)  # saturated until a test frees it
    await pod.start()
    yield pod
    await pod.stop()


@contextlib.asynccontextmanager
async def picker(replica: FakeVllmPod, flow_control: dict[str, Any],
                 gate: bool = True) -> AsyncIterator[tuple[EppServer, ExtProcClient]]:
    """The picker with flow control (`flow_control`: its config section), once it has scraped the replica."""
    config = endpoint_picker_config(
        ["random-picker", plugin("utilization-detector", queueDepthThreshold=1, metricsStalenessThreshold="5s")],
        ["random-picker"], **({"featureGates": ["flowControl"]} if gate else {}),
        objectives=objectives(interactive=10, batch=0), flowControl=flow_control)
    opts = options(replica.hostport, config_text=config)
    opts.scrape_metrics = True
    server = EppServer(opts)
    await server.start()
    client = ExtProcClient(server.grpc_port)
    try:
        await wait_until(lambda: server.endpoints.snapshot()[0].metrics.update_time > 0, "the first scrape", 10)
        yield server, client
    finally:
        await client.close()
        await server.stop(0)


async def send(client: ExtProcClient, objective: str | None = None, tenant: str | None = None):
    """Open a stream and send one request as Envoy does; returns the open call."""
    extra = [("x-gateway-inference-objective", objective)] if objective else []
    if tenant:
        extra.append(("x-gateway-inference-fairness-id", tenant))
    call = await client.open()
    await call.write(request_headers(extra=extra))
    await call.write(request_body(BODY))
    return call


def sample(server: EppServer, name: str, **labels: str) -> float:
    return server.metrics.registry.get_sample_value(name, labels) or 0.0


async def test_saturated_pool_queues_and_dispatches_by_priority_when_the_replica_frees(replica):
    async with picker(replica, {"defaultRequestTTL": "30s"}) as (server, client):
        batch1 = await send(client, "batch", "tenant-a")
        batch2 = await send(client, "batch", "tenant-b")
        urgent = await send(client, "interactive", "tenant-a")
        reads = {name: await no_reply_within(call, 0.3)
                 for name, call in (("batch1", batch1), ("batch2", batch2), ("urgent", urgent))}
        assert sample(server, "inference_extension_flow_control_queue_size", priority="0", fairness_id="tenant-a") == 1
        assert sample(server, "inference_extension_flow_control_queue_size", priority="10", fairness_id="tenant-a") == 1

        replica.state.waiting = 0  # the replica frees: one request at a time fits (threshold 1)
        order = []
        pending = {asyncio.ensure_future(read): name for name, read in reads.items()}
        async with asyncio.timeout(10):
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for fut in sorted(done, key=lambda f: pending[f]):
                    reply = fut.result()
                    assert reply.HasField("request_headers"), reply  # the headers reply: dispatched
                    order.append(pending.pop(fut))
        assert order == ["urgent", "batch1", "batch2"]
        assert sample(server, "inference_extension_flow_control_requests_total", priority="0",
                      outcome="dispatched") == 2
        assert sample(server, "inference_extension_flow_control_request_queue_duration_seconds_count",
                      priority="10", outcome="dispatched") == 1
        for call in (batch1, batch2, urgent):
            call.cancel()


async def test_a_request_waiting_past_the_ttl_gets_503(replica):
    async with picker(replica, {"defaultRequestTTL": "500ms"}) as (server, client):
        started = time.monotonic()
        call = await send(client)
        reply = await asyncio.wait_for(call.read(), 5)
        waited = time.monotonic() - started
        assert error_of(reply) == (503, b"inference error: ServiceUnavailable - request timed out in queue")
        assert drop_reason_of(reply) == "rejected-ttl-expired"
        assert 0.45 <= waited < 1.5
        assert sample(server, "inference_extension_flow_control_requests_total", priority="0", outcome="expired") == 1
        assert sample(server, "inference_extension_flow_control_queue_size", priority="0",
                      fairness_id="default-flow") == 0


async def test_over_capacity_is_rejected_at_once_with_429(replica):
    flow_control = {"maxRequests": 2, "priorityBands": [{"priority": 10, "maxRequests": 1}]}
    async with picker(replica, flow_control) as (server, client):
        queued = [await send(client, "interactive"), await send(client)]
        held = [await no_reply_within(call, 0.2) for call in queued]
        for extra in (await send(client, "interactive"), await send(client, "batch")):  # band full, then global full
            reply = await asyncio.wait_for(extra.read(), 1.0)
            assert error_of(reply) == (429, b"inference error: ResourceExhausted - request rejected by flow "
                                            b"control: queue capacity exceeded")
            assert drop_reason_of(reply) == "rejected-saturated"
        assert sample(server, "inference_extension_flow_control_requests_total", priority="10",
                      outcome="rejected") == 1
        assert sample(server, "inference_extension_flow_control_requests_total", priority="0", outcome="rejected") == 1
        for call, read in zip(queued, held, strict=True):
            read.cancel()
            call.cancel()


async def test_a_client_that_leaves_is_dropped_from_the_queue_and_never_dispatched(replica):
    async with picker(replica, {"defaultRequestTTL": "30s"}) as (server, client):
        leaver = await send(client, "interactive", "tenant-a")
        read = await no_reply_within(leaver, 0.2)
        leaver.cancel()  # Envoy resets the stream when its client goes away
        with pytest.raises(asyncio.CancelledError):
            await read
        await wait_until(lambda: sample(server, "inference_extension_flow_control_requests_total", priority="10",
                                        outcome="cancelled") >= 1, "the cancelled request to leave the queue", 2)
        assert sample(server, "inference_extension_flow_control_queue_size", priority="10",
                      fairness_id="tenant-a") == 0

        stayer = await send(client, "batch")
        replica.state.waiting = 0
        reply = await asyncio.wait_for(stayer.read(), 5)
        assert reply.HasField("request_headers")
        assert sample(server, "inference_extension_flow_control_requests_total", priority="10",
                      outcome="dispatched") == 0
        assert sample(server, "inference_extension_flow_control_requests_total", priority="0",
                      outcome="dispatched") == 1
        assert server.metrics.registry.get_sample_value("inference_extension_scheduler_attempts_total",
                                                        {"status": "success"}) == 1
        stayer.cancel()


async def test_without_the_feature_gate_requests_go_on_to_a_saturated_replica(replica):
    async with picker(replica, {"defaultRequestTTL": "1s"}, gate=False) as (server, client):
        assert server.director.pipeline.flow_controller is None
        call = await send(client)
        reply = await asyncio.wait_for(call.read(), 5)
        assert reply.HasField("request_headers")
        call.cancel()



async def test_a_picker_shutting_down_answers_its_queued_requests_at_once(replica):
    async with picker(replica, {"defaultRequestTTL": "30s"}) as (server, client):
        queued = [await send(client), await send(client, "interactive")]
        reads = [asyncio.ensure_future(await no_reply_within(call, 0.2)) for call in queued]
        stopping = asyncio.ensure_future(server.stop(10))  # a long drain: the answers must not wait for it
        async with asyncio.timeout(3):
            replies = await asyncio.gather(*reads)
        for reply in replies:
            assert error_of(reply) == (503, b"inference error: ServiceUnavailable - the endpoint picker is shutting "
                                             b"down")
            assert drop_reason_of(reply) == "rejected-shutting-down"
        await stopping
