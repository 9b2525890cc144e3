"""Shared test helpers: free ports and small builders."""

from __future__ import annotations

import socket

import pytest

from epp.netutil import free_ports


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    return free_ports(1)[0]


def consecutive_free_ports(n: int) -> int:
    """The first of `n` consecutive loopback ports that are free now."""
    for _ in range(200):
        [base] = free_ports(1)
        socks = []
        try:
            for port in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {n} consecutive free loopback ports found")


@pytest.fixture
def port_factory():
    return free_port
