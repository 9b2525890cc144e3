"""A local `redis-server` process for benchmarks and tests (loopback, temp dir, no persistence)."""

from __future__ import annotations

import ctypes
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from epp.netutil import free_ports


def redis_server_binary() -> str | None:
    """The `redis-server` executable on PATH (Debian package `redis-server`), or None."""
    return shutil.which("redis-server") or (
        "/usr/bin/redis-server" if Path("/usr/bin/redis-server").exists() else None)


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL it when the process that started it dies (Linux), so a
    test or benchmark killed midway leaves no server behind."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class RedisServer:
    """One redis-server on 127.0.0.1, bounded by `maxmemory` with allkeys-lru; stop() ends it."""

    def __init__(self, port: int | None = None, *, maxmemory: str = "256mb",
                 policy: str = "allkeys-lru", extra_args: tuple[str, ...] = ()) -> None:
        binary = redis_server_binary()
        if binary is None:
            raise RuntimeError("redis-server not found: apt-get install redis-server")
        self.binary = binary
        self.port = port or free_ports(1)[0]
        self.maxmemory = maxmemory
        self.policy = policy
        self.extra_args = extra_args
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._dir: tempfile.TemporaryDirectory[str] | None = None
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        """Start the server (again, on the same port, empty, after a stop) and wait until it answers."""
        self._dir = tempfile.TemporaryDirectory(prefix="epp-redis-")
        self._proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", self._dir.name,
             "--save", "", "--appendonly", "no", "--maxmemory", self.maxmemory,
             "--maxmemory-policy", self.policy, "--protected-mode", "yes", "--daemonize", "no",
             "--logfile", str(Path(self._dir.name) / "redis.log"), *self.extra_args],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, preexec_fn=_die_with_parent)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                err = self._proc.stderr.read().decode(errors="replace") if self._proc.stderr else ""
                raise RuntimeError(f"redis-server exited with {self._proc.returncode}: {err.strip()}")
            if self.ping():
                return self
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"redis-server on port {self.port} did not answer within {timeout_s}s")

    def ping(self) -> bool:
        """Whether the server answers PING (a raw RESP exchange, no client library needed)."""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self) -> None:
        """Kill the server (SIGKILL: as a crash looks to its clients) and remove its directory."""
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.kill()
            self._proc.wait(timeout=10)
            if self._proc.stderr:
                self._proc.stderr.close()
            self._proc = None
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
