"""The llm-d router Helm chart runs our image unchanged: its container gets `args` only (no command), so
the picker is started here as the image starts it (deploy/kubernetes/Dockerfile's ENTRYPOINT, then
exactly the argument list the chart renders), against the Kubernetes API double, and probed on the
health services the chart's probes name until SERVING.

`chart_args` follows the rules of the chart's EPP container (llm-d/llm-d-router,
config/charts/routerlib/templates/_deployment.yaml, as read on 2026-12-07): pool or standalone
mode, `--zap-encoder json`, the config file under /config, leader election with more than one
replica, the health port, one `--key=value` per `router.epp.flags` entry (sorted, as Go templates
range over a map), `--tracing=true|false`, `--metrics-endpoint-auth=false` when Prometheus auth is
off. Its env: NAMESPACE and POD_NAME from the downward API, and with tracing the OTEL_* variables.
The one thing this test does in the kubelet's place: the ConfigMap mounted at /config is a
temporary directory here, so `/config/` in the arguments is that directory.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import ssl
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.support.k8s_apiserver import READER_TOKEN, STRANGER_TOKEN, inference_pool, pod
from epp.netutil import free_ports

REPO = Path(__file__).resolve().parents[2]
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
NAMESPACE = "llm"
RELEASE = "qwen"

# The chart's default-plugins.yaml as it renders for vLLM over HTTP without the latency predictor
# (the plugins and weights of _config.yaml), in the layout our loader reads.
CHART_DEFAULT_CONFIG = """\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: prefix-cache-scorer
- type: metrics-data-source
  parameters:
    scheme: "http"
    path: "/metrics"
    insecureSkipVerify: true
- type: core-metrics-extractor
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: queue-scorer
    weight: 2
  - pluginRef: kv-cache-utilization-scorer
    weight: 2
  - pluginRef: prefix-cache-scorer
    weight: 3
"""


@dataclass
class ChartValues:
    """The values of `router.*` that decide the EPP container's args, env and probes."""

    replicas: int = 1
    inference_pool_create: bool = True
    match_labels: dict[str, str] = field(default_factory=lambda: {"app": "vllm"})
    target_ports: tuple[int, ...] = (8000,)
    plugins_config_file: str = "default-plugins.yaml"
    grpc_health_port: int = 9003
    flags: dict[str, object] = field(default_factory=dict)
    proxy_type: str = "envoy"
    tracing_enabled: bool = False
    otel_exporter_endpoint: str = "http://localhost:4317"
    sampler: str = "parentbased_traceidratio"
    sampler_arg: str = "0.1"
    prometheus_auth_enabled: bool = True


def _go_value(value: object) -> str:
    """How the template's `%v` prints a YAML value."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def chart_args(values: ChartValues, release: str = RELEASE, namespace: str = NAMESPACE) -> list[str]:
    """The EPP container's `args`, by the chart template's rules."""
    if values.inference_pool_create:
        args = ["--pool-name", release, "--pool-namespace", namespace, "--pool-group", "inference.networking.k8s.io"]
    else:
        selector = ",".join(f"{k}={v}" for k, v in sorted(values.match_labels.items()))
        args = ["--endpoint-selector", selector,
                "--endpoint-target-ports", ",".join(str(p) for p in values.target_ports)]
    args += ["--zap-encoder", "json", "--config-file", f"/config/{values.plugins_config_file}"]
    if values.replicas > 1:
        args.append("--ha-enable-leader-election")
    args += ["--grpc-health-port", str(values.grpc_health_port)]
    flags = dict(values.flags)
    if values.proxy_type == "agentgateway" and "secure-serving" not in flags:
        flags["secure-serving"] = False  # the chart's own default for agentgateway
    args += [f"--{key}={_go_value(value)}" for key, value in sorted(flags.items())]
    args.append("--tracing=true" if values.tracing_enabled else "--tracing=false")
    if not values.prometheus_auth_enabled:
        args.append("--metrics-endpoint-auth=false")
    return args


def chart_env(values: ChartValues, pod_name: str, node: str = "node-1",
              namespace: str = NAMESPACE) -> dict[str, str]:
    """The EPP container's env, with the downward API's values and `$(VAR)` expanded as the kubelet does."""
    env = {"NAMESPACE": namespace, "POD_NAME": pod_name}
    if values.tracing_enabled:
        env.update({
            "OTEL_SERVICE_NAME": "llm-d-router/epp", "OTEL_EXPORTER_OTLP_ENDPOINT": values.otel_exporter_endpoint,
            "OTEL_TRACES_EXPORTER": "otlp", "OTEL_RESOURCE_ATTRIBUTES_NODE_NAME": node,
            "OTEL_RESOURCE_ATTRIBUTES_POD_NAME": pod_name,
            "OTEL_RESOURCE_ATTRIBUTES": f"k8s.namespace.name={namespace},k8s.node.name={node},k8s.pod.name={pod_name}",
            "OTEL_TRACES_SAMPLER": values.sampler, "OTEL_TRACES_SAMPLER_ARG": values.sampler_arg})
    return env


def chart_probes(values: ChartValues) -> tuple[str, str]:
    """The gRPC health services of the liveness and readiness probes."""
    return ("liveness", "readiness") if values.replicas > 1 else ("inference-extension", "inference-extension")


def image_entrypoint() -> list[str]:
    """The picker image's ENTRYPOINT (exec form) from deploy/kubernetes/Dockerfile, its program made the
    console script this environment installed."""
    text = (REPO / "deploy" / "kubernetes" / "Dockerfile").read_text()
    stage = text.split(" AS picker", 1)[1].split("\nFROM ", 1)[0]
    entrypoint = json.loads(re.search(r"^ENTRYPOINT (\[.*\])$", stage, re.M).group(1))
    assert "CMD" not in stage or "serve" not in stage.split("CMD", 1)[1], "CMD must not decide the command"
    program = Path(sys.executable).parent / entrypoint[0]
    assert program.exists(), f"{program}: the `{entrypoint[0]}` console script is not installed"
    return [str(program), *entrypoint[1:]]


class Picker:
    """One picker container: the image's ENTRYPOINT with the chart's args and env."""

    def __init__(self, values: ChartValues, kubeconfig: str, config_dir: Path, pod_name: str,
                 extra_env: Mapping[str, str] = ()) -> None:
        self.values = values
        self.args = [a.replace("/config/", f"{config_dir}/", 1) if a.startswith("/config/") else a
                     for a in chart_args(values)]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "KUBERNETES_"))}
        self.env = {**env, "KUBECONFIG": kubeconfig, **chart_env(values, pod_name), **dict(extra_env)}
        self.proc: asyncio.subprocess.Process | None = None
        self.output = b""

    async def start(self) -> Picker:
        self.proc = await asyncio.create_subprocess_exec(
            *image_entrypoint(), *self.args, env=self.env, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT)
        return self

    async def health(self, service: str) -> int | None:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{self.values.grpc_health_port}") as channel:
            try:
                reply = await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=service), timeout=1)
            except grpc.aio.AioRpcError:
                return None
        return reply.status

    async def wait_for(self, service: str, wanted: int, timeout: float = 30) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while (got := await self.health(service)) != wanted:
            if self.proc is not None and self.proc.returncode is not None:
                raise AssertionError(f"the picker exited ({self.proc.returncode}): {await self.read_output()}")
            assert loop.time() < deadline, f"{service}: {got} after {timeout}s, not {wanted}"
            await asyncio.sleep(0.1)

    async def read_output(self) -> str:
        if self.proc is not None and self.proc.stdout is not None and self.proc.returncode is not None:
            self.output += await self.proc.stdout.read()
        return self.output.decode(errors="replace")

    async def stop(self) -> str:
        """SIGTERM, as the kubelet stops a container; its output."""
        if self.proc is not None and self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.proc.wait(), 20)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()
        return await self.read_output()


def values_with_ports(**kw: object) -> ChartValues:
    """Chart values on free ports: the health port by `grpcHealthPort`, ext_proc and metrics by `router.epp.flags`."""
    grpc_port, health_port, metrics_port = free_ports(3)
    values = ChartValues(grpc_health_port=health_port, **kw)  # type: ignore[arg-type]
    values.flags = {"grpc-port": grpc_port, "metrics-port": metrics_port, **values.flags}
    return values


@pytest.fixture
def config_dir(tmp_path) -> Path:
    """The chart's ConfigMap as the kubelet mounts it."""
    (tmp_path / "default-plugins.yaml").write_text(CHART_DEFAULT_CONFIG)
    return tmp_path


def model_pods(api, labels: Mapping[str, str], count: int = 2) -> None:
    for i in range(count):
        api.apply(pod(f"vllm-{i}", f"127.0.0.{11 + i}", labels=dict(labels), namespace=NAMESPACE))


async def metrics(values: ChartValues, token: str | None = None) -> tuple[int, str]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    url = f"http://127.0.0.1:{values.flags['metrics-port']}/metrics"
    async with aiohttp.ClientSession() as session, session.get(url, headers=headers) as response:
        return response.status, await response.text()


def test_the_chart_s_argument_lists():
    """The rendering rules themselves, on the values the tests below start pickers with."""
    assert chart_args(ChartValues()) == [
        "--pool-name", "qwen", "--pool-namespace", "llm", "--pool-group", "inference.networking.k8s.io",
        "--zap-encoder", "json", "--config-file", "/config/default-plugins.yaml", "--grpc-health-port", "9003",
        "--tracing=false"]
    standalone = ChartValues(replicas=2, inference_pool_create=False, match_labels={"tier": "decode", "app": "vllm"},
                             target_ports=(8000, 8001), flags={"v": 2, "enable-pprof": False},
                             tracing_enabled=True, prometheus_auth_enabled=False, proxy_type="agentgateway")
    assert chart_args(standalone) == [
        "--endpoint-selector", "app=vllm,tier=decode", "--endpoint-target-ports", "8000,8001",
        "--zap-encoder", "json", "--config-file", "/config/default-plugins.yaml", "--ha-enable-leader-election",
        "--grpc-health-port", "9003", "--enable-pprof=false", "--secure-serving=false", "--v=2", "--tracing=true",
        "--metrics-endpoint-auth=false"]
    assert chart_probes(ChartValues()) == ("inference-extension", "inference-extension")
    assert chart_probes(standalone) == ("liveness", "readiness")
    assert image_entrypoint()[0].endswith("/epp")


async def test_one_replica_serving_an_inference_pool(api, kubeconfig, config_dir):
    """The chart's defaults: TLS on ext_proc and /metrics behind the API's token reviews, as llm-d's EPP
    serves them; the probes' `inference-extension` turns SERVING once the pool is known."""
    values = values_with_ports(flags={"v": 2, "enable-pprof": False, "refresh-metrics-interval": "1s"})
    picker = await Picker(values, kubeconfig, config_dir, "qwen-epp-7d4b9c-abcde").start()
    try:
        liveness, readiness = chart_probes(values)
        await picker.wait_for(liveness, NOT_SERVING)  # answering, but the pool does not exist yet
        model_pods(api, {"app": "vllm"})
        api.apply(inference_pool(RELEASE, {"app": "vllm"}, [8000], namespace=NAMESPACE))
        await picker.wait_for(readiness, SERVING)
        assert await picker.health(liveness) == SERVING
        # ext_proc speaks TLS (a gateway reaches the llm-d EPP so; --secure-serving defaults to true).
        pem = await asyncio.to_thread(ssl.get_server_certificate, ("127.0.0.1", values.flags["grpc-port"]))
        assert pem.startswith("-----BEGIN CERTIFICATE-----")
        assert await metrics(values) == (401, "Unauthorized\n")
        assert (await metrics(values, STRANGER_TOKEN))[0] == 403
        code, page = await metrics(values, READER_TOKEN)
        assert code == 200 and "epp_kubernetes_discovered_endpoints 2.0" in page
    finally:
        output = await picker.stop()
    assert picker.proc is not None and picker.proc.returncode == 0, output
    lines = [json.loads(line) for line in output.splitlines() if line.startswith("{")]
    assert lines and all({"level", "ts", "logger", "msg"} <= line.keys() for line in lines)  # --zap-encoder json
    ignored = [line["msg"] for line in lines if line["msg"].startswith("accepted from the llm-d EPP and ignored")]
    assert len(ignored) == 1 and "--enable-pprof=false" in ignored[0]


async def test_one_replica_standalone_by_label_selector_with_metrics_auth_off(api, kubeconfig, config_dir):
    values = values_with_ports(inference_pool_create=False, match_labels={"app": "vllm", "tier": "decode"},
                               target_ports=(8000, 8001), prometheus_auth_enabled=False,
                               flags={"refresh-metrics-interval": "1s"})
    model_pods(api, {"app": "vllm", "tier": "decode"})
    api.apply(pod("other", "127.0.0.30", labels={"app": "vllm", "tier": "prefill"}, namespace=NAMESPACE))
    picker = await Picker(values, kubeconfig, config_dir, "qwen-epp-7d4b9c-abcde").start()
    try:
        await picker.wait_for("inference-extension", SERVING)
        code, page = await metrics(values)  # no token needed
        assert code == 200 and "epp_kubernetes_discovered_endpoints 4.0" in page  # 2 pods x 2 ports
    finally:
        output = await picker.stop()
    assert picker.proc is not None and picker.proc.returncode == 0, output


@pytest.mark.slow
@pytest.mark.parametrize("pool_mode", [True, False], ids=["inference-pool", "standalone"])
async def test_two_replicas_one_ready_by_leader_election(api, kubeconfig, config_dir, pool_mode):
    """replicas: 2 renders --ha-enable-leader-election and probes `liveness`/`readiness`: both replicas
    live, only the lease holder ready; when it stops, the other takes over."""
    model_pods(api, {"app": "vllm"})
    if pool_mode:
        api.apply(inference_pool(RELEASE, {"app": "vllm"}, [8000], namespace=NAMESPACE))
    pickers = []
    for suffix in ("abcde", "fghij"):
        values = values_with_ports(replicas=2, inference_pool_create=pool_mode,
                                   flags={"refresh-metrics-interval": "1s"})
        pickers.append(await Picker(values, kubeconfig, config_dir, f"qwen-epp-7d4b9c-{suffix}").start())
    try:
        liveness, readiness = chart_probes(pickers[0].values)
        for picker in pickers:
            await picker.wait_for(liveness, SERVING)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 30
        while (ready := [await p.health(readiness) for p in pickers]).count(SERVING) != 1:
            assert loop.time() < deadline, "no single leader"
            await asyncio.sleep(0.1)
        leader, standby = pickers if ready[0] == SERVING else pickers[::-1]
        await asyncio.sleep(3)  # more than a lease retry period: the standby stays a standby
        assert [await leader.health(readiness), await standby.health(readiness)] == [SERVING, NOT_SERVING]
        await leader.stop()
        await standby.wait_for(readiness, SERVING, timeout=20)
    finally:
        for picker in pickers:
            await picker.stop()
    lease = f"epp-{NAMESPACE}-{RELEASE if pool_mode else 'qwen-epp'}.gateway-api-inference-extension.sigs.k8s.io"
    assert api.get({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                    "metadata": {"name": lease, "namespace": NAMESPACE}}) is not None


@pytest.mark.slow
async def test_tracing_on_exports_spans_as_the_chart_s_otel_variables_say(api, kubeconfig, config_dir):
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

    from tests.support.extproc import request_body, request_headers
    from tests.tracing.collector import OtlpCollector

    collector = await OtlpCollector().start()
    values = values_with_ports(tracing_enabled=True, otel_exporter_endpoint=f"http://127.0.0.1:{collector.grpc_port}",
                               sampler_arg="1.0", flags={"refresh-metrics-interval": "1s"})
    model_pods(api, {"app": "vllm"})
    api.apply(inference_pool(RELEASE, {"app": "vllm"}, [8000], namespace=NAMESPACE))
    picker = await Picker(values, kubeconfig, config_dir, "qwen-epp-7d4b9c-abcde").start()
    try:
        await picker.wait_for("inference-extension", SERVING)
        port = values.flags["grpc-port"]
        pem = await asyncio.to_thread(ssl.get_server_certificate, ("localhost", port))
        credentials = grpc.ssl_channel_credentials(root_certificates=pem.encode())
        async with grpc.aio.secure_channel(f"localhost:{port}", credentials) as channel:
            call = pb_grpc.ExternalProcessorStub(channel).Process()
            await call.write(request_headers())
            await call.write(request_body(b'{"model":"m","prompt":"hello"}'))
            assert (await call.read()).HasField("request_headers")
            await call.done_writing()
    finally:
        output = await picker.stop()  # exports the spans the batch still holds
        await collector.stop()
    assert picker.proc is not None and picker.proc.returncode == 0, output
    [root] = collector.named("epp.request")
    assert root.service == "llm-d-router/epp" and root.resource["k8s.pod.name"] == "qwen-epp-7d4b9c-abcde"
