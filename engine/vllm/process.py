"""Start a vLLM server as its own process group, wait for /health, stop the whole group."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path


class VllmStartError(RuntimeError):
    """vLLM exited or did not become healthy in time; the message carries the log's tail."""


class VllmProcess:
    """One running vLLM server (api server + engine core + workers, all in one process group)."""

    def __init__(self, argv: list[str], env: dict[str, str], log_path: Path, base_url: str):
        self.argv = argv
        self.log_path = Path(log_path)
        self.base_url = base_url.rstrip("/")
        full_env = dict(os.environ)
        full_env.update(env)
        self._log = open(self.log_path, "ab")
        # A new session gives vLLM its own process group, so stop() reaches the engine and
        # worker processes it spawns, not only the API server.
        self.popen = subprocess.Popen(
            argv, env=full_env, stdout=self._log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )

    def log_tail(self, chars: int = 4000) -> str:
        """The end of the server's log, for error messages."""
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def wait_healthy(self, timeout_s: float = 300.0) -> float:
        """Poll /health until 200; return the seconds it took. Raise VllmStartError on exit or timeout."""
        start = time.monotonic()
        while True:
            code = self.popen.poll()
            if code is not None:
                self.stop()
                raise VllmStartError(f"vLLM exited with {code} during start-up:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        return time.monotonic() - start
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            if time.monotonic() - start > timeout_s:
                self.stop()
                raise VllmStartError(
                    f"vLLM did not answer /health within {timeout_s:.0f} s:\n{self.log_tail()}"
                )
            time.sleep(0.5)

    def stop(self, grace_s: float = 20.0) -> int | None:
        """SIGTERM the process group, SIGKILL it after `grace_s`; return the exit code."""
        if self.popen.poll() is None:
            try:
                os.killpg(self.popen.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.popen.wait(grace_s)
            except subprocess.TimeoutExpired:
                pass
        # Children (engine core, workers) may outlive the API server: kill what is left.
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self.popen.wait(5)
        except subprocess.TimeoutExpired:
            pass
        self._log.close()
        return self.popen.returncode
