"""The `epp` command: serve the picker, check a config, run the demo, and the model-server tools."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Callable, Sequence
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING

from epp import limits as lim
from epp.envoy import RESPONSE_MODES, UPSTREAM_PROTOCOLS
from epp.extras import MissingExtra, require_extra
from epp.server.extproc import DEFAULT_MAX_BODY_BYTES

if TYPE_CHECKING:  # pragma: no cover
    from epp.datalayer.registry import EndpointSpec
    from epp.server.runner import EppServer, ServeOptions

# `epp engine TOOL`: the module whose main() takes the rest of the line, and what it does.
ENGINE_TOOLS = {
    "serve": ("epp.engine.vllm.cli", "start one vLLM replica wired to the picker (--dry-run prints the command)"),
    "disk-manager": ("epp.engine.disk_tier.cli", "keep a vLLM disk KV tier within budget, publish its evictions"),
    "pd-sidecar": ("epp.engine.pd_sidecar", "decode pod's P/D sidecar: prefill on the picked prefiller, decode here"),
}


# `epp serve`'s bounds on hostile input: flag, type, default, and what happens past the bound.
LIMIT_FLAGS: tuple[tuple[str, type, float, str], ...] = (
    ("--max-concurrent-streams", int, lim.DEFAULT_MAX_CONCURRENT_STREAMS, "ext_proc streams at once; more get 429"),
    ("--stream-idle-timeout", float, lim.DEFAULT_STREAM_IDLE_TIMEOUT_S,
     "seconds an unanswered request may send nothing; then 408"),
    ("--max-request-headers", int, lim.DEFAULT_MAX_REQUEST_HEADERS, "request headers per request; more get 431"),
    ("--max-request-header-bytes", int, lim.DEFAULT_MAX_REQUEST_HEADER_BYTES,
     "bytes of request header names and values; more get 431"),
    ("--max-json-depth", int, lim.DEFAULT_MAX_JSON_DEPTH, "nesting of a request's JSON body (at most 512); deeper gets 400"),
    ("--max-label-value-length", int, lim.DEFAULT_MAX_LABEL_VALUE_LENGTH,
     "characters of a client-chosen metric label value; longer is cut"),
    ("--max-prompt-chars", int, lim.DEFAULT_MAX_PROMPT_CHARS,
     "characters of a request's prompt text; more get 413 before any tokenization"),
)


class UsageError(Exception):
    """A command-line value `epp serve` cannot use; the message is the one line the user sees."""


def epp_version() -> str:
    """The installed version of the llm-epp package."""
    try:
        return version("llm-epp")
    except PackageNotFoundError:  # running from a source tree that was never installed
        return "unknown"


def _serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="run the endpoint picker (Envoy ext_proc service)",
                       description="Run the endpoint picker: an Envoy ext_proc gRPC service that picks a replica "
                                   "for every request.")
    p.add_argument("--grpc-port", type=int, default=9002, help="ext_proc gRPC port (default 9002)")
    p.add_argument("--grpc-health-port", type=int, default=9003, help="grpc.health.v1 port (default 9003)")
    p.add_argument("--metrics-port", type=int, default=9090, help="Prometheus /metrics port (default 9090)")
    p.add_argument("--bind-address", default="0.0.0.0", help="address every port binds (default 0.0.0.0)")
    cfg = p.add_mutually_exclusive_group()
    cfg.add_argument("--config-file", help="EndpointPickerConfig YAML file (none: GIE's default pipeline)")
    cfg.add_argument("--config-text", help="EndpointPickerConfig YAML text")
    discovery = p.add_mutually_exclusive_group()
    discovery.add_argument("--endpoints",
                           help="static discovery: ip:port[#label=value;...],... (labels feed the label filters)")
    discovery.add_argument("--endpoints-file", help="file discovery: YAML/JSON list of endpoints, re-read on change")
    k8s = p.add_argument_group("Kubernetes discovery (needs the 'kubernetes' extra)")
    k8s.add_argument("--pool-name", help="InferencePool to serve: its Ready pods become the endpoints")
    k8s.add_argument("--pool-namespace", default=None,
                     help="namespace of the pool and its pods (default: $NAMESPACE, else 'default')")
    k8s.add_argument("--pool-group", default="inference.networking.k8s.io",
                     help="API group of the InferencePool (default inference.networking.k8s.io; "
                          "inference.networking.x-k8s.io for v1alpha2 pools)")
    k8s.add_argument("--endpoint-selector",
                     help="standalone mode without CRDs: pods matching app=x,tier=y are the endpoints")
    k8s.add_argument("--endpoint-target-ports", help="standalone mode: the pods' serving ports, 8000[,8001]")
    k8s.add_argument("--ha-enable-leader-election", action="store_true",
                     help="active-passive HA: only the replica holding the pool's Lease reports ready")
    k8s.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster service account, "
                                          "else $KUBECONFIG or ~/.kube/config)")
    p.add_argument("--secure-serving", action="store_true",
                   help="serve ext_proc over TLS (h2 ALPN); self-signed unless --cert-path")
    p.add_argument("--cert-path", help="directory holding tls.crt and tls.key")
    p.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                   help="larger request bodies get 413 (default 16 MiB)")
    p.add_argument("--grace-period", type=float, default=10.0,
                   help="seconds in-flight streams get to finish on SIGTERM (default 10)")
    p.add_argument("--refresh-metrics-interval", type=float, default=0.05,
                   help="seconds between /metrics scrapes of each endpoint (default 0.05)")
    p.add_argument("--disable-endpoint-subset-filter", action="store_true",
                   help="ignore the subset hint from the data plane")
    for flag, kind, default, meaning in LIMIT_FLAGS:
        p.add_argument(flag, type=kind, default=default, help=f"{meaning} (default %(default)s)")
    p.add_argument("--token-accounting-tenant", default="fairness",
                   help="tenant label of the token counters: fairness (id header), objective, header:<name> "
                        "or none (default fairness)")
    p.add_argument("--prefill-capacity-tokens-per-second", type=float, default=0.0,
                   help="prefill tokens/s one replica computes; adds the pool's prefill capacity gauges")
    p.add_argument("--peer-port", type=int, default=None,
                   help="share this picker's routing decisions with its peers on this port (approximate prefix "
                        "homes; protocol in proto/epp/peer/v1); default: no peer link")
    p.add_argument("--peers", default="",
                   help="the other pickers of the pool, host:port,... of their --peer-port (a full mesh: list "
                        "every other picker); a picker that starts late catches up from one of them")
    p.add_argument("--no-worker-peer-link", action="store_true",
                   help="with --workers N: the workers do not share their decisions (each knows only its own "
                        "prefix homes and in-flight requests; cheaper per request, worse routing)")
    p.add_argument("--no-shared-scrapes", action="store_true",
                   help="with peers (--peers or --workers N): every picker scrapes every endpoint itself, instead "
                        "of one picker per endpoint sharing what it read (N times the scrapes on each replica)")
    p.add_argument("--emit-endpoint-scores", nargs="?", const="totals", default=None, type=_scores_mode,
                   metavar="totals|scorers",
                   help="put each pick's per-endpoint scores into Envoy dynamic metadata (envoy.lb, "
                        "x-gateway-destination-endpoint-scores) as JSON: weighted totals, or with =scorers also "
                        "each scorer's score; at most 10 endpoints per profile and 4 KiB (docs/operations-debugging.md)")
    p.add_argument("--enable-debug-endpoint", action="store_true",
                   help="serve GET /debug/state (plugins', endpoints' and in-flight state as JSON) and POST "
                        "/debug/explain (for epp explain) on the metrics port; off by default")
    p.add_argument("--workers", default="1",
                   help="picker processes sharing the ports (SO_REUSEPORT; one metrics page for all; a worker "
                        "that exits is restarted): a number, or 'auto' for one per CPU (default 1)")
    p.add_argument("--tracing", action="store_true",
                   help="OpenTelemetry spans for every request, exported as the OTEL_* variables say (default: "
                        "OTLP to localhost:4317); also on when OTEL_TRACES_EXPORTER is set; needs the 'tracing' "
                        "extra (docs/tracing.md)")
    p.add_argument("-v", "--verbose", action="count", default=0, help="more logs (-v info, -vv debug)")


def _scores_mode(text: str) -> str | None:
    """`--emit-endpoint-scores` value: totals, scorers, or llm-d's boolean spelling (true: totals, false: off)."""
    value = text.strip().lower()
    if value in ("totals", "true"):
        return "totals"
    if value == "scorers":
        return "scorers"
    if value == "false":
        return None
    raise argparse.ArgumentTypeError(f"{text!r}: expected totals or scorers (or true/false)")


def check_endpoints(specs: Sequence[EndpointSpec], where: str) -> None:
    """Refuse duplicate endpoints and port labels that are no port; `where` names the source in the error."""
    # Labels naming ports of the replica, which the KV-event subscriber dials.
    from epp.kvevents.subscriber import LABEL_DISK_EVENTS_PORT, LABEL_EVENTS_PORT, LABEL_REPLAY_PORT

    seen: set[str] = set()
    for spec in specs:
        if spec.name in seen:
            raise UsageError(f"{where}: endpoint {spec.name} is listed twice")
        seen.add(spec.name)
        for label in (LABEL_EVENTS_PORT, LABEL_REPLAY_PORT, LABEL_DISK_EVENTS_PORT):
            value = spec.labels.get(label)
            if value is not None and not (value.isdigit() and 0 < int(value) < 65536):
                raise UsageError(f"{where}: endpoint {spec.name}: label {label}={value!r} must be a port 1-65535")


def _endpoints_of(args: argparse.Namespace) -> list[EndpointSpec]:
    """The static endpoints, or (checking the file now, so a typo fails at start) the file's first view."""
    from epp.datalayer.discovery import EndpointFileError, load_endpoint_file
    from epp.datalayer.registry import parse_endpoint_list

    if args.endpoints_file is not None:
        where = f"--endpoints-file {args.endpoints_file}"
        try:
            with open(args.endpoints_file, encoding="utf-8") as fh:
                file_specs = load_endpoint_file(fh.read(), args.endpoints_file)
        except OSError as exc:
            raise UsageError(f"{where}: cannot read it: {exc.strerror or exc}") from None
        except (UnicodeDecodeError, EndpointFileError) as exc:
            raise UsageError(f"{where}: {exc}") from None
        check_endpoints(file_specs, where)
        return []
    if args.endpoints is None:
        return []
    try:
        specs = parse_endpoint_list(args.endpoints)
    except ValueError as exc:
        raise UsageError(f"--endpoints: {exc}") from None
    if not specs:
        raise UsageError(f"--endpoints: no endpoint in {args.endpoints!r}; expected ip:port[,ip:port...]")
    check_endpoints(specs, "--endpoints")
    return specs


def _start_line(options: ServeOptions) -> Callable[[EppServer], None]:
    """The one line `epp serve` prints on stdout once it serves (logs and errors go to stderr):
    where it listens, what it routes to, which config."""

    def announce(server: EppServer) -> None:
        host = options.bind_address
        if options.endpoints_file:
            pool = f"endpoints from {options.endpoints_file} ({len(server.endpoints)} now)"
        elif options.endpoints:
            names = [spec.name for spec in options.endpoints]
            shown = ", ".join(names[:5]) + (f", ... ({len(names) - 5} more)" if len(names) > 5 else "")
            pool = f"{len(names)} endpoint(s) {shown}"
        elif options.pool_name:
            pool = f"InferencePool {options.pool_namespace}/{options.pool_name} ({len(server.endpoints)} endpoints now)"
        elif options.endpoint_selector:
            pool = f"pods selected by labels ({len(server.endpoints)} endpoints now)"
        else:
            pool = "no endpoints (give --endpoints, --endpoints-file or --pool-name)"
        config = options.config_file or ("--config-text" if options.config_text else "GIE default pipeline")
        tls = " (TLS)" if options.secure_serving else ""
        print(f"epp serve: ext_proc on {host}:{server.grpc_port}{tls}, health on {host}:{server.health_port}, "
              f"metrics on http://{host}:{server.metrics_port}/metrics; {pool}; config: {config}", flush=True)

    return announce


def _run_serve(args: argparse.Namespace) -> int:
    from epp.framework.errors import ConfigError
    from epp.server.runner import BindError, ServeOptions, serve_forever

    # Every flag is checked before anything starts; the first wrong one is the user's one line.
    try:
        endpoints = _endpoints_of(args)
        limits = lim.Limits(
            max_concurrent_streams=args.max_concurrent_streams, stream_idle_timeout_s=args.stream_idle_timeout,
            max_request_headers=args.max_request_headers, max_request_header_bytes=args.max_request_header_bytes,
            max_json_depth=args.max_json_depth, max_label_value_length=args.max_label_value_length,
            max_prompt_chars=args.max_prompt_chars)
        # The loader reads --config-file itself, so its errors name the file (and a missing file is one).
        k8s = _kubernetes_options(args)
        _check_tenant_source(args.token_accounting_tenant)
        traced = _tracing_wanted(args.tracing)
    except (UsageError, ValueError, MissingExtra) as exc:
        print(f"epp serve: {exc}", file=sys.stderr)
        return 2
    peers = [p.strip() for p in args.peers.split(",") if p.strip()]
    bad_peer = next((p for p in peers if not p.rpartition(":")[2].isdigit() or not p.rpartition(":")[0]), None)
    if bad_peer is not None:
        print(f"epp serve: --peers: {bad_peer!r} is not host:port", file=sys.stderr)
        return 2
    if peers and args.peer_port is None:
        print("epp serve: --peers needs --peer-port (peers follow each other both ways)", file=sys.stderr)
        return 2
    options = ServeOptions(
        grpc_port=args.grpc_port, grpc_health_port=args.grpc_health_port, metrics_port=args.metrics_port,
        bind_address=args.bind_address, config_text=args.config_text, config_file=args.config_file,
        endpoints=endpoints, endpoints_file=args.endpoints_file, secure_serving=args.secure_serving,
        cert_path=args.cert_path, max_body_bytes=args.max_request_body_bytes,
        grace_period_s=args.grace_period, refresh_metrics_interval_s=args.refresh_metrics_interval,
        disable_endpoint_subset_filter=args.disable_endpoint_subset_filter, limits=limits,
        token_accounting_tenant=args.token_accounting_tenant,
        prefill_capacity_tokens_per_s=args.prefill_capacity_tokens_per_second,
        peer_port=args.peer_port, peers=peers, worker_peer_link=not args.no_worker_peer_link,
        shared_scrapes=not args.no_shared_scrapes, emit_endpoint_scores=args.emit_endpoint_scores,
        enable_debug_endpoint=args.enable_debug_endpoint, tracing=traced, **k8s)
    from epp.kube.client import KubernetesError
    from epp.server.event_loop import run_event_loop
    from epp.server.workers import WorkerStartError, supervise_forever, worker_count

    try:
        workers = worker_count(args.workers)
    except ValueError as exc:
        print(f"epp serve: {exc}", file=sys.stderr)
        return 2
    try:
        if workers == 1:
            run_event_loop(serve_forever(options, on_started=_start_line(options)))
        else:
            run_event_loop(supervise_forever(options, workers, log_level=logging.getLogger().level,
                                        on_started=_start_line(options)))
    except ConfigError as exc:
        print(f"epp serve: invalid configuration: {exc}", file=sys.stderr)
        return 2
    except (BindError, KubernetesError, WorkerStartError) as exc:
        print(f"epp serve: {exc}", file=sys.stderr)
        return 2
    return 0


def _tracing_wanted(flag: bool) -> bool:
    """Whether to trace (`--tracing`, or OTEL_TRACES_EXPORTER set; OTEL_SDK_DISABLED=true says no); the
    extra and the OTEL_* settings are checked now (MissingExtra, ValueError), so a wrong one fails at start."""
    from epp import tracing

    if not (flag or tracing.requested_by_environment()):
        return False
    if tracing.disabled_by_environment():
        logging.getLogger(__name__).warning("tracing is off: OTEL_SDK_DISABLED=true")
        return False
    require_extra("tracing", "tracing (--tracing or OTEL_TRACES_EXPORTER)")
    tracing.load_exporters()
    return True


def _check_tenant_source(value: str) -> None:
    """Refuse a --token-accounting-tenant value the token counters cannot label by."""
    from epp.fleet.accounting import parse_tenant_source

    try:
        parse_tenant_source(value)
    except ValueError as exc:
        raise UsageError(f"--token-accounting-tenant: {exc}") from None


def _kubernetes_options(args: argparse.Namespace) -> dict:
    """ServeOptions fields for Kubernetes discovery; ValueError names the flag that is wrong, MissingExtra
    says the client is not installed."""
    import os

    from epp.datalayer.inference_pool import parse_selector, parse_target_ports

    if args.pool_name and args.endpoint_selector:
        raise ValueError("--pool-name and --endpoint-selector exclude each other (pool or standalone mode)")
    if args.endpoint_target_ports and not args.endpoint_selector:
        raise ValueError("--endpoint-target-ports goes with --endpoint-selector (a pool names its own ports)")
    if (args.pool_name or args.endpoint_selector) and (args.endpoints or args.endpoints_file):
        raise ValueError("Kubernetes discovery excludes --endpoints and --endpoints-file")
    if args.ha_enable_leader_election and not args.pool_name:
        raise ValueError("--ha-enable-leader-election needs --pool-name (the lease is the pool's)")
    if args.pool_name or args.endpoint_selector:
        require_extra("kubernetes", "Kubernetes discovery (--pool-name, --endpoint-selector)")
    options: dict = {"pool_name": args.pool_name, "pool_group": args.pool_group, "kubeconfig": args.kubeconfig,
                     "ha_enable_leader_election": args.ha_enable_leader_election,
                     "pool_namespace": args.pool_namespace or os.environ.get("NAMESPACE") or "default"}
    if args.endpoint_selector:
        if not args.endpoint_target_ports:
            raise ValueError("--endpoint-selector needs --endpoint-target-ports")
        options["endpoint_selector"] = parse_selector(args.endpoint_selector)
        options["endpoint_target_ports"] = parse_target_ports(args.endpoint_target_ports)
    return options


def _run_envoy_config(args: argparse.Namespace) -> int:
    from epp.envoy import render_config

    try:
        # The pool's own fields first (appProtocol, endpointPickerRef), then explicit flags over them.
        options = _pool_envoy_options(args.inference_pool) if args.inference_pool else {}
        if args.failure_mode_allow:
            options["failure_mode_allow"] = True
        if args.upstream_protocol:
            options["upstream_protocol"] = args.upstream_protocol
        if args.epp_host is not None:
            options["epp_host"] = args.epp_host
        if args.epp_port is not None:
            options["epp_port"] = args.epp_port
        fail_open_to = [e.strip() for e in (args.fail_open_endpoints or "").split(",") if e.strip()]
        config = render_config(listen_port=args.listen_port, admin_port=args.admin_port,
                               listen_address=args.listen_address, epp_tls=args.epp_tls,
                               responses="none" if args.request_only else args.responses,
                               fail_open_endpoints=fail_open_to, tracing_collector=args.tracing_collector,
                               **options)
    except (OSError, ValueError) as exc:
        print(f"epp envoy-config: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(config)
    return 0


def _pool_envoy_options(path: str) -> dict:
    """`render_config` arguments from the one InferencePool in a YAML file."""
    from pathlib import Path

    import yaml

    from epp.datalayer.inference_pool import envoy_options, pool_view_of

    try:
        documents = list(yaml.safe_load_all(Path(path).read_text()))
    except yaml.YAMLError as exc:
        raise ValueError(f"--inference-pool {path}: not YAML: {exc}") from None
    pools = [d for d in documents if isinstance(d, dict) and d.get("kind") == "InferencePool"]
    if len(pools) != 1:
        raise ValueError(f"--inference-pool {path}: expected one InferencePool, found {len(pools)}")
    try:
        return envoy_options(pool_view_of(pools[0]), (pools[0].get("metadata") or {}).get("namespace"))
    except ValueError as exc:
        raise ValueError(f"--inference-pool {path}: {exc}") from None


def build_parser() -> argparse.ArgumentParser:
    """The argparse of `epp` (the engine and sim tools parse their own arguments)."""
    parser = argparse.ArgumentParser(prog="epp", description="LLM-aware endpoint picker for Envoy ext_proc")
    parser.add_argument("--version", action="version", version=f"epp (llm-epp) {epp_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _serve_parser(sub)
    check = sub.add_parser("check-config", help="validate EndpointPickerConfigs: the pipeline, or one line per config",
                           description="Validate an EndpointPickerConfig file and print the resolved pipeline "
                                       "(exit 0), or the first error with the field it is in (exit 1). Given several "
                                       "files, a folder or a Helm values file (configs under a key such as "
                                       "router.epp.pluginsCustomConfig), print one line per config: loads, maps "
                                       "with notices (the first shown), or refused and why; then a count (exit 1 "
                                       "when any is refused).")
    check.add_argument("paths", nargs="+", metavar="PATH",
                       help="EndpointPickerConfig files, Helm values files or folders (samples: examples/configs/)")
    check.add_argument("--details", action="store_true", help="with one line per config: print each pipeline too")
    check.add_argument("--list", dest="listing", action="store_true",
                       help="one line per config even for a single config file")
    demo = sub.add_parser("demo", help="run Envoy + the picker + simulated replicas and a short workload",
                          description="Run real Envoy, the picker and simulated vLLM replicas on loopback, send "
                                      "the same workload through the picker and through Envoy round-robin, and "
                                      "print where requests went, cache hit rates and latencies.")
    demo.add_argument("--replicas", type=int, default=4, help="simulated vLLM replicas (default 4)")
    demo.add_argument("--requests", type=int, default=200, help="requests per run (default 200)")
    demo.add_argument("--concurrency", type=int, default=8, help="requests in flight at once (default 8)")
    demo.add_argument("--short", action="store_true", help="a quick run: at most 60 requests, 3 replicas (CI)")
    envoy = sub.add_parser("envoy-config", help="print the Envoy bootstrap config that fronts the picker",
                           description="Print an Envoy bootstrap config: a listener that asks the picker (ext_proc) "
                                       "where each request goes and forwards it there.")
    envoy.add_argument("--listen-port", type=int, default=8081, help="port clients send requests to (default 8081)")
    envoy.add_argument("--listen-address", default="127.0.0.1",
                       help="address the listener binds (default 127.0.0.1)")
    envoy.add_argument("--admin-port", type=int, default=19000, help="Envoy admin port (default 19000)")
    envoy.add_argument("--epp-host", help="host of the picker's ext_proc (default 127.0.0.1, or the Service "
                                           "of --inference-pool's endpointPickerRef)")
    envoy.add_argument("--epp-port", type=int, help="the picker's ext_proc port (default 9002, or the "
                                                    "endpointPickerRef's port)")
    envoy.add_argument("--inference-pool", metavar="FILE",
                       help="an InferencePool YAML: its appProtocol sets the upstream protocol, its "
                            "endpointPickerRef the picker's address and failure mode (flags override)")
    envoy.add_argument("--upstream-protocol", choices=UPSTREAM_PROTOCOLS,
                       help="HTTP/1.1 (http, the default) or HTTP/2 cleartext (h2c) to the model servers")
    envoy.add_argument("--failure-mode-allow", action="store_true",
                       help="FailOpen: route requests on while the picker is down (once Envoy has ejected "
                            "it: the request that finds it down is refused); see --fail-open-endpoints")
    envoy.add_argument("--fail-open-endpoints", metavar="HOST:PORT,...",
                       help="where FailOpen sends requests while the picker is down, round-robin (e.g. a "
                            "headless Service of the pool's pods); without it they get 503")
    envoy.add_argument("--epp-tls", action="store_true", help="reach the picker over TLS (epp serve --secure-serving)")
    envoy.add_argument("--tracing-collector", metavar="HOST:PORT",
                       help="Envoy traces each request (OpenTelemetry, OTLP/gRPC to HOST:PORT) and the picker's "
                            "spans (epp serve --tracing) join its traces (docs/tracing.md)")
    envoy.add_argument("--responses", choices=RESPONSE_MODES, default="full",
                       help="how much of each response the picker sees: full (GIE's contract: headers and "
                            "every body chunk), headers (headers and the end: far less picker CPU for streamed "
                            "answers; no token usage, first-token timing or model-name rewrite back), none "
                            "(request phases only; the picker no longer sees requests end)")
    envoy.add_argument("--request-only", action="store_true", help="the same as --responses none")
    calibration = sub.add_parser("calibration", help="show the predicted-TTFT and TPOT costs a running picker has learned",
                                 description="Read a running picker's /metrics and print, per endpoint and model, "
                                             "the TTFT costs its predicted-ttft-scorer has learned.")
    calibration.add_argument("--metrics-url", default="http://127.0.0.1:9090/metrics",
                             help="the picker's Prometheus page (default http://127.0.0.1:9090/metrics)")
    from epp.debug.cli import add_parser as add_explain_parser

    add_explain_parser(sub)
    sub.add_parser("engine", help="model-server tools: `epp engine serve|disk-manager --help`", add_help=False)
    sub.add_parser("sim", help="the vLLM simulator: `epp sim fleet --help`", add_help=False)
    sub.add_parser("cost", help="what cached tokens saved over a window of the picker's counters: `epp cost --help`",
                   add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `epp` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    # Model-server tools have their own argument parsers; hand them the rest of the line.
    if argv[:1] == ["engine"]:
        return _engine(argv[1:])
    if argv[:1] == ["cost"]:
        from epp.fleet.cost import main as cost_main

        return cost_main(argv[1:])
    if argv[:1] == ["sim"]:
        from epp.engine.sim.__main__ import main as sim_main

        return sim_main(argv[1:], prog="epp sim") or 0
    parser = build_parser()
    args = parser.parse_args(argv)
    level = logging.WARNING - 10 * getattr(args, "verbose", 1)
    logging.basicConfig(level=max(level, logging.DEBUG), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "serve":
        return _run_serve(args)
    if args.command == "check-config":
        from epp.config.check import check_config_main

        return check_config_main(args.paths, details=args.details, listing=args.listing or None)
    if args.command == "envoy-config":
        return _run_envoy_config(args)
    if args.command == "calibration":
        from epp.calibration_cli import calibration_main

        return calibration_main(args.metrics_url)
    if args.command == "explain":
        from epp.debug.cli import explain_main

        return explain_main(args)
    if args.command == "demo":
        try:
            require_extra("demo", "epp demo")
        except MissingExtra as exc:
            print(exc, file=sys.stderr)
            return 2
        from epp.demo import run_demo

        return run_demo(replicas=args.replicas, requests=args.requests, concurrency=args.concurrency,
                        short=args.short)
    parser.error(f"unknown command {args.command}")
    return 2


def _engine(argv: list[str]) -> int:
    if argv and argv[0] in ENGINE_TOOLS:
        return importlib.import_module(ENGINE_TOOLS[argv[0]][0]).main(argv[1:]) or 0
    # No tool named: this parser only explains (--help: exit 0) or refuses (exit 2) what was typed.
    parser = argparse.ArgumentParser(prog="epp engine", description="Model-server tools.",
                                     epilog="Each tool has its own options: epp engine TOOL --help")
    sub = parser.add_subparsers(dest="tool", required=True, metavar="TOOL")
    for name, (_module, summary) in ENGINE_TOOLS.items():
        sub.add_parser(name, help=summary)
    parser.parse_args(argv)
    return 2


if __name__ == "__main__":
    sys.exit(main())
