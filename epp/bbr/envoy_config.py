"""An Envoy bootstrap for several pools behind one listener: the body-based router, then each pool's picker.

The filters, in order: clients' copies of the routing headers are removed; the router (`epp bbr`)
sets the model headers and clears the route cache; the route matching `x-gateway-base-model-name`
is chosen; that route's picker (the ext_proc filter's per-route `grpc_service`) picks the replica;
`ORIGINAL_DST` sends the request there. A model no pool serves gets 404 without any picker. What a
gateway builds from an HTTPRoute whose rules match the header and name InferencePools is the same.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from epp.bbr.service import BASE_MODEL_HEADER, MODEL_HEADER
from epp.envoy import (
    CLIENT_STRIPPED_HEADERS,
    SUBSET_HINT_FILTER,
    bootstrap,
    ext_proc_filter,
    grpc_cluster,
    original_dst_cluster,
    strip_headers_filter,
)


@dataclass(frozen=True)
class Pool:
    """One pool behind the listener: the base model its replicas serve and its picker's ext_proc address."""

    base_model: str
    epp_host: str
    epp_port: int


_NO_POOL = '{"error":{"message":"no pool serves this model","type":"invalid_request_error","param":"model","code":404}}'

_ROUTE = """\
              - match:
                  prefix: "/"
                  headers:
                  - name: {header}
                    string_match: {{ exact: "{model}" }}
                route: {{ cluster: original_destination_cluster, timeout: 0s, idle_timeout: 300s }}
                typed_per_filter_config:
                  envoy.filters.http.ext_proc:
                    "@type": type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute
                    overrides:
                      grpc_service:
                        envoy_grpc: {{ cluster_name: {cluster} }}
                        timeout: 10s
"""

_DEFAULT_ROUTE = """\
              - match: {{ prefix: "/" }}
                direct_response:
                  status: 404
                  body: {{ inline_string: '{body}' }}
                typed_per_filter_config:
                  envoy.filters.http.ext_proc:
                    "@type": type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute
                    disabled: true
"""


def _quoted(value: str) -> str:
    """A YAML double-quoted scalar's inside (model names are client-chosen strings, checked here)."""
    if any(c in value for c in '"\\\n\r') or not value:
        raise ValueError(f"model name {value!r} cannot be written into the Envoy config")
    return value


def render_bbr_config(pools: Sequence[Pool], *, bbr_port: int, bbr_host: str = "127.0.0.1",
                      listen_port: int = 8081, admin_port: int = 19000,
                      listen_address: str = "127.0.0.1") -> str:
    """Envoy YAML: the router first, then one route (and picker) per pool by base model; others get 404."""
    if not pools:
        raise ValueError("name at least one pool")
    models = [p.base_model for p in pools]
    if len(set(models)) != len(models):
        raise ValueError(f"two pools serve the same base model: {sorted(models)}")
    routes = "".join(_ROUTE.format(header=BASE_MODEL_HEADER, model=_quoted(p.base_model), cluster=f"epp-{i}")
                     for i, p in enumerate(pools))
    routes += _DEFAULT_ROUTE.format(body=_NO_POOL)
    filters = strip_headers_filter((*CLIENT_STRIPPED_HEADERS, MODEL_HEADER, BASE_MODEL_HEADER))
    filters += ext_proc_filter(cluster="bbr", responses="none", name="bbr", picker_metadata=False,
                               comment="The body-based router: request headers and body only; it answers once "
                                       "the body has ended.")
    filters += SUBSET_HINT_FILTER + ext_proc_filter(
        cluster="epp-0", comment="The pool's picker: each route names its own (per-route grpc_service); this "
                                 "default is the first.")
    clusters = grpc_cluster("bbr", bbr_host, bbr_port)
    clusters += "".join(grpc_cluster(f"epp-{i}", p.epp_host, p.epp_port) for i, p in enumerate(pools))
    clusters += original_dst_cluster()
    comment = (f"# Several pools behind one Envoy: the body-based router (epp bbr at {bbr_host}:{bbr_port}) names the\n"
               "# model, the route of its base model chooses the pool, that pool's picker chooses the replica.\n")
    return bootstrap(comment, admin_port=admin_port, listen_address=listen_address, listen_port=listen_port,
                     routes=routes, filters=filters, clusters=clusters)
