"""Trace context through real Envoy: from the client (or Envoy's own tracing) to the picker, and on to the replica.

Real Envoy rendered by `epp.envoy.render_config` -> the picker (in-memory span exporter) -> an echo
replica on loopback that keeps the headers of each request it serves.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import aiohttp
import pytest

from epp.datalayer.registry import EndpointSpec
from epp.envoy import EnvoyProcess, render_config
from epp.server.runner import EppServer, ServeOptions
from tests.support.backends import EchoBackend
from tests.support.ports import free_port
from tests.support.wait import wait_until
from tests.tracing.collector import OtlpCollector
from tests.tracing.spans import SpanTree, in_memory_tracing, span_id_hex, trace_id_hex

pytestmark = [pytest.mark.envoy, pytest.mark.timeout(120)]

CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"
REQUEST = {"model": "food-review", "prompt": "What is a good soup for winter?", "max_tokens": 4}


@contextlib.asynccontextmanager
async def through_envoy(tracing_collector: str | None = None) -> AsyncIterator[tuple[str, EchoBackend, SpanTree]]:
    """Envoy -> the tracing picker -> one echo replica; yields the listener's URL, the replica and the picker's spans."""
    replica = EchoBackend("r0")
    await replica.start()
    async with contextlib.AsyncExitStack() as stack:
        stack.push_async_callback(replica.stop)
        tracing, exporter = stack.enter_context(in_memory_tracing())
        picker = EppServer(ServeOptions(grpc_port=0, grpc_health_port=0, metrics_port=0, bind_address="127.0.0.1",
                                        endpoints=[EndpointSpec("127.0.0.1", replica.port)], scrape_metrics=False,
                                        grace_period_s=1), tracing=tracing)
        await picker.start()
        stack.push_async_callback(picker.stop, 0)
        listen, admin = free_port(), free_port()
        envoy = EnvoyProcess(render_config(listen_port=listen, admin_port=admin, epp_port=picker.grpc_port,
                                           tracing_collector=tracing_collector), admin)
        await envoy.start()
        stack.push_async_callback(envoy.stop)
        yield f"http://127.0.0.1:{listen}/v1/completions", replica, SpanTree(exporter)


async def post(url: str, headers: dict[str, str]) -> None:
    async with aiohttp.ClientSession() as session, session.post(url, json=REQUEST, headers=headers) as resp:
        assert resp.status == 200, await resp.text()


def traceparent_of(received: dict) -> tuple[str, str]:
    """(trace id, parent span id) of the traceparent a replica received."""
    _version, trace_id, parent_id, _flags = received["headers"]["traceparent"].split("-")
    return trace_id, parent_id


async def test_the_replica_continues_the_clients_trace_under_the_pickers_span():
    async with through_envoy() as (url, replica, spans):
        await post(url, {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"})
        await wait_until(lambda: spans.named("epp.request"), "the picker's request span")

    root = spans.one("epp.request")
    assert trace_id_hex(root) == CLIENT_TRACE and f"{root.parent.span_id:016x}" == CLIENT_SPAN
    picker = spans.one("Picker max-score-picker")
    [received] = replica.received
    assert traceparent_of(received) == (CLIENT_TRACE, span_id_hex(picker))


async def test_a_request_without_a_trace_starts_one_the_replica_joins():
    async with through_envoy() as (url, replica, spans):
        await post(url, {})
        await wait_until(lambda: spans.named("epp.request"), "the picker's request span")

    root = spans.one("epp.request")
    assert root.parent is None
    [received] = replica.received
    assert traceparent_of(received) == (trace_id_hex(root), span_id_hex(spans.one("Picker max-score-picker")))


@pytest.mark.slow  # Envoy exports its spans every 5 s
async def test_with_envoy_tracing_the_pickers_spans_hang_under_envoys_ext_proc_span_in_the_clients_trace():
    collector = await OtlpCollector().start()
    try:
        async with through_envoy(f"127.0.0.1:{collector.grpc_port}") as (url, replica, spans):
            await post(url, {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"})
            await wait_until(lambda: spans.named("epp.request"), "the picker's request span")
            # Envoy exports its spans in batches, at the latest every 5 s.
            await wait_until(lambda: collector.named("ingress", "envoy"), "Envoy's spans at the collector", timeout=15)
    finally:
        await collector.stop()

    envoy_spans = {s.span_id: s for s in collector.spans if s.service == "envoy"}
    assert {s.trace_id for s in envoy_spans.values()} == {CLIENT_TRACE}
    root = spans.one("epp.request")
    assert trace_id_hex(root) == CLIENT_TRACE
    ext_proc_call = envoy_spans[f"{root.parent.span_id:016x}"]  # the picker's parent is one of Envoy's spans
    assert "ExternalProcessor" in ext_proc_call.name
    [ingress] = collector.named("ingress", "envoy")
    assert ext_proc_call.parent_span_id == ingress.span_id and ingress.parent_span_id == CLIENT_SPAN
    # Envoy sends the request on under its own span (its router sets traceparent after ext_proc did).
    [received] = replica.received
    assert traceparent_of(received) == (CLIENT_TRACE, ingress.span_id)
