"""Real directories for the disk-tier tests: plain tmp dirs, and small tmpfs mounts that can fill or turn read-only."""

from __future__ import annotations

import subprocess

import pytest

from tests.support.require import unavailable


@pytest.fixture
def tmpfs(tmp_path):
    """A 2 MiB tmpfs mounted for the test (root only: the `root` marker), unmounted after it."""
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        unavailable(f"cannot mount a tmpfs here ({proc.stderr.strip()})")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
