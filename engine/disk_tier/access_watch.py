"""Block-file reads as the kernel reports them (inotify IN_OPEN), for the disk tier's LRU order.

Under the usual `relatime` mount option a file's atime moves only on the first read after a write
(or once a day), so vLLM's repeated loads of a hot block leave no trace in the inode: ordering by
atime is really ordering by first read. inotify reports every open(2) of a file in a watched
directory, whatever the mount options, so each load of a block becomes an access record.

New directories are watched from the manager's next scan (in its thread, never on the event
loop); a block opened before then was just written, so its mtime already orders it.

Cost: one watch per directory of the tier (inotify does not recurse; vLLM's layout has a model
dir, up to 4,096 `<hhh>` dirs and up to 256 `<hh>_g<group>` dirs under each), about 1 KiB of
unswappable kernel memory per watch, limited per user by `fs.inotify.max_user_watches`; one
event (16 bytes + the name, ~90 bytes for a vLLM block name) per open, not per read(2) call
(IN_OPEN, not IN_ACCESS; the kernel also merges an open identical to the last one still queued),
read by the manager's event loop without blocking. When the kernel's queue
(`fs.inotify.max_queued_events`) overflows, events are lost and counted; when watches run out,
the directories without one fall back to atime/mtime, counted too. Without inotify (not Linux,
no libc, no instance left) the watcher reports itself unavailable and the manager orders by
max(atime, mtime) as before.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import errno
import logging
import os
import struct
from collections.abc import Callable, Iterable
from pathlib import Path

log = logging.getLogger(__name__)

IN_OPEN = 0x00000020
IN_Q_OVERFLOW = 0x00004000
IN_IGNORED = 0x00008000
IN_ONLYDIR = 0x01000000
IN_ISDIR = 0x40000000
IN_NONBLOCK = os.O_NONBLOCK
IN_CLOEXEC = os.O_CLOEXEC
WATCH_MASK = IN_OPEN | IN_ONLYDIR
_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len (then `len` bytes of NUL-padded name)
READ_BYTES = 64 * 1024  # per wake-up of the event loop: at most ~700 events of vLLM block names


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name, use_errno=True)
        libc.inotify_init1.argtypes = [ctypes.c_int]
        libc.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
        libc.inotify_rm_watch.argtypes = [ctypes.c_int, ctypes.c_int]
    except (OSError, AttributeError):
        return None
    return libc


class AccessWatcher:
    """Watches every directory of a tier and calls `on_access(relpath)` for each file opened in it."""

    def __init__(self, root: Path, on_access: Callable[[str], None]) -> None:
        self.root = root
        self.on_access = on_access
        self.fd: int | None = None
        self.unavailable_reason = ""
        self.events = 0  # opens reported
        self.overflows = 0  # times the kernel queue overflowed (events lost)
        self.watch_errors = 0  # directories left unwatched (watch limit, races)
        self._libc = _libc()
        self._dirs: dict[int, str] = {}  # watch descriptor -> directory relative to root ("" is root)
        self._watched: dict[str, int] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._warned_limit = False

    @property
    def available(self) -> bool:
        """True while the kernel reports opens."""
        return self.fd is not None

    @property
    def watches(self) -> int:
        """Directories watched now."""
        return len(self._watched)

    def open(self) -> bool:
        """Create the inotify instance; False (with `unavailable_reason`) where there is none."""
        if self._libc is None or not hasattr(self._libc, "inotify_init1"):
            self.unavailable_reason = "no inotify in this platform's C library"
            return False
        fd = self._libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
        if fd < 0:
            err = ctypes.get_errno()
            self.unavailable_reason = f"inotify_init1: {os.strerror(err)}"
            return False
        self.fd = fd
        return True

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> bool:
        """Open (if needed) and read events on `loop` (the running one by default)."""
        if self.fd is None and not self.open():
            log.warning("disk tier %s: access order from atime/mtime only (%s)", self.root, self.unavailable_reason)
            return False
        self._loop = loop or asyncio.get_running_loop()
        assert self.fd is not None
        self._loop.add_reader(self.fd, self.read_events)
        return True

    def close(self) -> None:
        """Stop reading and release the instance (every watch goes with it)."""
        if self.fd is None:
            return
        if self._loop is not None:
            self._loop.remove_reader(self.fd)
        os.close(self.fd)
        self.fd = None
        self._dirs.clear()
        self._watched.clear()

    def watch_dirs(self, rel_dirs: Iterable[str]) -> int:
        """Add a watch for each directory not yet watched (blocking: call it from a thread); returns how many."""
        if self.fd is None or self._libc is None:
            return 0
        added = 0
        for rel in rel_dirs:
            if rel in self._watched:
                continue
            if self._add(rel):
                added += 1
        return added

    def _add(self, rel: str) -> bool:
        assert self.fd is not None and self._libc is not None
        path = self.root / rel if rel else self.root
        wd = self._libc.inotify_add_watch(self.fd, os.fsencode(path), WATCH_MASK)
        if wd < 0:
            err = ctypes.get_errno()
            self.watch_errors += 1
            if err == errno.ENOSPC and not self._warned_limit:
                self._warned_limit = True
                log.warning("disk tier %s: inotify watch limit reached (fs.inotify.max_user_watches); "
                            "unwatched directories fall back to atime/mtime order", self.root)
            return False
        self._dirs[wd] = rel
        self._watched[rel] = wd
        return True

    def read_events(self) -> int:
        """Read what the kernel queued (one buffer, never blocks) and report each file opened; returns opens."""
        if self.fd is None:
            return 0
        try:
            data = os.read(self.fd, READ_BYTES)
        except BlockingIOError:
            return 0
        except OSError as exc:
            log.warning("disk tier %s: reading inotify events failed: %s", self.root, exc)
            return 0
        opened = 0
        offset = 0
        while offset + _EVENT.size <= len(data):
            wd, mask, _cookie, length = _EVENT.unpack_from(data, offset)
            name = data[offset + _EVENT.size:offset + _EVENT.size + length].split(b"\0", 1)[0]
            offset += _EVENT.size + length
            if mask & IN_Q_OVERFLOW:
                self.overflows += 1
                continue
            if mask & IN_IGNORED:  # the directory went away (or the watch was removed)
                rel = self._dirs.pop(wd, None)
                if rel is not None:
                    self._watched.pop(rel, None)
                continue
            parent = self._dirs.get(wd)
            if parent is None or not name:
                continue
            if mask & IN_ISDIR or not mask & IN_OPEN:  # a scan opening a subdirectory
                continue
            opened += 1
            self.on_access(os.fsdecode(name) if not parent else f"{parent}/{os.fsdecode(name)}")
        self.events += opened
        return opened
