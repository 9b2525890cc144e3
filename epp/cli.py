"""The `epp` command: serve the picker, check a config, run the demo, and the model-server tools."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Sequence

from epp.server.extproc import DEFAULT_MAX_BODY_BYTES


def _serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="run the endpoint picker (Envoy ext_proc service)")
    p.add_argument("--grpc-port", type=int, default=9002, help="ext_proc gRPC port (default 9002)")
    p.add_argument("--grpc-health-port", type=int, default=9003, help="grpc.health.v1 port (default 9003)")
    p.add_argument("--metrics-port", type=int, default=9090, help="Prometheus /metrics port (default 9090)")
    p.add_argument("--bind-address", default="0.0.0.0", help="address every port binds (default 0.0.0.0)")
    cfg = p.add_mutually_exclusive_group()
    cfg.add_argument("--config-file", help="EndpointPickerConfig YAML file")
    cfg.add_argument("--config-text", help="EndpointPickerConfig YAML text")
    p.add_argument("--endpoints", default="",
                   help="static discovery: ip:port[#label=value;...],... (labels feed the label filters)")
    p.add_argument("--endpoints-file", help="file discovery: YAML/JSON list of endpoints, re-read on change")
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
    p.add_argument("-v", "--verbose", action="count", default=0, help="more logs (-v info, -vv debug)")


def _run_serve(args: argparse.Namespace) -> int:
    from epp.datalayer.registry import parse_endpoint_list
    from epp.server.runner import ServeOptions, serve_forever

    config_text = args.config_text
    if args.config_file:
        with open(args.config_file, encoding="utf-8") as fh:
            config_text = fh.read()
    try:
        endpoints = parse_endpoint_list(args.endpoints)
    except ValueError as exc:
        print(f"epp serve: --endpoints: {exc}", file=sys.stderr)
        return 2
    options = ServeOptions(
        grpc_port=args.grpc_port, grpc_health_port=args.grpc_health_port, metrics_port=args.metrics_port,
        bind_address=args.bind_address, config_text=config_text, config_file=args.config_file,
        endpoints=endpoints, endpoints_file=args.endpoints_file, secure_serving=args.secure_serving,
        cert_path=args.cert_path, max_body_bytes=args.max_request_body_bytes,
        grace_period_s=args.grace_period, refresh_metrics_interval_s=args.refresh_metrics_interval,
        disable_endpoint_subset_filter=args.disable_endpoint_subset_filter)
    from epp.framework.errors import ConfigError

    try:
        _run_loop(serve_forever(options))
    except ConfigError as exc:
        print(f"epp serve: invalid configuration: {exc}", file=sys.stderr)
        return 2
    return 0


def _run_loop(coro) -> None:
    """Run on uvloop when it is installed (cheaper I/O on the hot path), else plain asyncio."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(coro)
    else:
        uvloop.run(coro)


def _run_envoy_config(args: argparse.Namespace) -> int:
    from epp.envoy import render_config

    sys.stdout.write(render_config(listen_port=args.listen_port, admin_port=args.admin_port,
                                   epp_port=args.epp_port, epp_host=args.epp_host,
                                   listen_address=args.listen_address,
                                   failure_mode_allow=args.failure_mode_allow, epp_tls=args.epp_tls,
                                   response_processing=not args.request_only))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `epp` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    # Model-server tools have their own argument parsers; hand them the rest of the line.
    if argv[:1] == ["engine"]:
        return _engine(argv[1:])
    if argv[:1] == ["sim"]:
        from epp.engine.sim.__main__ import main as sim_main

        return sim_main(argv[1:]) or 0
    parser = argparse.ArgumentParser(prog="epp", description="LLM-aware endpoint picker for Envoy ext_proc")
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    check = sub.add_parser("check-config", help="validate an EndpointPickerConfig and print the pipeline")
    check.add_argument("file")
    demo = sub.add_parser("demo", help="run Envoy + the picker + simulated replicas and a short workload")
    demo.add_argument("--replicas", type=int, default=4)
    demo.add_argument("--requests", type=int, default=200)
    demo.add_argument("--concurrency", type=int, default=8)
    demo.add_argument("--short", action="store_true", help="a quick run (CI)")
    envoy = sub.add_parser("envoy-config", help="print the Envoy bootstrap config that fronts the picker")
    envoy.add_argument("--listen-port", type=int, default=8081)
    envoy.add_argument("--listen-address", default="127.0.0.1")
    envoy.add_argument("--admin-port", type=int, default=19000)
    envoy.add_argument("--epp-host", default="127.0.0.1")
    envoy.add_argument("--epp-port", type=int, default=9002)
    envoy.add_argument("--failure-mode-allow", action="store_true")
    envoy.add_argument("--epp-tls", action="store_true")
    envoy.add_argument("--request-only", action="store_true",
                       help="send only request phases to the picker: lower overhead; no token-usage metrics, "
                            "response hooks or model-name rewrite back")
    calibration = sub.add_parser("calibration", help="show the predicted-TTFT costs a running picker has learned")
    calibration.add_argument("--metrics-url", default="http://127.0.0.1:9090/metrics",
                             help="the picker's Prometheus page (default http://127.0.0.1:9090/metrics)")
    sub.add_parser("engine", help="model-server tools: `epp engine serve|disk-manager --help`")
    sub.add_parser("sim", help="the vLLM simulator: `epp sim --help`")
    args = parser.parse_args(argv)
    level = logging.WARNING - 10 * getattr(args, "verbose", 1)
    logging.basicConfig(level=max(level, logging.DEBUG), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "serve":
        return _run_serve(args)
    if args.command == "check-config":
        from epp.config.check import check_config_main

        return check_config_main(args.file)
    if args.command == "envoy-config":
        return _run_envoy_config(args)
    if args.command == "calibration":
        from epp.calibration_cli import calibration_main

        return calibration_main(args.metrics_url)
    if args.command == "demo":
        from epp.demo import run_demo

        return run_demo(replicas=args.replicas, requests=args.requests, concurrency=args.concurrency,
                        short=args.short)
    parser.error(f"unknown command {args.command}")
    return 2


def _engine(argv: list[str]) -> int:
    tools = {"serve": "epp.engine.vllm.cli", "disk-manager": "epp.engine.disk_tier.cli"}
    if not argv or argv[0] not in tools:
        print("usage: epp engine {serve|disk-manager} [options]  (see --help of each)", file=sys.stderr)
        return 2
    import importlib

    return importlib.import_module(tools[argv[0]]).main(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main())
