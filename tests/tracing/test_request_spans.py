"""The spans of one request through the picker's real ext_proc service (gRPC), into an in-memory exporter.

The picker runs a real config (the loader builds the pipeline); each test sends the ext_proc
messages Envoy sends and reads the span tree: names, parent links, attributes, status, and the
`traceparent` the headers reply sets on the upstream request.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator

import pytest
from opentelemetry.trace import SpanKind, StatusCode

from epp.config.compose import endpoint_picker_config, plugin
from epp.server.runner import EppServer
from tests.support.configs import objectives, pd_config
from tests.support.extproc import (
    ExtProcClient,
    headers_of,
    immediate,
    options,
    request_body,
    request_headers,
    response_body,
    response_headers,
    subset_metadata,
)
from tests.support.pods import FakeVllmPod
from tests.support.ports import free_port
from tests.support.wait import wait_until
from tests.tracing.spans import SpanTree, in_memory_tracing, span_id_hex, trace_id_hex

pytestmark = pytest.mark.timeout(60)

# A prompt no span may show (the test looks for it in every attribute and event).
SECRET = "the-prompt-text-no-span-may-hold"
BODY = json.dumps({"model": "food-review", "prompt": f"{SECRET} " * 40, "max_tokens": 8, "stream": True}).encode()
ENDPOINTS = "10.0.0.1:8000#tier=gpu,10.0.0.2:8000#tier=gpu,10.0.0.3:8000#tier=gpu"
# GIE's default scorers behind the approximate prefix producer, one filter in front.
CONFIG = endpoint_picker_config(
    ["approx-prefix-cache-producer", "prefix-cache-scorer", "queue-scorer", "kv-cache-utilization-scorer",
     plugin("label-selector-filter", "gpu-tier", matchLabels={"tier": "gpu"})],
    ["gpu-tier", "prefix-cache-scorer", "queue-scorer", "kv-cache-utilization-scorer"])
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


@contextlib.asynccontextmanager
async def traced_picker(config: str | None = CONFIG, endpoints: str = ENDPOINTS,
                        scrape: bool = False) -> AsyncIterator[tuple[ExtProcClient, SpanTree, EppServer]]:
    """The picker with in-memory tracing; yields a gRPC client, the spans (filled as they end) and the server."""
    with in_memory_tracing() as (tracing, exporter):
        opts = options(endpoints, config_text=config)
        opts.scrape_metrics = scrape
        server = EppServer(opts, tracing=tracing)
        await server.start()
        client = ExtProcClient(server.grpc_port)
        tree = SpanTree(exporter)
        try:
            yield client, tree, server
        finally:
            await client.close()
            await server.stop(0)


async def request_ended(tree: SpanTree) -> None:
    await wait_until(lambda: tree.named("epp.request"), "the request span to end")


def sse(event: dict) -> bytes:
    return f"data: {json.dumps(event)}\n\n".encode()


def upstream_parent(reply) -> tuple[str, str]:
    """(trace id, parent span id) of the `traceparent` the headers reply sets; it must say "sampled"."""
    version, trace_id, parent_id, flags = headers_of(reply.request_headers.response.header_mutation)[
        "traceparent"].split("-")
    assert version == "00" and int(flags, 16) & 1, flags
    return trace_id, parent_id


def all_attribute_text(tree: SpanTree) -> str:
    parts = []
    for span in tree.spans:
        parts += [f"{k}={v}" for k, v in span.attributes.items()]
        parts += [f"{e.name} {dict(e.attributes or {})}" for e in span.events]
        parts.append(span.status.description or "")
    return "\n".join(parts)


async def test_a_routed_request_is_one_trace_from_parse_to_the_end_of_its_response():
    async with traced_picker() as (client, tree, _server):
        replies = await client.exchange([
            request_headers(path="/v1/completions"), request_body(BODY),
            response_headers([(":status", "200"), ("content-type", "text/event-stream")]),
            response_body(sse({"choices": [{"text": "Hi"}]})),
            response_body(sse({"choices": [], "usage": {"prompt_tokens": 123, "completion_tokens": 8}})
                          + b"data: [DONE]\n\n", end_of_stream=True)], expect=5)
        await request_ended(tree)

    root = tree.one("epp.request")
    assert root.kind is SpanKind.SERVER and root.parent is None  # no incoming trace: a new one
    destination = headers_of(replies[0].request_headers.response.header_mutation)["x-gateway-destination-endpoint"]
    assert root.attributes["gen_ai.request.model"] == "food-review"
    assert root.attributes["gen_ai.operation.name"] == "text_completion"
    assert root.attributes["epp.endpoint"] == destination
    assert root.attributes["epp.profile"] == "default"
    assert root.attributes["http.request.method"] == "POST"
    assert root.attributes["url.path"] == "/v1/completions"
    assert root.attributes["epp.request_id"] == "test-request-id"
    assert root.attributes["http.response.status_code"] == 200
    assert root.status.status_code is StatusCode.UNSET
    assert tree.child_names(root) == [
        "epp.parse", "Admitter saturation-admitter", "PrepareData approx-prefix-cache-producer", "epp.profile",
        "PreRequest approx-prefix-cache-producer", "epp.response"]

    profile = tree.one("epp.profile")
    assert profile.attributes["epp.profile"] == "default"
    assert tree.child_names(profile) == [
        "Filter gpu-tier", "Scorer prefix-cache-scorer", "Scorer queue-scorer",
        "Scorer kv-cache-utilization-scorer", "Picker max-score-picker"]
    picker = tree.one("Picker max-score-picker")
    assert picker.attributes["epp.endpoint"] == destination
    assert picker.attributes["epp.plugin.type"] == "max-score-picker"
    scorer = tree.one("Scorer queue-scorer")
    assert scorer.attributes["epp.profile"] == "default"
    assert profile.start_time <= scorer.start_time <= scorer.end_time <= profile.end_time

    # Every span is in the one trace, and the upstream request continues it under the picker's span.
    assert {trace_id_hex(s) for s in tree.spans} == {trace_id_hex(root)}
    assert upstream_parent(replies[0]) == (trace_id_hex(root), span_id_hex(picker))

    response = tree.one("epp.response")
    assert [e.name for e in response.events] == ["first_token"]
    assert response.attributes["http.response.status_code"] == 200
    assert response.attributes["gen_ai.usage.input_tokens"] == 123
    assert response.attributes["gen_ai.usage.output_tokens"] == 8
    assert SECRET not in all_attribute_text(tree)


async def test_an_incoming_traceparent_is_continued_and_its_tracestate_goes_upstream():
    async with traced_picker() as (client, tree, _server):
        replies = await client.exchange([
            request_headers(extra=[("traceparent", f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"),
                                   ("tracestate", "vendor=opaque")]),
            request_body(BODY)], expect=2)
        await request_ended(tree)

    root = tree.one("epp.request")
    assert trace_id_hex(root) == CLIENT_TRACE
    assert f"{root.parent.span_id:016x}" == CLIENT_SPAN and root.parent.is_remote
    picker = tree.one("Picker max-score-picker")
    headers = headers_of(replies[0].request_headers.response.header_mutation)
    assert headers["traceparent"] == f"00-{CLIENT_TRACE}-{span_id_hex(picker)}-01"
    assert headers["tracestate"] == "vendor=opaque"


async def test_a_caller_that_did_not_sample_gets_no_spans_and_its_traceparent_is_left_alone():
    async with traced_picker() as (client, tree, _server):
        replies = await client.exchange([
            request_headers(extra=[("traceparent", f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-00")]),
            request_body(BODY)], expect=2)
        await client.exchange([request_headers(), request_body(BODY)], expect=2)  # a sampled one after it
        await request_ended(tree)

    assert "traceparent" not in headers_of(replies[0].request_headers.response.header_mutation)
    assert CLIENT_TRACE not in {trace_id_hex(s) for s in tree.spans}


async def test_a_request_refused_for_a_bad_body_ends_its_trace_in_error_at_the_parse():
    async with traced_picker() as (client, tree, _server):
        status, _body = await immediate(client, [request_headers(), request_body(b'{"prompt": "no model"}')])
        await request_ended(tree)

    assert status == 400
    root = tree.one("epp.request")
    assert root.status.status_code is StatusCode.ERROR
    assert root.status.description == "model not found in request body"
    assert root.attributes["error.type"] == "BadRequest"
    assert root.attributes["http.response.status_code"] == 400
    parse = tree.one("epp.parse")
    assert parse.status.status_code is StatusCode.ERROR and parse.attributes["error.type"] == "BadRequest"
    assert tree.child_names(root) == ["epp.parse"]  # nothing was scheduled


async def test_a_request_no_endpoint_may_serve_is_refused_with_its_scheduling_spans_kept():
    hint = subset_metadata("10.9.9.9:8000")  # names no endpoint of the pool
    async with traced_picker() as (client, tree, _server):
        status, _body = await immediate(client, [request_headers(metadata=hint), request_body(BODY, metadata=hint)])
        await request_ended(tree)

    assert status == 503
    root = tree.one("epp.request")
    assert root.status.status_code is StatusCode.ERROR
    assert root.attributes["error.type"] == "ServiceUnavailable"
    assert "epp.endpoint" not in root.attributes
    assert tree.child_names(root) == ["epp.parse", "Admitter saturation-admitter"]


async def test_each_profile_of_a_disaggregated_pick_has_its_own_spans_and_the_decode_pick_goes_upstream():
    endpoints = "10.0.0.1:8000#llm-d.ai/role=prefill,10.0.0.2:8000#llm-d.ai/role=decode"
    async with traced_picker(pd_config(threshold=1), endpoints) as (client, tree, _server):
        replies = await client.exchange([request_headers(), request_body(BODY)], expect=2)
        await request_ended(tree)

    profiles = {span.attributes["epp.profile"]: span for span in tree.named("epp.profile")}
    assert set(profiles) == {"prefill", "decode"}
    assert tree.child_names(profiles["prefill"])[0] == "Filter prefill-filter"
    assert tree.child_names(profiles["decode"])[0] == "Filter decode-filter"
    pickers = {p: tree.children(span)[-1] for p, span in profiles.items()}
    assert pickers["prefill"].attributes["epp.endpoint"] == "10.0.0.1:8000"
    assert pickers["decode"].attributes["epp.endpoint"] == "10.0.0.2:8000"
    root = tree.one("epp.request")
    assert root.attributes["epp.profile"] == "decode"
    assert upstream_parent(replies[0]) == (trace_id_hex(root), span_id_hex(pickers["decode"]))
    assert tree.one("PreRequest prefill-header-handler").parent.span_id == root.context.span_id


async def test_a_request_expiring_in_the_flow_control_queue_shows_the_wait_in_error():
    pod = FakeVllmPod("127.0.0.1", free_port()).set(queue=1)  # saturated: the request waits
    await pod.start()
    config = endpoint_picker_config(
        ["random-picker", plugin("utilization-detector", queueDepthThreshold=1, metricsStalenessThreshold="5s")],
        ["random-picker"], featureGates=["flowControl"], objectives=objectives(batch=0),
        flowControl={"defaultRequestTTL": "300ms"})
    try:
        async with traced_picker(config, pod.hostport, scrape=True) as (client, tree, server):
            await wait_until(lambda: server.endpoints.snapshot()[0].metrics.update_time > 0, "the first scrape", 10)
            status, _body = await immediate(client, [request_headers(), request_body(BODY)])
            await request_ended(tree)
    finally:
        await pod.stop()

    assert status == 503
    wait = tree.one("epp.flow_control")
    assert wait.status.status_code is StatusCode.ERROR and wait.attributes["error.type"] == "ServiceUnavailable"
    assert (wait.end_time - wait.start_time) / 1e9 >= 0.3
    root = tree.one("epp.request")
    assert tree.child_names(root) == ["epp.parse", "epp.flow_control"]
    assert root.attributes["error.type"] == "ServiceUnavailable"


async def test_without_tracing_no_request_carries_a_trace():
    async with contextlib.AsyncExitStack() as stack:
        server = EppServer(options(ENDPOINTS, config_text=CONFIG))
        await server.start()
        stack.push_async_callback(server.stop, 0)
        client = ExtProcClient(server.grpc_port)
        stack.push_async_callback(client.close)
        replies = await client.exchange([
            request_headers(extra=[("traceparent", f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01")]), request_body(BODY)],
            expect=2)
    assert server.tracing is None
    assert "traceparent" not in headers_of(replies[0].request_headers.response.header_mutation)
