"""JSON schemas of the custom resources deploy/kubernetes ships, written from their API fields
(GIE InferencePool v1 as of GIE v1.6, and InferenceObjective v1alpha2, Gateway API HTTPRoute v1, KEDA
ScaledObject v1alpha1, Prometheus Operator PodMonitor/ServiceMonitor v1). Closed objects
(`additionalProperties: false`) so that a misspelt or outdated field fails the test, as the API
server's structural schema would prune or reject it."""

from __future__ import annotations

from typing import Any


def closed(properties: dict[str, Any], required: tuple[str, ...] = ()) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(required), "additionalProperties": False}


STRING = {"type": "string"}
INT = {"type": "integer"}
PORT = {"type": "integer", "minimum": 1, "maximum": 65535}
STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
DURATION = {"type": "string", "pattern": r"^([0-9]{1,5}(h|m|s|ms)){1,4}$"}
METADATA = closed({"name": STRING, "namespace": STRING, "labels": STRING_MAP, "annotations": STRING_MAP},
                  ("name",))
LABEL_SELECTOR = closed({
    "matchLabels": STRING_MAP,
    "matchExpressions": {"type": "array", "items": closed(
        {"key": STRING, "operator": STRING, "values": {"type": "array", "items": STRING}}, ("key", "operator"))},
})


def resource(api_version: str, kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    return closed({"apiVersion": {"const": api_version}, "kind": {"const": kind}, "metadata": METADATA,
                   "spec": spec}, ("apiVersion", "kind", "metadata", "spec"))


# InferencePool as of GIE v1.6: 1-64 selector labels, 1-8 distinct target ports, appProtocol, and an
# optional endpointPickerRef whose port is required when it names a Service (the CRD's CEL rule).
_LABEL_VALUE = {"type": "string", "maxLength": 63, "pattern": r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"}
_ENDPOINT_PICKER_REF = {
    **closed({
        "group": {"type": "string", "maxLength": 253,
                  "pattern": r"^$|^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"},
        "kind": {"type": "string", "minLength": 1, "maxLength": 63, "pattern": r"^[a-zA-Z]([-a-zA-Z0-9]*[a-zA-Z0-9])?$"},
        "name": {"type": "string", "minLength": 1, "maxLength": 253},
        "port": closed({"number": PORT}, ("number",)),
        "failureMode": {"enum": ["FailOpen", "FailClose"]},
    }, ("name",)),
    "if": {"properties": {"kind": {"const": "Service"}}},  # also when kind is omitted (its default)
    "then": {"required": ["port"]},
}
INFERENCE_POOL = resource("inference.networking.k8s.io/v1", "InferencePool", closed({
    "selector": closed({"matchLabels": {"type": "object", "additionalProperties": _LABEL_VALUE,
                                        "minProperties": 1, "maxProperties": 64}}, ("matchLabels",)),
    "targetPorts": {"type": "array", "minItems": 1, "maxItems": 8, "uniqueItems": True,
                    "items": closed({"number": PORT}, ("number",))},
    "appProtocol": {"enum": ["http", "kubernetes.io/h2c"]},
    "endpointPickerRef": _ENDPOINT_PICKER_REF,
}, ("selector", "targetPorts")))

INFERENCE_OBJECTIVE = resource("inference.networking.x-k8s.io/v1alpha2", "InferenceObjective", closed({
    "priority": INT,
    "poolRef": closed({"group": STRING, "kind": STRING, "name": {"type": "string", "minLength": 1}}, ("name",)),
}, ("poolRef",)))

_PARENT_REF = closed({"group": STRING, "kind": STRING, "namespace": STRING, "name": STRING,
                      "sectionName": STRING, "port": PORT}, ("name",))
_BACKEND_REF = closed({"group": STRING, "kind": STRING, "namespace": STRING, "name": STRING, "port": PORT,
                       "weight": {"type": "integer", "minimum": 0}, "filters": {"type": "array"}}, ("name",))
_MATCH = closed({
    "path": closed({"type": {"enum": ["Exact", "PathPrefix", "RegularExpression"]}, "value": STRING}),
    "headers": {"type": "array"}, "queryParams": {"type": "array"}, "method": STRING,
})
HTTP_ROUTE = resource("gateway.networking.k8s.io/v1", "HTTPRoute", closed({
    "parentRefs": {"type": "array", "items": _PARENT_REF},
    "hostnames": {"type": "array", "items": STRING},
    "rules": {"type": "array", "items": closed({
        "name": STRING,
        "matches": {"type": "array", "items": _MATCH},
        "filters": {"type": "array"},
        "backendRefs": {"type": "array", "items": _BACKEND_REF},
        "timeouts": closed({"request": DURATION, "backendRequest": DURATION}),
        "retry": {"type": "object"},
        "sessionPersistence": {"type": "object"},
    })},
}))

_PROMETHEUS_TRIGGER_METADATA = {
    "type": "object", "additionalProperties": {"type": "string"},
    "required": ["serverAddress", "query", "threshold"],
    "properties": {"serverAddress": {"type": "string", "pattern": "^https?://"}, "query": STRING,
                   "threshold": {"type": "string", "pattern": r"^[0-9.]+$"},
                   "activationThreshold": {"type": "string", "pattern": r"^[0-9.]+$"}},
}
SCALED_OBJECT = resource("keda.sh/v1alpha1", "ScaledObject", closed({
    "scaleTargetRef": closed({"apiVersion": STRING, "kind": STRING, "name": STRING,
                              "envSourceContainerName": STRING}, ("name",)),
    "pollingInterval": INT, "cooldownPeriod": INT, "initialCooldownPeriod": INT, "idleReplicaCount": INT,
    "minReplicaCount": INT, "maxReplicaCount": INT,
    "fallback": closed({"failureThreshold": INT, "replicas": INT, "behavior": STRING}),
    "advanced": closed({
        "restoreToOriginalReplicaCount": {"type": "boolean"},
        "horizontalPodAutoscalerConfig": closed({"name": STRING, "behavior": {"type": "object"}}),
        "scalingModifiers": {"type": "object"},
    }),
    "triggers": {"type": "array", "minItems": 1, "items": {
        **closed({"type": STRING, "name": STRING, "metadata": STRING_MAP, "useCachedMetrics": {"type": "boolean"},
                  "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
                  "authenticationRef": closed({"name": STRING, "kind": STRING}, ("name",))},
                 ("type", "metadata")),
        "if": {"properties": {"type": {"const": "prometheus"}}},
        "then": {"properties": {"metadata": _PROMETHEUS_TRIGGER_METADATA}},
    }},
}, ("scaleTargetRef", "triggers")))

_SCRAPE_ENDPOINT = {"port": STRING, "path": STRING, "interval": DURATION, "scrapeTimeout": DURATION,
                    "scheme": {"enum": ["http", "https"]}, "honorLabels": {"type": "boolean"},
                    "relabelings": {"type": "array"}, "metricRelabelings": {"type": "array"},
                    # Sent as `Authorization: <type> <secret's key>` (type defaults to Bearer).
                    "authorization": closed({"type": STRING, "credentials": closed(
                        {"name": STRING, "key": STRING, "optional": {"type": "boolean"}}, ("key",))})}
POD_MONITOR = resource("monitoring.coreos.com/v1", "PodMonitor", closed({
    "selector": LABEL_SELECTOR, "namespaceSelector": {"type": "object"}, "jobLabel": STRING,
    "podMetricsEndpoints": {"type": "array", "items": closed(_SCRAPE_ENDPOINT)},
}, ("selector",)))
SERVICE_MONITOR = resource("monitoring.coreos.com/v1", "ServiceMonitor", closed({
    "selector": LABEL_SELECTOR, "namespaceSelector": {"type": "object"}, "jobLabel": STRING,
    "endpoints": {"type": "array", "items": closed(_SCRAPE_ENDPOINT)},
}, ("selector",)))

CUSTOM_RESOURCE_SCHEMAS: dict[tuple[str, str], dict[str, Any]] = {
    ("inference.networking.k8s.io/v1", "InferencePool"): INFERENCE_POOL,
    ("inference.networking.x-k8s.io/v1alpha2", "InferenceObjective"): INFERENCE_OBJECTIVE,
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): HTTP_ROUTE,
    ("keda.sh/v1alpha1", "ScaledObject"): SCALED_OBJECT,
    ("monitoring.coreos.com/v1", "PodMonitor"): POD_MONITOR,
    ("monitoring.coreos.com/v1", "ServiceMonitor"): SERVICE_MONITOR,
}
