"""Where spans go is the standard OTEL_* environment's choice: OTLP over gRPC or HTTP to a collector, the
console; `epp serve --tracing` (or OTEL_TRACES_EXPORTER alone) turns tracing on, and what it cannot do
is one line and exit 2 before anything starts."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys

import pytest

from epp.cli import _tracing_wanted
from epp.netutil import free_ports
from epp.server.runner import EppServer
from epp.tracing import TracingSetupError, exporter_names, load_exporters
from tests.cli.test_extras import ABSENT, epp, install_lacking
from tests.support.extproc import ExtProcClient, options, request_body, request_headers
from tests.tracing.collector import OtlpCollector

pytestmark = pytest.mark.timeout(120)

BODY = json.dumps({"model": "food-review", "prompt": "hello", "max_tokens": 4}).encode()
OTEL_VARIABLES = ("OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                  "OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_SERVICE_NAME",
                  "OTEL_RESOURCE_ATTRIBUTES", "OTEL_TRACES_SAMPLER", "OTEL_TRACES_SAMPLER_ARG", "OTEL_SDK_DISABLED")


@pytest.fixture
def otel_env(monkeypatch):
    """The OTEL_* variables cleared for the test; it sets the ones it means."""
    for name in OTEL_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.mark.parametrize(("environ", "names"), [
    ({}, ["otlp_proto_grpc"]),  # the spec's default exporter; gRPC is the SDK's default protocol
    ({"OTEL_TRACES_EXPORTER": "console"}, ["console"]),
    ({"OTEL_TRACES_EXPORTER": "otlp,console", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"},
     ["otlp_proto_http", "console"]),
    ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
      "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc"}, ["otlp_proto_grpc"]),  # the traces-only variable wins
    ({"OTEL_TRACES_EXPORTER": "none"}, []),
])
def test_the_exporters_are_named_by_the_otel_environment(environ, names):
    assert exporter_names(environ) == names


def test_an_exporter_or_protocol_this_install_lacks_is_refused_by_name():
    with pytest.raises(TracingSetupError, match=r"no trace exporter named 'zipkin' is installed \(installed: .*console"):
        load_exporters({"OTEL_TRACES_EXPORTER": "zipkin"})
    with pytest.raises(TracingSetupError, match="'http/json' is not supported"):
        load_exporters({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"})


def test_an_exporter_that_does_not_load_beside_xds_protos_older_protos_names_the_repair(monkeypatch):
    # What a fresh install gets when pip writes xds-protos' copy of opentelemetry/proto last: the
    # OTLP exporter's import fails, and ResourceSpans has its pre-1.0 field instead of scope_spans.
    import importlib.metadata
    from types import SimpleNamespace

    def load():
        raise ImportError("cannot import name 'InstrumentationScope'")

    older = SimpleNamespace(ResourceSpans=SimpleNamespace(DESCRIPTOR=SimpleNamespace(
        fields_by_name={"resource": None, "instrumentation_library_spans": None})))
    monkeypatch.setitem(sys.modules, "opentelemetry.proto.trace.v1.trace_pb2", older)
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: [
        SimpleNamespace(name="otlp_proto_grpc", load=load)])
    with pytest.raises(TracingSetupError, match=r"'otlp_proto_grpc' does not load \(cannot import name "
                       r"'InstrumentationScope'\)\. xds-protos overwrote .* `pip install --force-reinstall "
                       r"--no-deps opentelemetry-proto==\d"):
        load_exporters({})


def test_tracing_is_on_by_flag_or_by_an_exporter_and_off_when_the_sdk_is_disabled(otel_env):
    assert _tracing_wanted(None) is False  # --tracing not given
    assert _tracing_wanted(True) is True
    otel_env.setenv("OTEL_TRACES_EXPORTER", "console")
    assert _tracing_wanted(None) is True
    assert _tracing_wanted(False) is False  # --tracing=false (the llm-d chart's, tracing off) wins
    otel_env.setenv("OTEL_SDK_DISABLED", "true")
    assert _tracing_wanted(True) is False
    otel_env.setenv("OTEL_SDK_DISABLED", "false")
    otel_env.setenv("OTEL_TRACES_EXPORTER", "none")
    assert _tracing_wanted(None) is False


async def test_the_llm_d_chart_s_otel_environment_configures_tracing(otel_env):
    """With `router.tracing.enabled` the chart passes `--tracing=true` and sets these variables (the kubelet
    has expanded `$(NAMESPACE)` and the like in OTEL_RESOURCE_ATTRIBUTES by then)."""
    from epp.tracing import provider_from_environment

    collector = await OtlpCollector().start()
    chart_env = {
        "OTEL_SERVICE_NAME": "llm-d-router/epp", "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{collector.grpc_port}",
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_RESOURCE_ATTRIBUTES": "k8s.namespace.name=llm,k8s.node.name=node-7,k8s.pod.name=router-epp-5d9c7-x2x9k",
        "OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "1.0"}
    for name, value in chart_env.items():
        otel_env.setenv(name, value)
    assert _tracing_wanted(True) is True
    server = EppServer(options(tracing=True))
    try:
        await server.start()
        client = ExtProcClient(server.grpc_port)
        await client.exchange([request_headers(), request_body(BODY)], expect=2)
        await client.close()
    finally:
        await server.stop(0)
        await collector.stop()
    [root] = collector.named("epp.request")
    assert root.service == "llm-d-router/epp"
    assert {k: root.resource[k] for k in ("k8s.namespace.name", "k8s.node.name", "k8s.pod.name")} == {
        "k8s.namespace.name": "llm", "k8s.node.name": "node-7", "k8s.pod.name": "router-epp-5d9c7-x2x9k"}
    otel_env.setenv("OTEL_TRACES_SAMPLER_ARG", "0.1")  # the chart's default ratio
    provider = provider_from_environment()
    try:
        assert provider.sampler.get_description().startswith("ParentBased{root:TraceIdRatioBased{0.1},")
    finally:
        provider.shutdown()


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
@pytest.mark.parametrize("service_name", [None, "epp-east"])
async def test_spans_reach_an_otlp_collector_as_the_environment_says(otel_env, protocol, service_name):
    collector = await OtlpCollector().start()
    port = collector.grpc_port if protocol == "grpc" else collector.http_port
    otel_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{port}")
    otel_env.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", protocol)
    if service_name:
        otel_env.setenv("OTEL_SERVICE_NAME", service_name)
    server = EppServer(options(tracing=True))
    try:
        await server.start()
        client = ExtProcClient(server.grpc_port)
        await client.exchange([request_headers(), request_body(BODY)], expect=2)
        await client.close()
    finally:
        await server.stop(0)  # exports what the batch processor still holds
        await collector.stop()
    [root] = collector.named("epp.request")
    assert root.service == (service_name or "epp")
    assert root.attributes["gen_ai.request.model"] == "food-review"
    picker = collector.named("Picker max-score-picker")
    assert [s.trace_id for s in picker] == [root.trace_id]


def test_a_sampler_from_the_environment_is_the_sdks(otel_env):
    otel_env.setenv("OTEL_TRACES_SAMPLER", "traceidratio")
    otel_env.setenv("OTEL_TRACES_SAMPLER_ARG", "0.25")
    otel_env.setenv("OTEL_TRACES_EXPORTER", "none")
    from epp.tracing import provider_from_environment

    provider = provider_from_environment()
    try:
        assert provider.sampler.get_description() == "TraceIdRatioBased{0.25}"
    finally:
        provider.shutdown()


def console_spans(text: str) -> list[dict]:
    """The JSON documents the console exporter printed, one per span, among the other lines of stdout."""
    decoder, spans, at = json.JSONDecoder(), [], 0
    while (start := text.find("{", at)) != -1:
        document, at = decoder.raw_decode(text, start)
        spans.append(document)
    return spans


async def test_epp_serve_tracing_prints_each_requests_spans_with_the_console_exporter(otel_env):
    grpc_port, health_port, metrics_port = free_ports(3)
    env = {**os.environ, "OTEL_TRACES_EXPORTER": "console", "OTEL_SERVICE_NAME": "epp-console"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "epp.cli", "serve", "--tracing", "--grpc-port", str(grpc_port),
        "--grpc-health-port", str(health_port), "--metrics-port", str(metrics_port), "--bind-address", "127.0.0.1",
        "--endpoints", "127.0.0.1:1", "--refresh-metrics-interval", "60", "--grace-period", "1",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env)
    try:
        start_line = await asyncio.wait_for(proc.stdout.readline(), 60)
        assert start_line.startswith(b"epp serve: ext_proc on"), start_line
        client = ExtProcClient(grpc_port)
        await client.exchange([request_headers(), request_body(BODY)], expect=2)
        await client.close()
        proc.send_signal(signal.SIGTERM)
        out, err = await asyncio.wait_for(proc.communicate(), 30)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 0, err.decode()
    spans = console_spans(out.decode())
    names = {span["name"] for span in spans}
    assert {"epp.request", "epp.parse", "epp.profile"} <= names
    assert {span["resource"]["attributes"]["service.name"] for span in spans} == {"epp-console"}
    assert len({span["context"]["trace_id"] for span in spans}) == 1


async def test_epp_serve_refuses_an_exporter_it_does_not_have_before_serving(otel_env):
    env = {**os.environ, "OTEL_TRACES_EXPORTER": "zipkin"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "epp.cli", "serve", "--endpoints", "127.0.0.1:1",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 2
    assert out == b""
    [line] = err.decode().splitlines()
    assert line.startswith("epp serve: OTEL_TRACES_EXPORTER: no trace exporter named 'zipkin' is installed")


def test_epp_serve_tracing_without_its_extra_is_one_line_naming_it(tmp_path):
    result = epp(install_lacking(tmp_path, "tracing"), "epp.cli", "serve", "--tracing", "--endpoints", "127.0.0.1:1")
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        f"epp serve: tracing (--tracing or OTEL_TRACES_EXPORTER) needs the 'tracing' extra (missing: {ABSENT}): "
        "pip install 'llm-epp[tracing]' (in a checkout: pip install -e '.[tracing]')"]


async def test_stopping_a_tracing_picker_exports_the_spans_its_batch_still_holds(otel_env):
    """The batch processor holds spans; stop() exports them (a picker that exits loses none)."""
    collector = await OtlpCollector().start()
    otel_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{collector.grpc_port}")
    otel_env.setenv("OTEL_BSP_SCHEDULE_DELAY", "600000")  # nothing leaves before the stop
    server = EppServer(options(tracing=True))
    try:
        await server.start()
        client = ExtProcClient(server.grpc_port)
        for _ in range(3):
            await client.exchange([request_headers(), request_body(BODY)], expect=2)
        await client.close()
        await asyncio.sleep(0.2)
        assert collector.named("epp.request") == []
    finally:
        await server.stop(0)
        await collector.stop()
    assert len(collector.named("epp.request")) == 3
