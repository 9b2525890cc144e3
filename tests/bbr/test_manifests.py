"""deploy/kubernetes/components/bbr: valid Kubernetes objects that fit together and fit `epp bbr`."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from epp.bbr.adapters import parse_mapping
from epp.bbr.cli import build_parser
from epp.bbr.service import BASE_MODEL_HEADER

COMPONENT = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes" / "components" / "bbr"
KUBERNETES_VERSIONS = ("1.30", "1.32", "1.34")


def objects() -> list[dict]:
    listed = yaml.safe_load((COMPONENT / "kustomization.yaml").read_text())["resources"]
    assert sorted(listed) == sorted(p.name for p in COMPONENT.glob("*.yaml") if p.name != "kustomization.yaml")
    return [doc for name in listed for doc in yaml.safe_load_all((COMPONENT / name).read_text()) if doc]


def one(kind: str) -> dict:
    [found] = [o for o in objects() if o["kind"] == kind]
    return found


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_builtin_objects_validate(version):
    for obj in objects():
        if obj["kind"] in ("Deployment", "Service", "ConfigMap"):
            kubernetes_validate.validate(obj, version, strict=True)


def test_the_deployment_runs_epp_bbr_with_flags_it_takes_and_probes_its_health_port():
    container = one("Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert container["args"][0] == "bbr"
    args = build_parser().parse_args(container["args"][1:])
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert (ports["grpc-ext-proc"], ports["grpc-health"], ports["http-metrics"]) == (
        args.grpc_port, args.grpc_health_port, args.metrics_port)
    assert container["readinessProbe"]["grpc"]["port"] == args.grpc_health_port
    mount = next(m for m in container["volumeMounts"] if m["name"] == "adapters")
    assert args.adapters == [mount["mountPath"]]
    service_ports = {p["targetPort"] for p in one("Service")["spec"]["ports"]}
    assert service_ports <= set(ports)


def test_the_routes_name_the_base_models_the_mapping_declares():
    config_map = one("ConfigMap")
    mapping = parse_mapping([(key, text.encode()) for key, text in config_map["data"].items()])
    bases = set(mapping.bases.values())
    route = one("HTTPRoute")
    matched = set()
    for rule in route["spec"]["rules"]:
        [match] = rule["matches"]
        [header] = match["headers"]
        assert header["name"].lower() == BASE_MODEL_HEADER and header["type"] == "Exact"
        matched.add(header["value"])
        assert rule["backendRefs"][0]["kind"] == "InferencePool"
    assert matched == bases
    deployment_volume = one("Deployment")["spec"]["template"]["spec"]["volumes"][0]
    assert deployment_volume["configMap"]["name"] == config_map["metadata"]["name"]
