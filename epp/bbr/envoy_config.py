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
from epp.envoy import CLIENT_STRIPPED_HEADERS


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

_GRPC_CLUSTER = """\
  - name: {name}
    type: STATIC
    connect_timeout: 2s
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config:
          http2_protocol_options: {{}}
    load_assignment:
      cluster_name: {name}
      endpoints:
      - lb_endpoints:
        - endpoint: {{ address: {{ socket_address: {{ address: {host}, port_value: {port} }} }} }}
"""

_TEMPLATE = """\
# Several pools behind one Envoy: the body-based router (epp bbr at {bbr_host}:{bbr_port}) names the
# model, the route of its base model chooses the pool, that pool's picker chooses the replica.
admin:
  address:
    socket_address: {{ address: 127.0.0.1, port_value: {admin_port} }}
static_resources:
  listeners:
  - name: inference
    address:
      socket_address: {{ address: {listen_address}, port_value: {listen_port} }}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: inference
          codec_type: AUTO
          stream_idle_timeout: 300s
          request_timeout: 0s
          route_config:
            name: inference
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:
{routes}          http_filters:
          - name: envoy.filters.http.header_mutation
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.header_mutation.v3.HeaderMutation
              mutations:
                request_mutations:
{stripped}          # The body-based router: request headers and body only; it answers once the body has ended.
          - name: bbr
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor
              grpc_service:
                envoy_grpc:
                  cluster_name: bbr
                timeout: 10s
              failure_mode_allow: false
              message_timeout: 1000s
              processing_mode:
                request_header_mode: SEND
                response_header_mode: SKIP
                request_body_mode: FULL_DUPLEX_STREAMED
                response_body_mode: NONE
                request_trailer_mode: SEND
                response_trailer_mode: SKIP
          - name: envoy.filters.http.header_to_metadata
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.header_to_metadata.v3.Config
              request_rules:
              - header: x-gateway-destination-endpoint-subset
                on_header_present:
                  metadata_namespace: envoy.lb.subset_hint
                  key: x-gateway-destination-endpoint-subset
                  type: STRING
                remove: true
          # The pool's picker: each route names its own (per-route grpc_service); this default is the first.
          - name: envoy.filters.http.ext_proc
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor
              grpc_service:
                envoy_grpc:
                  cluster_name: epp-0
                timeout: 10s
              failure_mode_allow: false
              message_timeout: 1000s
              metadata_options:
                forwarding_namespaces:
                  untyped: ["envoy.lb.subset_hint", "envoy.lb"]
                receiving_namespaces:
                  untyped: ["envoy.lb"]
              processing_mode:
                request_header_mode: SEND
                response_header_mode: SEND
                request_body_mode: FULL_DUPLEX_STREAMED
                response_body_mode: FULL_DUPLEX_STREAMED
                request_trailer_mode: SEND
                response_trailer_mode: SEND
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
  clusters:
{clusters}  - name: original_destination_cluster
    type: ORIGINAL_DST
    lb_policy: CLUSTER_PROVIDED
    connect_timeout: 5s
    original_dst_lb_config:
      use_http_header: true
      http_header_name: x-gateway-destination-endpoint
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
    clusters = _GRPC_CLUSTER.format(name="bbr", host=bbr_host, port=bbr_port)
    clusters += "".join(_GRPC_CLUSTER.format(name=f"epp-{i}", host=p.epp_host, port=p.epp_port)
                        for i, p in enumerate(pools))
    stripped = "".join(f"                - remove: {name}\n" for name in (*CLIENT_STRIPPED_HEADERS, MODEL_HEADER,
                                                                          BASE_MODEL_HEADER))
    return _TEMPLATE.format(bbr_host=bbr_host, bbr_port=bbr_port, admin_port=admin_port,
                            listen_address=listen_address, listen_port=listen_port, routes=routes,
                            stripped=stripped, clusters=clusters)
