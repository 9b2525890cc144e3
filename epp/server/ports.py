"""Listening ports of the project's servers (`epp serve`, its workers, `epp bbr`): bound, or BindError naming the flag."""

from __future__ import annotations

import socket

import grpc


class BindError(OSError):
    """A port a server was told to listen on cannot be bound (in use, or not an address of this host)."""


def probe_port(host: str, port: int, flag: str) -> None:
    """BindError naming the flag when `host:port` has a live listener or is no local address."""
    # gRPC reports a taken port only as a core log line and a bare RuntimeError: probe it first
    # for the reason. SO_REUSEADDR as gRPC sets it, so only a live listener counts as taken.
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise BindError(f"cannot listen on {host}:{port} ({flag}): {exc.strerror or exc}") from None


def bind_grpc_port(server: grpc.aio.Server, host: str, port: int, flag: str,
                   credentials: grpc.ServerCredentials | None = None, *, shared: bool = False) -> int:
    """Add a listening port to a gRPC server; the port bound, or BindError naming the flag.
    `shared`: the port is one the worker supervisor checked and its sibling workers listen on too."""
    address = f"{host}:{port}"
    if port != 0 and not shared:
        probe_port(host, port, flag)
    try:
        bound = (server.add_secure_port(address, credentials) if credentials is not None
                 else server.add_insecure_port(address))
    except RuntimeError:  # taken between the probe and now
        bound = 0
    if bound == 0:
        raise BindError(f"cannot listen on {address} ({flag}): the port is in use or the address is not local")
    return bound
