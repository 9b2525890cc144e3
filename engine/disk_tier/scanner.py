"""Blocking filesystem work of the disk tier (walk, stat, unlink, probes); callers run it in a thread."""

from __future__ import annotations

import errno
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from epp.engine.disk_tier.naming import BlockFileKey, BlockNamer, is_temp_name


@dataclass(frozen=True, slots=True)
class TierFile:
    """One regular file under the tier root."""

    relpath: str
    size: int
    atime: float
    mtime: float
    key: BlockFileKey | None
    temp: bool


@dataclass(slots=True)
class TreeScan:
    """One walk of the tier: its files, sizes, the filesystem state and what went wrong."""

    files: dict[str, TierFile] = field(default_factory=dict)
    dirs: list[str] = field(default_factory=list)  # directories relative to the root ("" is the root)
    total_bytes: int = 0
    ok: bool = True
    read_only: bool = False
    disk_free_bytes: int = 0
    errors: list[str] = field(default_factory=list)
    duration_s: float = 0.0


def scan_tree(root: Path, namer: BlockNamer) -> TreeScan:
    """Walk `root` (no symlinks followed); a failure marks the scan not ok instead of raising."""
    start = time.monotonic()
    scan = TreeScan()
    try:
        st = os.statvfs(root)
        scan.read_only = bool(st.f_flag & os.ST_RDONLY)
        scan.disk_free_bytes = st.f_bavail * st.f_frsize
    except OSError as exc:
        scan.ok = False
        scan.errors.append(f"statvfs {root}: {exc.strerror or exc}")
        scan.duration_s = time.monotonic() - start
        return scan

    def on_error(exc: OSError) -> None:
        scan.ok = False
        scan.errors.append(f"walk {exc.filename}: {exc.strerror or exc}")

    root_s = str(root)
    for dirpath, _dirs, names in os.walk(root_s, onerror=on_error):
        rel_dir = os.path.relpath(dirpath, root_s)
        scan.dirs.append("" if rel_dir == "." else rel_dir.replace(os.sep, "/"))
        for name in names:
            full = os.path.join(dirpath, name)
            try:
                st_file = os.lstat(full)
            except FileNotFoundError:
                continue  # renamed or removed while we walked: the next scan sees the truth
            except OSError as exc:
                scan.ok = False
                scan.errors.append(f"stat {full}: {exc.strerror or exc}")
                continue
            if not os.path.stat.S_ISREG(st_file.st_mode):
                continue
            rel = name if rel_dir == "." else f"{rel_dir}/{name}".replace(os.sep, "/")
            temp = is_temp_name(name)
            scan.files[rel] = TierFile(rel, st_file.st_size, st_file.st_atime, st_file.st_mtime,
                                       None if temp else namer(rel), temp)
            scan.total_bytes += st_file.st_size
    scan.duration_s = time.monotonic() - start
    return scan


@dataclass(slots=True)
class UnlinkResult:
    """What a batch of deletions did."""

    removed: list[TierFile] = field(default_factory=list)
    already_gone: list[TierFile] = field(default_factory=list)
    freed_bytes: int = 0
    errors: list[str] = field(default_factory=list)
    read_only: bool = False


def unlink_files(root: Path, victims: list[TierFile]) -> UnlinkResult:
    """Delete victims in order; stop at a read-only filesystem (every further unlink would fail)."""
    result = UnlinkResult()
    for victim in victims:
        try:
            os.unlink(root / victim.relpath)
        except FileNotFoundError:
            result.already_gone.append(victim)
            continue
        except OSError as exc:
            result.errors.append(f"unlink {victim.relpath}: {exc.strerror or exc}")
            if exc.errno == errno.EROFS:
                result.read_only = True
                break
            continue
        result.removed.append(victim)
        result.freed_bytes += victim.size
    return result


def probe_strict_atime(root: Path) -> bool | None:
    """True if reads update atime at once (strictatime), False if not (relatime/noatime), None on error.

    Under relatime an atime moves only on the first read after a write (or once a day), so it
    orders files only roughly; the manager then also uses mtime and its own access records.
    """
    probe = root / f".epp_atime_probe_{os.getpid()}.tmp"
    try:
        probe.write_bytes(b"x")
        now = time.time()
        os.utime(probe, (now - 50, now - 100))
        with open(probe, "rb") as fh:
            fh.read()
        return os.stat(probe).st_atime > now - 49
    except OSError:
        return None
    finally:
        try:
            probe.unlink()
        except OSError:
            pass
