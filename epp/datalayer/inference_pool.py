"""An InferencePool and its pods as endpoints: pure translation of API objects, no I/O.

Endpoint labels come from pod metadata: every pod label, plus every annotation under
`llm-epp.io/` with that prefix stripped (e.g. `llm-epp.io/kv-events-port: "5557"` becomes the
label `kv-events-port`), plus `llm-epp.io/pod` and `llm-epp.io/endpoint` (`<pod>-rank-<i>`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from epp.datalayer.registry import EndpointSpec
from epp.kube.client import KubernetesError

POOL_GROUP = "inference.networking.k8s.io"
POOL_GROUP_ALPHA = "inference.networking.x-k8s.io"
ACTIVE_PORTS_ANNOTATION = "inference.networking.k8s.io/active-ports"
ANNOTATION_PREFIX = "llm-epp.io/"
LABEL_POD = "llm-epp.io/pod"
LABEL_ENDPOINT = "llm-epp.io/endpoint"
# The openai-parser reads HTTP/1.1 or HTTP/2 OpenAI bodies; `kubernetes.io/h2c` pools are vLLM gRPC.
SUPPORTED_APP_PROTOCOLS = frozenset({"http"})



@dataclass(frozen=True)
class PoolView:
    """What decides the pool's endpoints: a label selector and the target ports (rank order)."""

    selector: Mapping[str, str]
    target_ports: tuple[int, ...]
    app_protocol: str = "http"

    def selector_text(self) -> str:
        """The selector as the API's `labelSelector` query (`k=v,k=v`)."""
        return ",".join(f"{k}={v}" for k, v in sorted(self.selector.items()))


def parse_selector(text: str) -> dict[str, str]:
    """`app=x,tier=y` (equality only, as GIE's `--endpoint-selector`) into a label mapping."""
    selector: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, eq, value = part.partition("=")
        key, value = key.strip(), value.strip().lstrip("=")
        if not eq or not key or "!" in key:
            raise KubernetesError(
                f"--endpoint-selector: {part!r} is not key=value (only equality selectors are supported)")
        selector[key] = value
    if not selector:
        raise KubernetesError("--endpoint-selector: at least one key=value is required")
    return selector


def parse_target_ports(text: str) -> tuple[int, ...]:
    """`8000[,8001]` into ports; 1-8 distinct ports, as InferencePool `targetPorts` allows."""
    ports: list[int] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        if not part.isdigit() or not 0 < int(part) < 65536:
            raise KubernetesError(f"--endpoint-target-ports: {part!r} is not a port 1-65535")
        ports.append(int(part))
    _check_ports(ports, "--endpoint-target-ports", KubernetesError)
    return tuple(ports)


def _check_ports(ports: Sequence[int], where: str, error: type[Exception]) -> None:
    if not 1 <= len(ports) <= 8:
        raise error(f"{where}: 1 to 8 ports are required, got {len(ports)}")
    if len(set(ports)) != len(ports):
        raise error(f"{where}: ports must be distinct, got {list(ports)}")


class PoolSpecError(ValueError):
    """An InferencePool whose spec cannot be used; the message names the field."""


def pool_view_of(pool: Mapping[str, Any]) -> PoolView:
    """The view of an InferencePool object: v1 (`selector.matchLabels`, `targetPorts[].number`)
    or v1alpha2 (`selector` map, `targetPortNumber`)."""
    spec = pool.get("spec")
    if not isinstance(spec, Mapping):
        raise PoolSpecError("spec: missing")
    raw_selector = spec.get("selector")
    if isinstance(raw_selector, Mapping) and "matchLabels" in raw_selector:
        raw_selector = raw_selector.get("matchLabels")
    if not isinstance(raw_selector, Mapping) or not raw_selector or \
            not all(isinstance(k, str) and isinstance(v, str) for k, v in raw_selector.items()):
        raise PoolSpecError("spec.selector.matchLabels: must map label names to values (non-empty)")
    if "targetPorts" in spec:
        entries = spec.get("targetPorts")
        if not isinstance(entries, list) or not all(
                isinstance(e, Mapping) and _is_port(e.get("number")) for e in entries):
            raise PoolSpecError("spec.targetPorts: must be a list of {number: 1-65535}")
        ports = [int(e["number"]) for e in entries]
    elif _is_port(spec.get("targetPortNumber")):
        ports = [int(spec["targetPortNumber"])]
    else:
        raise PoolSpecError("spec.targetPorts: missing")
    _check_ports(ports, "spec.targetPorts", PoolSpecError)
    protocol = spec.get("appProtocol") or "http"
    return PoolView(dict(raw_selector), tuple(ports), str(protocol))


def _is_port(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 < value < 65536


def pod_is_ready(pod: Mapping[str, Any]) -> bool:
    """Ready condition True, an IP, and not terminating."""
    meta = pod.get("metadata") or {}
    if meta.get("deletionTimestamp"):
        return False
    status = pod.get("status") or {}
    if not status.get("podIP"):
        return False
    for condition in status.get("conditions") or ():
        if isinstance(condition, Mapping) and condition.get("type") == "Ready":
            return condition.get("status") == "True"
    return False


def _active_ports(annotations: Mapping[str, Any]) -> frozenset[int] | None:
    text = annotations.get(ACTIVE_PORTS_ANNOTATION)
    if not isinstance(text, str):
        return None
    ports = {int(p) for p in (q.strip() for q in text.split(",")) if p.isdigit()}
    return frozenset(ports)


def pod_endpoints(pod: Mapping[str, Any], view: PoolView) -> tuple[EndpointSpec, ...]:
    """The endpoints of one pod: none unless Ready and selected; else one per (active) target port."""
    if not pod_is_ready(pod):
        return ()
    meta = pod.get("metadata") or {}
    labels = meta.get("labels") or {}
    if any(labels.get(k) != v for k, v in view.selector.items()):
        return ()
    annotations = meta.get("annotations") or {}
    name = str(meta.get("name", ""))
    base = {str(k): str(v) for k, v in labels.items()}
    for key, value in annotations.items():
        if isinstance(key, str) and key.startswith(ANNOTATION_PREFIX) and isinstance(value, str):
            base[key[len(ANNOTATION_PREFIX):]] = value
    base[LABEL_POD] = name
    active = _active_ports(annotations)
    address = str(pod["status"]["podIP"])
    specs = []
    for rank, port in enumerate(view.target_ports):
        if active is not None and port not in active:
            continue
        specs.append(EndpointSpec(address, port, {**base, LABEL_ENDPOINT: f"{name}-rank-{rank}"}))
    return tuple(specs)


