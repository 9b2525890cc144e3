"""enableEviction through real gRPC: an in-flight sheddable request's stream is answered 429 (`evicted`) for a higher one."""

from __future__ import annotations

import asyncio
import json

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

pytestmark = pytest.mark.timeout(60)

BODY = json.dumps({"model": "tiny", "prompt": "hello", "max_tokens": 4}).encode()


async def send(client: ExtProcClient, objective: str):
    call = await client.open()
    await call.write(request_headers(extra=[("x-llm-d-inference-objective", objective)]))
    await call.write(request_body(BODY))
    return call


async def test_a_sheddable_request_in_flight_is_evicted_for_a_blocked_higher_priority_one():
    config = endpoint_picker_config(
        ["random-picker", plugin("concurrency-detector", maxConcurrency=1)], ["random-picker"],
        featureGates=["flowControl"], objectives=objectives(interactive=10, batch=-1),
        flowControl={"enableEviction": True, "saturationDetector": {"pluginRef": "concurrency-detector"}})
    server = EppServer(options("10.0.0.1:8000", config_text=config))
    await server.start()
    client = ExtProcClient(server.grpc_port)
    try:
        batch = await send(client, "batch")
        routed = await batch.read()
        assert routed.WhichOneof("response") == "request_headers"
        await batch.read()  # the body, sent on; the model server is now working on it
        interactive = await send(client, "interactive")
        pending = asyncio.ensure_future(interactive.read())
        evicted = await asyncio.wait_for(batch.read(), 5)
        status, message = error_of(evicted)
        assert status == 429 and b"evicted by flow control" in message
        assert drop_reason_of(evicted) == "evicted"
        # The evicted stream ended: its slot is free and the interactive request is routed.
        reply = await asyncio.wait_for(pending, 5)
        assert reply.WhichOneof("response") == "request_headers"
        await interactive.done_writing()
    finally:
        await client.close()
        await server.stop(0)


async def test_without_enable_eviction_the_higher_request_waits():
    config = endpoint_picker_config(
        ["random-picker", plugin("concurrency-detector", maxConcurrency=1)], ["random-picker"],
        featureGates=["flowControl"], objectives=objectives(interactive=10, batch=-1),
        flowControl={"saturationDetector": {"pluginRef": "concurrency-detector"}})
    server = EppServer(options("10.0.0.1:8000", config_text=config))
    await server.start()
    client = ExtProcClient(server.grpc_port)
    try:
        batch = await send(client, "batch")
        await batch.read()
        await batch.read()
        interactive = await send(client, "interactive")
        pending = await no_reply_within(interactive, 0.3)
        batch_next = await no_reply_within(batch, 0.05)  # not evicted
        await batch.done_writing()  # the batch request ends (Envoy closes its stream)
        reply = await asyncio.wait_for(pending, 5)
        assert reply.WhichOneof("response") == "request_headers"
        batch_next.cancel()
    finally:
        await client.close()
        await server.stop(0)
