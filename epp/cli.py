"""The `epp` command: serve the picker, check a config, run the demo, and the model-server tools."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Callable, Sequence
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, NoReturn

from epp import limits as lim
from epp.envoy import RESPONSE_MODES, UPSTREAM_PROTOCOLS
from epp.extras import MissingExtra, require_extra
from epp.logutil import LOG_FORMAT, JsonLogFormatter
from epp.serve_flags import (
    IGNORED_LLMD_FLAGS,
    REFUSED_LLMD_FLAGS,
    FlagError,
    ServeArgv,
    add_bool_flag,
    byte_size,
    cipher_list,
    go_duration,
    normalize_serve_argv,
    zap_level,
)
from epp.server.transport import DEFAULT_MAX_BODY_BYTES

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


# `--tls-min-version` names, as Go's crypto/tls spells them.
TLS_VERSIONS = ("VersionTLS10", "VersionTLS11", "VersionTLS12", "VersionTLS13")


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
                                   "for every request. Flags take Go's forms too (-flag value, --flag=value, "
                                   "--bool=false, -v=N, durations such as 50ms), so the llm-d EPP's command line "
                                   "runs unchanged.",
                       epilog=_llmd_epilog())
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
    add_bool_flag(k8s, "--ha-enable-leader-election",
                  help="active-passive HA: only the replica holding the Lease (the pool's; standalone, the "
                       "Deployment's, named from $POD_NAME) reports ready")
    k8s.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster service account, "
                                          "else $KUBECONFIG or ~/.kube/config)")
    tls = p.add_argument_group("TLS")
    add_bool_flag(tls, "--secure-serving", default=None,
                  help="serve ext_proc over TLS (h2 ALPN); self-signed unless --cert-path (default: on with "
                       "Kubernetes discovery, as llm-d; off with --endpoints or --endpoints-file)")
    tls.add_argument("--cert-path", help="directory holding tls.crt and tls.key")
    add_bool_flag(tls, "--enable-cert-reload",
                  help="re-read --cert-path's tls.crt and tls.key when they change (checked at each new connection)")
    tls.add_argument("--tls-cipher-suites", type=cipher_list, default=None, metavar="SUITE,...",
                     help="TLS 1.2 cipher suites of --secure-serving by Go's names (TLS_ECDHE_RSA_WITH_AES_128_GCM"
                          "_SHA256,...); TLS 1.3's are not configurable (default: gRPC's)")
    tls.add_argument("--tls-min-version", choices=TLS_VERSIONS,
                     help="lowest TLS version of --secure-serving; gRPC's own floor is TLS 1.2, so VersionTLS10 "
                          "to VersionTLS12 all mean 1.2, and VersionTLS13 is refused (not settable here)")
    p.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                   help="larger request bodies get 413 (default 16 MiB)")
    p.add_argument("--grpc-max-recv-msg-size", type=byte_size, default="64Mi",
                   help="largest gRPC message the ext_proc port takes (4Mi, 16MiB, 25MB or bytes; default 64Mi)")
    p.add_argument("--grpc-max-send-msg-size", type=byte_size, default="64Mi",
                   help="largest gRPC message the ext_proc port sends (default 64Mi)")
    p.add_argument("--grace-period", type=go_duration, default=10.0,
                   help="seconds (or a duration: 30s) in-flight streams get to finish on SIGTERM (default 10)")
    p.add_argument("--drain-timeout", type=go_duration, default="0s",
                   help="on SIGTERM, keep taking new ext_proc streams this long (a duration: 30s) while health "
                        "reports NOT_SERVING and the lease is released, as llm-d; then --grace-period (default 0s)")
    p.add_argument("--refresh-metrics-interval", type=go_duration, default="50ms",
                   help="time between /metrics scrapes of each endpoint (a duration: 50ms, or seconds; "
                        "default 50ms)")
    p.add_argument("--metrics-staleness-threshold", type=go_duration, default=None,
                   help="an endpoint whose metrics are older than this is passed over while others are fresher "
                        "(a duration: 2s; default: 10 scrape intervals, at least 0.5s)")
    add_bool_flag(p, "--disable-endpoint-subset-filter", help="ignore the subset hint from the data plane")
    add_bool_flag(p, "--health-checking",
                  help="also serve grpc.health.v1 on the ext_proc port (as on --grpc-health-port), for a proxy "
                       "that health-checks the picker there")
    for flag, kind, default, meaning in LIMIT_FLAGS:
        p.add_argument(flag, type=go_duration if kind is float else kind, default=default,
                       help=f"{meaning} (default %(default)s)")
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
    add_bool_flag(p, "--no-worker-peer-link",
                  help="with --workers N: the workers do not share their decisions (each knows only its own "
                       "prefix homes and in-flight requests; cheaper per request, worse routing)")
    add_bool_flag(p, "--no-shared-scrapes",
                  help="with peers (--peers or --workers N): every picker scrapes every endpoint itself, instead "
                       "of one picker per endpoint sharing what it read (N times the scrapes on each replica)")
    p.add_argument("--emit-endpoint-scores", nargs="?", const="totals", default=None, type=_scores_mode,
                   metavar="totals|scorers",
                   help="put each pick's per-endpoint scores into Envoy dynamic metadata (envoy.lb, "
                        "x-gateway-destination-endpoint-scores) as JSON: weighted totals, or with =scorers also "
                        "each scorer's score; at most 10 endpoints per profile and 4 KiB (docs/operations-debugging.md)")
    add_bool_flag(p, "--enable-debug-endpoint",
                  help="serve GET /debug/state (plugins', endpoints' and in-flight state as JSON) and POST "
                       "/debug/explain (for epp explain) on the metrics port; off by default")
    p.add_argument("--workers", default="1",
                   help="picker processes sharing the ports (SO_REUSEPORT; one metrics page for all; a worker "
                        "that exits is restarted): a number, or 'auto' for one per CPU (default 1)")
    metrics = p.add_argument_group("the metrics port")
    add_bool_flag(metrics, "--metrics-endpoint-auth", default=None,
                  help="/metrics (and /debug) need a bearer token that the Kubernetes API authenticates "
                       "(TokenReview) and authorizes (SubjectAccessReview: get on the path) (default: on with "
                       "Kubernetes discovery, as llm-d; off with --endpoints or --endpoints-file)")
    metrics.add_argument("--metrics-cert-dir",
                         help="serve the metrics port over TLS with this directory's tls.crt and tls.key")
    metrics.add_argument("--metrics-client-ca-file",
                         help="with --metrics-cert-dir: require a client certificate this PEM CA signed")
    logs = p.add_argument_group("logs and traces")
    add_bool_flag(logs, "--tracing", default=None,
                  help="OpenTelemetry spans for every request, exported as the OTEL_* variables say (default: "
                       "OTLP to localhost:4317); unset, on when OTEL_TRACES_EXPORTER is set; --tracing=false "
                       "turns it off whatever the environment says; needs the 'tracing' extra (docs/tracing.md)")
    logs.add_argument("-v", "--verbose", action="count", default=0,
                      help="more logs (-v info, -vv debug); llm-d's -v=N: 3 is info, 4 and above debug")
    logs.add_argument("--zap-encoder", choices=("console", "json"), default="console",
                      help="log lines as text (console) or one JSON object each (json: level, ts, logger, msg)")
    logs.add_argument("--zap-log-level", type=zap_level, default=None,
                      help="log level as llm-d names it: debug, info, error, panic, or N > 0 (debug); over -v")


def _llmd_epilog() -> str:
    """The llm-d EPP flags `epp serve` accepts without an effect, and those it refuses."""
    ignored = ", ".join(f"--{name}" for name in IGNORED_LLMD_FLAGS)
    refused = ", ".join(f"--{name}" for name in REFUSED_LLMD_FLAGS)
    return (f"Also accepted from the llm-d EPP, checked and ignored (logged once, with why): {ignored}. "
            f"Refused, with why: {refused}. docs/kubernetes.md#the-llm-d-router-chart lists every llm-d flag.")


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
        scheme = "https" if options.metrics_cert_dir else "http"
        auth = " (bearer token)" if options.metrics_auth else ""
        line = (f"epp serve: ext_proc on {host}:{server.grpc_port}{tls}, health on {host}:{server.health_port}, "
                f"metrics on {scheme}://{host}:{server.metrics_port}/metrics{auth}; {pool}; config: {config}")
        if options.log_json:  # stdout too is read by the log collector then
            line = JsonLogFormatter().format(logging.makeLogRecord(
                {"name": "epp.serve", "levelno": logging.INFO, "levelname": "INFO", "msg": line}))
        print(line, flush=True)

    return announce


def _run_serve(args: argparse.Namespace, ignored_line: str | None = None) -> int:
    from epp.framework.errors import ConfigError
    from epp.server.ports import BindError
    from epp.server.runner import ServeOptions, serve_forever

    if ignored_line is not None:  # once, in the process that parsed the line (workers get options, not flags)
        logging.getLogger("epp.serve").warning("%s", ignored_line)
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
        _check_durations(args)
        security = _security_options(args, kubernetes=bool(args.pool_name or args.endpoint_selector))
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
        endpoints=endpoints, endpoints_file=args.endpoints_file, cert_path=args.cert_path,
        max_body_bytes=args.max_request_body_bytes, grpc_max_recv_bytes=args.grpc_max_recv_msg_size,
        grpc_max_send_bytes=args.grpc_max_send_msg_size, grace_period_s=args.grace_period,
        drain_timeout_s=args.drain_timeout, refresh_metrics_interval_s=args.refresh_metrics_interval,
        metrics_staleness_s=args.metrics_staleness_threshold,
        disable_endpoint_subset_filter=args.disable_endpoint_subset_filter, health_checking=args.health_checking,
        limits=limits, token_accounting_tenant=args.token_accounting_tenant,
        prefill_capacity_tokens_per_s=args.prefill_capacity_tokens_per_second,
        peer_port=args.peer_port, peers=peers, worker_peer_link=not args.no_worker_peer_link,
        shared_scrapes=not args.no_shared_scrapes, emit_endpoint_scores=args.emit_endpoint_scores,
        enable_debug_endpoint=args.enable_debug_endpoint, tracing=traced, log_json=args.zap_encoder == "json",
        **security, **k8s)
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


def _check_durations(args: argparse.Namespace) -> None:
    """Refuse a time flag whose value cannot be meant (a negative drain, a scrape every 0 seconds)."""
    if args.refresh_metrics_interval <= 0:
        raise UsageError(f"--refresh-metrics-interval: {args.refresh_metrics_interval:g}s; it must be above 0")
    if args.metrics_staleness_threshold is not None and args.metrics_staleness_threshold <= 0:
        raise UsageError(f"--metrics-staleness-threshold: {args.metrics_staleness_threshold:g}s; it must be above 0")
    for flag, seconds in (("--grace-period", args.grace_period), ("--drain-timeout", args.drain_timeout)):
        if seconds < 0:
            raise UsageError(f"{flag}: {seconds:g}s; it cannot be negative")


def _security_options(args: argparse.Namespace, *, kubernetes: bool) -> dict:
    """ServeOptions fields for TLS and the metrics port's protection. Unset, `--secure-serving` and
    `--metrics-endpoint-auth` follow the discovery mode: on with Kubernetes discovery (llm-d's defaults,
    which its chart relies on), off for --endpoints/--endpoints-file (a laptop, a demo, a benchmark)."""
    from pathlib import Path

    secure = kubernetes if args.secure_serving is None else args.secure_serving
    metrics_auth = kubernetes if args.metrics_endpoint_auth is None else args.metrics_endpoint_auth
    if args.tls_min_version == "VersionTLS13":
        raise UsageError("--tls-min-version=VersionTLS13: not settable here (gRPC's Python server offers TLS 1.2 "
                         "and 1.3 and takes no minimum); VersionTLS12 and below are what it does")
    if args.cert_path:
        for name in ("tls.crt", "tls.key"):
            if not (Path(args.cert_path) / name).is_file():
                raise UsageError(f"--cert-path {args.cert_path}: no {name} there")
    if args.metrics_client_ca_file and not args.metrics_cert_dir:
        raise UsageError("--metrics-client-ca-file needs --metrics-cert-dir (client certificates need TLS)")
    if args.metrics_cert_dir:
        for name in ("tls.crt", "tls.key"):
            if not (Path(args.metrics_cert_dir) / name).is_file():
                raise UsageError(f"--metrics-cert-dir {args.metrics_cert_dir}: no {name} there")
        if not args.metrics_client_ca_file and not metrics_auth:
            raise UsageError("--metrics-cert-dir serves /metrics over TLS without authentication; add "
                             "--metrics-client-ca-file or --metrics-endpoint-auth (as llm-d requires)")
    if args.metrics_client_ca_file and not Path(args.metrics_client_ca_file).is_file():
        raise UsageError(f"--metrics-client-ca-file {args.metrics_client_ca_file}: no such file")
    if metrics_auth:
        require_extra("kubernetes", "--metrics-endpoint-auth (Kubernetes TokenReview and SubjectAccessReview)")
    return {"secure_serving": secure, "enable_cert_reload": args.enable_cert_reload, "metrics_auth": metrics_auth,
            "metrics_cert_dir": args.metrics_cert_dir, "metrics_client_ca_file": args.metrics_client_ca_file}


def _tracing_wanted(flag: bool | None) -> bool:
    """Whether to trace: `--tracing[=true]`, or unset with OTEL_TRACES_EXPORTER set; `--tracing=false` and
    OTEL_SDK_DISABLED=true say no. The extra and the OTEL_* settings are checked now (MissingExtra,
    ValueError), so a wrong one fails at start."""
    from epp import tracing

    if flag is False or not (flag or tracing.requested_by_environment()):
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
    from epp.datalayer.inference_pool import parse_selector, parse_target_ports

    if args.pool_name and args.endpoint_selector:
        raise ValueError("--pool-name and --endpoint-selector exclude each other (pool or standalone mode)")
    if args.endpoint_target_ports and not args.endpoint_selector:
        raise ValueError("--endpoint-target-ports goes with --endpoint-selector (a pool names its own ports)")
    if (args.pool_name or args.endpoint_selector) and (args.endpoints or args.endpoints_file):
        raise ValueError("Kubernetes discovery excludes --endpoints and --endpoints-file")
    if args.ha_enable_leader_election and not (args.pool_name or args.endpoint_selector):
        raise ValueError("--ha-enable-leader-election needs --pool-name or --endpoint-selector (whose lease)")
    if args.pool_name or args.endpoint_selector:
        require_extra("kubernetes", "Kubernetes discovery (--pool-name, --endpoint-selector)")
    namespace = args.pool_namespace or os.environ.get("NAMESPACE") or "default"
    options: dict = {"pool_name": args.pool_name, "pool_group": args.pool_group, "kubeconfig": args.kubeconfig,
                     "ha_enable_leader_election": args.ha_enable_leader_election, "pool_namespace": namespace}
    if args.ha_enable_leader_election and args.endpoint_selector:
        # Standalone, the lease is the Deployment's, as llm-d names it: from this pod's name.
        from epp.server.leader_election import deployment_of_pod, lease_name

        pod = os.environ.get("POD_NAME", "")
        if not pod:
            raise ValueError("--ha-enable-leader-election with --endpoint-selector needs $POD_NAME (the "
                             "Deployment's pods share one lease; the chart sets it from the downward API)")
        options["ha_lease_name"] = lease_name(namespace, deployment_of_pod(pod))
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


def subcommand_parser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    """The parser of one `epp` command (`serve`, `envoy-config`, ...)."""
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[name]


# llm-d's `--zap-log-level` names; an integer above 0 is more verbose than debug.
_ZAP_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "error": logging.ERROR, "panic": logging.CRITICAL}


def _configure_logging(args: argparse.Namespace) -> None:
    """The root logger: the level from -v (or llm-d's -v=N, or --zap-log-level), text or JSON lines."""
    zap = getattr(args, "zap_log_level", None)
    if zap is not None:
        level = _ZAP_LEVELS.get(zap, logging.DEBUG)
    else:
        level = max(logging.WARNING - 10 * getattr(args, "verbose", 1), logging.DEBUG)
    if getattr(args, "zap_encoder", "console") == "json":
        handler = logging.StreamHandler()
        handler.setFormatter(JsonLogFormatter())
        logging.basicConfig(level=level, handlers=[handler])
    else:
        logging.basicConfig(level=level, format=LOG_FORMAT)


def build_parser() -> argparse.ArgumentParser:
    """The argparse of `epp` (the engine and sim tools parse their own arguments)."""
    parser = argparse.ArgumentParser(prog="epp", description="LLM-aware endpoint picker for Envoy ext_proc",
                                     epilog="A first argument that is a flag means `epp serve` (as the llm-d "
                                            "chart starts the image: `epp --pool-name R ...`); `epp serve --help` "
                                            "lists its flags.")
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
                            "every body chunk), first-token (headers and each body up to its first token, then "
                            "the rest passes Envoy unread: the first token's timing is kept, a streamed answer's "
                            "usage and end are not), headers (headers and the end: far less picker CPU for streamed "
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
    sub.add_parser("bbr", help="body-based routing across pools: the model headers for the route (`epp bbr --help`)",
                   add_help=False)
    sub.add_parser("cost", help="what cached tokens saved over a window of the picker's counters: `epp cost --help`",
                   add_help=False)
    return parser


# Top-level flags of `epp`; any other first argument that is a flag means `epp serve` (the image's ENTRYPOINT
# is `epp`, and the llm-d chart gives the container flags only, no command).
TOP_LEVEL_FLAGS = {"-h": "--help", "--help": "--help", "-help": "--help", "--version": "--version",
                   "-version": "--version"}


# gRPC reads its TLS 1.2 cipher list from this variable once, as it loads: before anything of `epp` imported it.
CIPHER_SUITES_VARIABLE = "GRPC_SSL_CIPHER_SUITES"


def _restart_with_cipher_suites(ciphers: str, argv: Sequence[str]) -> NoReturn:
    """Run this same `epp` line again, in this process, with gRPC's cipher list set (`--tls-cipher-suites`)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "epp.cli", *argv],
              {**os.environ, CIPHER_SUITES_VARIABLE: ciphers})


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
    if argv[:1] == ["bbr"]:
        from epp.bbr.cli import main as bbr_main

        return bbr_main(argv[1:])
    if argv and argv[0] in TOP_LEVEL_FLAGS:
        argv[0] = TOP_LEVEL_FLAGS[argv[0]]
    elif argv and argv[0].startswith("-"):
        argv = ["serve", *argv]
    parser = build_parser()
    serve_line: ServeArgv | None = None
    if argv[:1] == ["serve"]:
        # Go's flag forms (the llm-d chart's) become the canonical ones argparse reads.
        try:
            serve_line = normalize_serve_argv(argv[1:], subcommand_parser(parser, "serve"))
        except FlagError as exc:
            print(f"epp serve: {exc}", file=sys.stderr)
            return 2
        argv = ["serve", *serve_line.argv]
    args = parser.parse_args(argv)
    if args.command == "serve" and args.tls_cipher_suites \
            and os.environ.get(CIPHER_SUITES_VARIABLE) != args.tls_cipher_suites:
        _restart_with_cipher_suites(args.tls_cipher_suites, argv)
    _configure_logging(args)
    if args.command == "serve":
        return _run_serve(args, serve_line.ignored_line() if serve_line is not None else None)
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
