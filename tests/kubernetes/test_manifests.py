"""deploy/kubernetes: every overlay renders with `kubectl kustomize`; built-in kinds validate against
the Kubernetes OpenAPI schemas; custom resources against their API fields; the pieces refer to
each other correctly (pool ↔ pods ↔ picker ↔ route ↔ autoscaler)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from epp.config.loader import load_config_text
from epp.datalayer.inference_pool import envoy_options, pool_view_of
from epp.envoy import envoy_binary, render_config
from tests.kubernetes.crd_schemas import CUSTOM_RESOURCE_SCHEMAS

pytestmark = pytest.mark.k8s  # renders deploy/kubernetes with `kubectl kustomize`

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy" / "kubernetes"
OVERLAYS = sorted(p.name for p in (DEPLOY / "overlays").iterdir() if (p / "kustomization.yaml").exists())
# Kubernetes minor versions the built-in objects must be valid for.
KUBERNETES_VERSIONS = ("1.30", "1.32", "1.34")
BUILTIN_GROUPS = {"", "apps", "rbac.authorization.k8s.io", "policy", "networking.k8s.io"}
NAMESPACE = "llm-serving"
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding"}


def kubectl() -> str:
    path = shutil.which("kubectl")
    assert path is not None, "the k8s marker runs these tests only where kubectl is installed"
    return path


def render(overlay: str) -> list[dict]:
    out = subprocess.run([kubectl(), "kustomize", str(DEPLOY / "overlays" / overlay)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {overlay: render(overlay) for overlay in OVERLAYS}


def group_of(obj: dict) -> str:
    return obj["apiVersion"].rpartition("/")[0]


def one(objects: list[dict], kind: str, name: str | None = None) -> dict:
    found = [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def test_the_overlays_are_the_documented_ones():
    assert OVERLAYS == ["envoy", "gateway", "production"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_builtin_objects_validate_against_the_kubernetes_schemas(rendered, overlay):
    builtin = [o for o in rendered[overlay] if group_of(o) in BUILTIN_GROUPS]
    assert {"Deployment", "Service", "ServiceAccount", "Role", "RoleBinding", "ConfigMap", "NetworkPolicy",
            "PodDisruptionBudget"} <= {o["kind"] for o in builtin}
    for version in KUBERNETES_VERSIONS:
        for obj in builtin:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{overlay}: {obj['kind']}/{obj['metadata']['name']} invalid for {version}: {exc}")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_custom_resources_match_their_api_fields(rendered, overlay):
    custom = [o for o in rendered[overlay] if group_of(o) not in BUILTIN_GROUPS]
    assert custom, "every overlay ships an InferencePool"
    for obj in custom:
        schema = CUSTOM_RESOURCE_SCHEMAS.get((obj["apiVersion"], obj["kind"]))
        assert schema is not None, f"{overlay}: no schema for {obj['apiVersion']} {obj['kind']}"
        try:
            jsonschema.validate(obj, schema)
        except jsonschema.ValidationError as exc:
            pytest.fail(f"{overlay}: {obj['kind']}/{obj['metadata']['name']}: {exc.message} at {list(exc.path)}")


def test_the_crd_schemas_take_v1_6_pools_and_reject_wrong_fields():
    pool = {"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool", "metadata": {"name": "p"},
            "spec": {"selector": {"matchLabels": {"app": "x"}}, "targetPorts": [{"number": 8000}],
                     "endpointPickerRef": {"name": "epp", "port": {"number": 9002}}}}
    schema = CUSTOM_RESOURCE_SCHEMAS[("inference.networking.k8s.io/v1", "InferencePool")]
    jsonschema.validate(pool, schema)
    no_ref = {k: v for k, v in pool["spec"].items() if k != "endpointPickerRef"}
    for valid in (no_ref,  # optional since v1.6
                  {**no_ref, "targetPorts": [{"number": 8000 + i} for i in range(8)], "appProtocol": "kubernetes.io/h2c"},
                  {**no_ref, "endpointPickerRef": {"name": "epp", "port": {"number": 9002}, "failureMode": "FailOpen"}},
                  {**no_ref, "endpointPickerRef": {"group": "example.io", "kind": "Backend", "name": "epp"}}):
        jsonschema.validate({**pool, "spec": valid}, schema)
    for broken in ({"targetPortNumber": 8000}, {"targetPorts": []}, {"selector": {"app": "x"}},
                   {"targetPorts": [{"number": 8000 + i} for i in range(9)]},
                   {"targetPorts": [{"number": 8000}, {"number": 8000}]},
                   {"selector": {"matchLabels": {f"l{i}": "v" for i in range(65)}}},
                   {"appProtocol": "h2c"},
                   {"endpointPickerRef": {"name": "epp", "portNumber": 9002}},
                   {"endpointPickerRef": {"name": "epp"}},  # a Service needs its port
                   {"endpointPickerRef": {"name": "epp", "port": {"number": 9002}, "failureMode": "Open"}}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate({**pool, "spec": {**pool["spec"], **broken}}, schema)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_lands_in_the_serving_namespace(rendered, overlay):
    for obj in rendered[overlay]:
        if obj["kind"] not in CLUSTER_SCOPED:
            assert obj["metadata"].get("namespace") == NAMESPACE, f"{obj['kind']}/{obj['metadata']['name']}"
    for binding in (o for o in rendered[overlay] if o["kind"] in ("RoleBinding", "ClusterRoleBinding")):
        [subject] = binding["subjects"]
        assert subject["kind"] == "ServiceAccount" and subject["namespace"] == NAMESPACE
        assert subject["name"] == ("epp-metrics-reader" if binding["metadata"]["name"] == "llm-epp-metrics-reader"
                                   else "epp")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pool_pods_picker_and_traffic_refer_to_each_other(rendered, overlay):
    objects = rendered[overlay]
    pool = one(objects, "InferencePool")
    vllm = one(objects, "Deployment", "vllm")
    picker = one(objects, "Deployment", "epp")
    service = one(objects, "Service", "epp")
    pod_labels = vllm["spec"]["template"]["metadata"]["labels"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    vllm_container = vllm["spec"]["template"]["spec"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in vllm_container["ports"]}
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == [ports["http"]]
    # The KV-event ports announced to the picker are the ones the containers open.
    annotations = vllm["spec"]["template"]["metadata"]["annotations"]
    sidecar = vllm["spec"]["template"]["spec"]["containers"][1]
    assert int(annotations["llm-epp.io/kv-events-port"]) == ports["kv-events"]
    assert int(annotations["llm-epp.io/kv-replay-port"]) == ports["kv-replay"]
    assert int(annotations["llm-epp.io/kv-disk-events-port"]) == sidecar["ports"][0]["containerPort"]
    assert vllm_container["command"] == ["epp", "engine", "serve"]
    assert sidecar["command"] == ["epp", "engine", "disk-manager"]
    assert any(a.startswith("--disk-path=") for a in vllm_container["args"])
    assert any(a.startswith("--cpu-offload-bytes=") for a in vllm_container["args"])
    assert vllm_container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    # The pool names the picker's Service and port; the picker serves that pool with TLS.
    ref = pool["spec"]["endpointPickerRef"]
    assert ref["name"] == service["metadata"]["name"]
    grpc = next(p for p in service["spec"]["ports"] if p["name"] == "grpc-ext-proc")
    assert ref["port"]["number"] == grpc["port"] == 9002 and grpc["appProtocol"] == "http2"
    args = picker["spec"]["template"]["spec"]["containers"][0]["args"]
    assert f"--pool-name={pool['metadata']['name']}" in args and "--secure-serving" in args
    container = picker["spec"]["template"]["spec"]["containers"][0]
    assert container["readinessProbe"]["grpc"] == {"port": 9003, "service": "readiness"}
    assert container["livenessProbe"]["grpc"] == {"port": 9003, "service": "liveness"}
    assert picker["spec"]["template"]["spec"]["serviceAccountName"] == "epp"
    for objective in (o for o in objects if o["kind"] == "InferenceObjective"):
        assert objective["spec"]["poolRef"]["name"] == pool["metadata"]["name"]
    for route in (o for o in objects if o["kind"] == "HTTPRoute"):
        backend = route["spec"]["rules"][0]["backendRefs"][0]
        assert (backend["group"], backend["kind"], backend["name"]) == (
            "inference.networking.k8s.io", "InferencePool", pool["metadata"]["name"])
    for scaled in (o for o in objects if o["kind"] == "ScaledObject"):
        assert scaled["spec"]["scaleTargetRef"]["name"] == "vllm"
        queries = " ".join(t["metadata"]["query"] for t in scaled["spec"]["triggers"])
        # The triggers read the picker's pool gauges: they must be metrics the picker really exports.
        exported = picker_metric_names()
        for name in ("epp_pool_waiting_requests", "epp_pool_kv_cache_usage"):
            assert name in queries and name in exported


def picker_metric_names() -> set[str]:
    """Names of the pool gauges a running picker exports."""
    from prometheus_client import CollectorRegistry

    from epp.datalayer.registry import EndpointRegistry
    from epp.fleet.pool_gauges import PoolGauges

    registry = CollectorRegistry()
    PoolGauges(EndpointRegistry()).register(registry)
    return {metric.name for metric in registry.collect()}


def test_the_picker_role_only_reads_what_discovery_needs(rendered):
    role = one(rendered["gateway"], "Role", "epp")
    granted = {(group, resource, verb) for rule in role["rules"] for group in rule["apiGroups"]
               for resource in rule["resources"] for verb in rule["verbs"]}
    assert granted == {(g, r, v) for g, r in [("", "pods"), ("inference.networking.k8s.io", "inferencepools"),
                                              ("inference.networking.x-k8s.io", "inferenceobjectives"),
                                              ("llm-d.ai", "inferenceobjectives")]
                       for v in ("list", "watch")}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_picker_may_review_metrics_tokens_and_a_reader_may_get_metrics(rendered, overlay):
    """--metrics-endpoint-auth (on with --pool-name) asks TokenReview and SubjectAccessReview: the picker's
    ServiceAccount may create both, and the reader account may `get` /metrics."""
    objects = rendered[overlay]
    auth = one(objects, "ClusterRole", "llm-epp-metrics-auth")
    assert auth["rules"] == [
        {"apiGroups": ["authentication.k8s.io"], "resources": ["tokenreviews"], "verbs": ["create"]},
        {"apiGroups": ["authorization.k8s.io"], "resources": ["subjectaccessreviews"], "verbs": ["create"]}]
    assert one(objects, "ClusterRoleBinding", "llm-epp-metrics-auth")["roleRef"]["name"] == "llm-epp-metrics-auth"
    assert one(objects, "ClusterRole", "llm-epp-metrics-reader")["rules"] == [
        {"nonResourceURLs": ["/metrics"], "verbs": ["get"]}]
    args = one(objects, "Deployment", "epp")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert not any(a.startswith("--metrics-endpoint-auth") for a in args)  # the default: on
    for monitor in (o for o in objects if o["kind"] == "ServiceMonitor"):
        secret = one(objects, "Secret", "epp-metrics-reader-token")
        assert secret["metadata"]["annotations"]["kubernetes.io/service-account.name"] == "epp-metrics-reader"
        [endpoint] = monitor["spec"]["endpoints"]
        assert endpoint["authorization"]["credentials"] == {"name": "epp-metrics-reader-token", "key": "token"}


def test_only_the_gateway_reaches_the_ext_proc_port(rendered):
    policy = one(rendered["envoy"], "NetworkPolicy")
    assert policy["spec"]["podSelector"]["matchLabels"] == {"app": "epp"}
    grpc_rules = [r for r in policy["spec"]["ingress"] if {"protocol": "TCP", "port": 9002} in r["ports"]]
    assert len(grpc_rules) == 1 and grpc_rules[0]["from"]
    selector = grpc_rules[0]["from"][0]["podSelector"]["matchLabels"]
    envoy = one(rendered["envoy"], "Deployment", "envoy")
    assert selector.items() <= envoy["spec"]["template"]["metadata"]["labels"].items()
    vllm = one(rendered["envoy"], "Deployment", "vllm")
    assert not selector.items() <= vllm["spec"]["template"]["metadata"]["labels"].items()
    for rule in policy["spec"]["ingress"]:
        if rule is not grpc_rules[0]:
            assert all(p["port"] != 9002 for p in rule["ports"])


def test_the_picker_config_in_the_config_map_loads(rendered):
    config_map = next(o for o in rendered["gateway"] if o["kind"] == "ConfigMap"
                      and o["metadata"]["name"].startswith("epp-config"))
    loaded = load_config_text(config_map["data"]["picker.yaml"], source="epp-config")
    assert loaded.objectives == {"batch": -1}


def test_production_scales_and_keeps_two_pickers_one_ready_by_leader_election(rendered):
    objects = rendered["production"]
    picker = one(objects, "Deployment", "epp")
    assert picker["spec"]["replicas"] == 2
    assert "--ha-enable-leader-election" in picker["spec"]["template"]["spec"]["containers"][0]["args"]
    assert one(objects, "Role", "epp-leader-election")["rules"] == [
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["get", "create", "update"]}]
    assert not any(o["kind"] == "Role" and o["metadata"]["name"] == "epp-leader-election" for o in rendered["gateway"])
    assert one(objects, "PodDisruptionBudget", "epp")["spec"]["minAvailable"] == 1
    assert one(objects, "PodMonitor")["spec"]["selector"]["matchLabels"] == {"app": "vllm"}
    assert one(objects, "ServiceMonitor")["spec"]["selector"]["matchLabels"] == {"app": "epp"}
    triggers = one(objects, "ScaledObject")["spec"]["triggers"]
    assert [t["name"] for t in triggers] == ["waiting-requests", "kv-cache-usage"]


@pytest.mark.envoy
def test_the_envoy_overlay_runs_our_ext_proc_config_and_envoy_accepts_it(rendered, tmp_path):
    bootstrap = (DEPLOY / "overlays" / "envoy" / "envoy-bootstrap.yaml").read_text()
    # What the pool asks of its gateway (the picker's Service and port, FailClose, HTTP/1.1).
    pool = one(rendered["envoy"], "InferencePool")
    options = envoy_options(pool_view_of(pool), pool["metadata"]["namespace"])
    assert options == {"upstream_protocol": "http", "failure_mode_allow": False,
                       "epp_host": f"epp.{NAMESPACE}.svc.cluster.local", "epp_port": 9002}
    assert bootstrap == render_config(listen_address="0.0.0.0", epp_tls=True, **options), \
        "regenerate with: epp envoy-config --listen-address 0.0.0.0 --epp-tls " \
        "--inference-pool <(kubectl kustomize deploy/kubernetes/overlays/envoy)"
    config_map = next(o for o in rendered["envoy"] if o["kind"] == "ConfigMap"
                      and o["metadata"]["name"].startswith("envoy-config"))
    assert config_map["data"]["envoy.yaml"] == bootstrap
    path = tmp_path / "envoy.yaml"
    path.write_text(bootstrap)
    out = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(path)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
