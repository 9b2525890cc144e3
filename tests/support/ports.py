"""Free loopback ports for servers a test starts."""

from __future__ import annotations

from epp.netutil import bindable, free_ports


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    return free_ports(1)[0]


def consecutive_free_ports(n: int) -> int:
    """The first of `n` consecutive loopback ports that are free now."""
    for _ in range(200):
        [base] = free_ports(1)
        if all(bindable("127.0.0.1", port) for port in range(base + 1, base + n)):
            return base
    raise RuntimeError(f"no {n} consecutive free loopback ports found")
