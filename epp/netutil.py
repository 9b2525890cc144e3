"""Small networking helpers shared by the demo, the benchmarks and the tests."""

from __future__ import annotations

import random
import socket
from collections import deque
from pathlib import Path

_EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
# Ports handed out lately, skipped by later calls: a caller may not have bound its port yet.
_recently_handed: deque[int] = deque(maxlen=4096)
# From the OS, not the `random` module's generator: a process that seeds that one,
# or a forked copy of it, would otherwise hand out the same ports as its twin.
_choose = random.SystemRandom().choice


def _below_ephemeral_range() -> range | None:
    """Up to 16,384 ports just below the kernel's ephemeral range, or None where that range is unknown."""
    try:
        low = int(_EPHEMERAL_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    ports = range(max(1024, low - 16384), low)
    return ports if len(ports) >= 1024 else None


def bindable(host: str, port: int) -> bool:
    """Whether a TCP socket can bind `host:port` right now."""
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct ports that were free on `host` a moment ago.

    They come from below the kernel's ephemeral range where it is known: the kernel gives an outgoing
    connection a local port from that range, so no client socket can take one of these between this
    check and the caller's bind (a race that failed tests which bound a port picked by `bind(0)`).
    """
    candidates = _below_ephemeral_range()
    if candidates is None:
        return _kernel_chosen_ports(count, host)
    ports: list[int] = []
    for _ in range(64 * count):
        port = _choose(candidates)
        if port in ports or port in _recently_handed or not bindable(host, port):
            continue
        ports.append(port)
        if len(ports) == count:
            _recently_handed.extend(ports)
            return ports
    return _kernel_chosen_ports(count, host)


def _kernel_chosen_ports(count: int, host: str) -> list[int]:
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket()
            sock.bind((host, 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()
