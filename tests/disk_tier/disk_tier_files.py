"""Helpers that build real tier contents: vLLM-named block files, tmpfs remounts."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

from epp.engine.disk_tier.naming import vllm_fs_relpath


def write_block(root: Path, index: int, size: int, *, age_s: float = 1000.0, atime_age_s: float | None = None,
                group: int = 0) -> Path:
    """A complete block file named like vLLM's fs tier, with its mtime `age_s` ago (atime likewise)."""
    digest = index.to_bytes(4, "big") * 8  # 32 bytes, like a sha256 digest
    path = root / vllm_fs_relpath(digest, group)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"k" * size)
    now = time.time()
    os.utime(path, (now - (age_s if atime_age_s is None else atime_age_s), now - age_s))
    return path


def block_hash_int(index: int) -> int:
    """The event hash vLLM would publish for write_block(index): the digest's last 8 bytes."""
    return int.from_bytes((index.to_bytes(4, "big") * 8)[-8:], "big")


def remount(mnt: Path, mode: str) -> None:
    """Turn a tmpfs read-only ("ro") or writable ("rw") again."""
    subprocess.run(["mount", "-o", f"remount,{mode}", str(mnt)], check=True)
