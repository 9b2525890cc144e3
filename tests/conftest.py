"""Shared test helpers: free ports and small builders."""

from __future__ import annotations

import socket

import pytest


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def port_factory():
    return free_port
