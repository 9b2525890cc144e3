"""An InferencePool and its pods as endpoints: pure translation of API objects, no I/O.

The pool is read as GIE v1.6 defines it (`inference.networking.k8s.io/v1`): a `selector` of 1-64
labels, 1-8 distinct `targetPorts` (one endpoint per port: data-parallel ranks), `appProtocol`
`http` (the default) or `kubernetes.io/h2c`, and an optional `endpointPickerRef` whose
`failureMode` tells the gateway what to do while the picker is down (see `envoy_options`).

Endpoint labels come from pod metadata: every pod label, plus every annotation under
`llm-epp.io/` with that prefix stripped (e.g. `llm-epp.io/kv-events-port: "5557"` becomes the
label `kv-events-port`), plus `llm-epp.io/pod` and `llm-epp.io/endpoint` (`<pod>-rank-<i>`).
"""

from __future__ import annotations

import re
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
APP_PROTOCOL_HTTP = "http"
APP_PROTOCOL_H2C = "kubernetes.io/h2c"
# The gateway's protocol to the model servers; the picker reads the same OpenAI requests either way
# (Envoy hands ext_proc the same headers and body whatever codec the upstream speaks).
SUPPORTED_APP_PROTOCOLS = frozenset({APP_PROTOCOL_HTTP, APP_PROTOCOL_H2C})
FAIL_OPEN = "FailOpen"
FAIL_CLOSE = "FailClose"
MAX_SELECTOR_LABELS = 64
_KIND = re.compile(r"^[a-zA-Z]([-a-zA-Z0-9]*[a-zA-Z0-9])?$")
_GROUP = re.compile(r"^$|^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


@dataclass(frozen=True)
class EndpointPickerRef:
    """Where the gateway reaches the pool's picker, and what it does while the picker is down."""

    name: str
    group: str = ""
    kind: str = "Service"
    port: int | None = None
    failure_mode: str = FAIL_CLOSE

    @property
    def fail_open(self) -> bool:
        return self.failure_mode == FAIL_OPEN


@dataclass(frozen=True)
class PoolView:
    """What decides the pool's endpoints: a label selector and the target ports (rank order)."""

    selector: Mapping[str, str]
    target_ports: tuple[int, ...]
    app_protocol: str = APP_PROTOCOL_HTTP
    endpoint_picker: EndpointPickerRef | None = None

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
    """The view of an InferencePool object: v1 (`selector.matchLabels`, `targetPorts[].number`,
    `endpointPickerRef`) or v1alpha2 (`selector` map, `targetPortNumber`, `extensionRef`)."""
    spec = pool.get("spec")
    if not isinstance(spec, Mapping):
        raise PoolSpecError("spec: missing")
    raw_selector = spec.get("selector")
    if isinstance(raw_selector, Mapping) and "matchLabels" in raw_selector:
        raw_selector = raw_selector.get("matchLabels")
    if not isinstance(raw_selector, Mapping) or not raw_selector or \
            not all(isinstance(k, str) and isinstance(v, str) for k, v in raw_selector.items()):
        raise PoolSpecError("spec.selector.matchLabels: must map label names to values (non-empty)")
    if len(raw_selector) > MAX_SELECTOR_LABELS:
        raise PoolSpecError(f"spec.selector.matchLabels: at most {MAX_SELECTOR_LABELS} labels, "
                            f"got {len(raw_selector)}")
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
    protocol = spec.get("appProtocol") or APP_PROTOCOL_HTTP
    if not isinstance(protocol, str):
        raise PoolSpecError(f"spec.appProtocol: must be {APP_PROTOCOL_HTTP!r} or {APP_PROTOCOL_H2C!r}")
    if "endpointPickerRef" in spec:
        ref = _picker_ref(spec["endpointPickerRef"], "spec.endpointPickerRef", "port")
    elif "extensionRef" in spec:  # v1alpha2
        ref = _picker_ref(spec["extensionRef"], "spec.extensionRef", "portNumber")
    else:  # optional since v1.6: the pool is served all the same
        ref = None
    return PoolView(dict(raw_selector), tuple(ports), protocol, ref)


def _picker_ref(raw: Any, where: str, port_field: str) -> EndpointPickerRef:
    """`endpointPickerRef` (v1: `port: {number}`) or v1alpha2's `extensionRef` (`portNumber`, 9002 if unset)."""
    if not isinstance(raw, Mapping):
        raise PoolSpecError(f"{where}: must be an object with at least a name")
    name = raw.get("name")
    if not isinstance(name, str) or not 0 < len(name) <= 253:
        raise PoolSpecError(f"{where}.name: required, the picker's Service name (1-253 characters)")
    group = raw.get("group", "")
    if not isinstance(group, str) or not _GROUP.match(group) or len(group) > 253:
        raise PoolSpecError(f"{where}.group: {group!r} is not an API group (\"\" is the core group)")
    kind = raw.get("kind") or "Service"
    if not isinstance(kind, str) or not _KIND.match(kind) or len(kind) > 63:
        raise PoolSpecError(f"{where}.kind: {kind!r} is not a resource kind")
    failure_mode = raw.get("failureMode") or FAIL_CLOSE
    if failure_mode not in (FAIL_OPEN, FAIL_CLOSE):
        raise PoolSpecError(f"{where}.failureMode: must be {FAIL_OPEN} or {FAIL_CLOSE}, not {failure_mode!r}")
    port: int | None
    if port_field == "port":
        entry = raw.get("port")
        if entry is None:
            port = None
        elif isinstance(entry, Mapping) and _is_port(entry.get("number")):
            port = int(entry["number"])
        else:
            raise PoolSpecError(f"{where}.port.number: must be a port 1-65535")
        if port is None and kind == "Service":
            raise PoolSpecError(f"{where}.port.number: required when kind is Service")
    else:
        value = raw.get(port_field, 9002 if kind == "Service" else None)
        if value is not None and not _is_port(value):
            raise PoolSpecError(f"{where}.{port_field}: must be a port 1-65535")
        port = value
    return EndpointPickerRef(name, group, kind, port, failure_mode)


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


def envoy_options(view: PoolView, namespace: str | None = None,
                  cluster_domain: str = "cluster.local") -> dict[str, Any]:
    """What the pool asks of the Envoy in front of it, as `epp.envoy.render_config` arguments:
    `upstream_protocol` from `appProtocol`, `failure_mode_allow` from `endpointPickerRef.failureMode`
    and, when the ref names a core Service, the picker's address (`<name>.<namespace>.svc.<domain>`)."""
    if view.app_protocol not in SUPPORTED_APP_PROTOCOLS:
        raise PoolSpecError(f"spec.appProtocol: {view.app_protocol!r} is not supported "
                            f"({' or '.join(sorted(SUPPORTED_APP_PROTOCOLS))})")
    options: dict[str, Any] = {
        "upstream_protocol": "h2c" if view.app_protocol == APP_PROTOCOL_H2C else "http",
        "failure_mode_allow": view.endpoint_picker is not None and view.endpoint_picker.fail_open,
    }
    ref = view.endpoint_picker
    if ref is not None and ref.kind == "Service" and ref.group == "" and ref.port is not None:
        options["epp_host"] = f"{ref.name}.{namespace}.svc.{cluster_domain}" if namespace else ref.name
        options["epp_port"] = ref.port
    return options
