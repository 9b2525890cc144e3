"""`epp bbr`: run the body-based router (its flags checked before anything starts)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Sequence

from epp import limits as lim
from epp.bbr.adapters import AdapterMapError
from epp.bbr.envoy_config import Pool, render_bbr_config
from epp.bbr.server import DEFAULT_GRPC_PORT, DEFAULT_HEALTH_PORT, DEFAULT_METRICS_PORT, BbrOptions, serve_forever
from epp.server.transport import DEFAULT_MAX_BODY_BYTES

DESCRIPTION = """\
Run the body-based router: an Envoy ext_proc service, placed before the pools' pickers, that reads
each request's model from its body (every API format the picker parses), sets X-Gateway-Model-Name
and X-Gateway-Base-Model-Name (the base model of a LoRA adapter, from --adapters, else the model)
and clears the route cache, so that a route matching those headers picks the model's pool.
A body the picker would refuse gets the picker's answer. Prints one line on stdout once serving."""


def build_parser(prog: str = "epp bbr") -> argparse.ArgumentParser:
    """The flags of `epp bbr`."""
    p = argparse.ArgumentParser(prog=prog, description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--grpc-port", type=int, default=DEFAULT_GRPC_PORT,
                   help=f"ext_proc port Envoy calls (default {DEFAULT_GRPC_PORT})")
    p.add_argument("--grpc-health-port", type=int, default=DEFAULT_HEALTH_PORT,
                   help=f"grpc.health.v1 port: liveness, readiness (default {DEFAULT_HEALTH_PORT})")
    p.add_argument("--metrics-port", type=int, default=DEFAULT_METRICS_PORT,
                   help=f"Prometheus /metrics port (default {DEFAULT_METRICS_PORT})")
    p.add_argument("--bind-address", default="0.0.0.0", help="address every port binds (default 0.0.0.0)")
    p.add_argument("--adapters", action="append", default=[], metavar="PATH",
                   help="a LoRA adapter -> base model mapping: a YAML file, or a folder of them (a mounted "
                        "ConfigMap); repeatable; polled and reloaded on change (default: none, every model is "
                        "its own base)")
    p.add_argument("--adapters-poll-interval", type=float, default=1.0, metavar="SECONDS",
                   help="how often the mapping files are checked for changes (default 1)")
    p.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                   help=f"largest request body read; larger gets 413 (default {DEFAULT_MAX_BODY_BYTES})")
    p.add_argument("--max-concurrent-streams", type=int, default=lim.DEFAULT_MAX_CONCURRENT_STREAMS,
                   help=f"ext_proc streams at once; more get 429 (default {lim.DEFAULT_MAX_CONCURRENT_STREAMS})")
    p.add_argument("--stream-idle-timeout", type=float, default=lim.DEFAULT_STREAM_IDLE_TIMEOUT_S,
                   help="seconds an unanswered request may send nothing; then 408 "
                        f"(default {lim.DEFAULT_STREAM_IDLE_TIMEOUT_S:g})")
    p.add_argument("--secure-serving", action="store_true",
                   help="TLS on the ext_proc port (self-signed unless --cert-path; default off)")
    p.add_argument("--cert-path", default=None, help="folder with tls.crt and tls.key for --secure-serving")
    p.add_argument("--grace-period", type=float, default=10.0,
                   help="seconds SIGTERM lets in-flight streams finish (default 10)")
    p.add_argument("--print-envoy-config", default=None, metavar="MODEL=HOST:PORT,...",
                   help="print an Envoy bootstrap that puts this router (--bind-address, --grpc-port) before one "
                        "picker per pool, the pool of each base MODEL at HOST:PORT, and exit")
    p.add_argument("--envoy-listen-port", type=int, default=8081,
                   help="with --print-envoy-config: the port clients send requests to (default 8081)")
    p.add_argument("--envoy-admin-port", type=int, default=19000,
                   help="with --print-envoy-config: Envoy's admin port (default 19000)")
    p.add_argument("-v", "--verbose", action="count", default=1, help="more logging (-vv: debug)")
    return p


def pools_of(text: str) -> list[Pool]:
    """`MODEL=HOST:PORT,...` as pools; ValueError naming the entry that is wrong."""
    pools = []
    for entry in (e.strip() for e in text.split(",")):
        model, sep, address = entry.rpartition("=")
        host, colon, port = address.rpartition(":")
        if not (sep and model and colon and host and port.isdigit()):
            raise ValueError(f"--print-envoy-config: {entry!r} is not MODEL=HOST:PORT")
        pools.append(Pool(model, host.strip("[]"), int(port)))
    return pools


def main(argv: Sequence[str] | None = None, prog: str = "epp bbr") -> int:
    """Run `epp bbr`; 2 for a flag, mapping or port it cannot use (one line on stderr)."""
    from epp.server.ports import BindError

    args = build_parser(prog).parse_args(list(sys.argv[1:] if argv is None else argv))
    logging.basicConfig(level=max(logging.WARNING - 10 * args.verbose, logging.DEBUG),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if args.adapters_poll_interval <= 0:
            raise ValueError("--adapters-poll-interval must be > 0")
        limits = lim.Limits(max_concurrent_streams=args.max_concurrent_streams,
                            stream_idle_timeout_s=args.stream_idle_timeout)
        if args.print_envoy_config is not None:
            host = "127.0.0.1" if args.bind_address in ("0.0.0.0", "::") else args.bind_address
            sys.stdout.write(render_bbr_config(pools_of(args.print_envoy_config), bbr_host=host,
                                               bbr_port=args.grpc_port, listen_port=args.envoy_listen_port,
                                               admin_port=args.envoy_admin_port))
            return 0
    except ValueError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    options = BbrOptions(grpc_port=args.grpc_port, grpc_health_port=args.grpc_health_port,
                         metrics_port=args.metrics_port, bind_address=args.bind_address,
                         adapters=tuple(args.adapters), adapters_poll_interval_s=args.adapters_poll_interval,
                         max_body_bytes=args.max_request_body_bytes, limits=limits,
                         secure_serving=args.secure_serving, cert_path=args.cert_path,
                         grace_period_s=args.grace_period)

    def started(server) -> None:  # noqa: ANN001 (a BbrServer)
        print(f"{prog}: ext_proc on :{server.grpc_port}, health on :{server.health_port}, metrics on "
              f":{server.metrics_port}, {len(server.mapping())} adapter(s) mapped", flush=True)

    try:
        asyncio.run(serve_forever(options, started))
    except (AdapterMapError, BindError) as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    return 0
