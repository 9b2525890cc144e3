"""free_ports: ports that outgoing connections cannot take before the caller binds them."""

from __future__ import annotations

import socket

import pytest

from epp import netutil
from epp.netutil import free_ports


def ephemeral_low() -> int:
    return int(netutil._EPHEMERAL_RANGE_FILE.read_text().split()[0])


@pytest.mark.skipif(not netutil._EPHEMERAL_RANGE_FILE.exists(), reason="Linux only")
def test_ports_come_from_below_the_ephemeral_range_and_bind():
    ports = free_ports(8)
    assert len(set(ports)) == 8
    assert all(1024 <= p < ephemeral_low() for p in ports)
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_port_is_not_handed_out_twice_before_its_caller_binds_it():
    handed = [p for _ in range(200) for p in free_ports(2)]
    assert len(set(handed)) == len(handed)


def test_a_port_in_use_is_never_handed_out(monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        monkeypatch.setattr(netutil, "_below_ephemeral_range", lambda: range(port, port + 1))  # only it
        [given] = free_ports(1)  # the candidates are exhausted: the kernel chooses
        assert given != port


def test_without_a_known_ephemeral_range_the_kernel_chooses(monkeypatch, tmp_path):
    monkeypatch.setattr(netutil, "_EPHEMERAL_RANGE_FILE", tmp_path / "missing")
    ports = free_ports(3)
    assert len(set(ports)) == 3 and all(p > 0 for p in ports)
