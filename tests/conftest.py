"""Shared test helpers: free ports and small builders."""

from __future__ import annotations

import pytest

from epp.netutil import free_ports


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    return free_ports(1)[0]


@pytest.fixture
def port_factory():
    return free_port
