"""The disk tier's LRU order follows every read of a block, also on relatime mounts (kernel open events).

Reproduces issue #18 item 11: under `relatime` a block's atime moves on its first read after the
write and then not again (for a day), so a block vLLM keeps loading looked older than one read
once since: "least recently accessed" was really "least recently written or first read".
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import time

from disk_tier_files import write_block

from epp.engine.disk_tier.access_watch import AccessWatcher
from epp.engine.disk_tier.manager import DiskTierConfig, DiskTierManager
from epp.engine.disk_tier.naming import vllm_fs_block_key
from epp.engine.disk_tier.scanner import scan_tree

KB = 1024


def load(path) -> None:
    """What vLLM's fs tier does to load a block: open it and read it."""
    with open(path, "rb") as fh:
        fh.read()


async def test_a_block_read_again_and_again_outlives_one_read_once_on_a_relatime_mount(tmp_path):
    hot = write_block(tmp_path, 0, 10 * KB, age_s=1000)  # written first
    cold = write_block(tmp_path, 1, 10 * KB, age_s=900)
    # 20 KB on a 22 KB budget: over the 85 % mark, one block must go down to 50 %.
    config = DiskTierConfig(root=tmp_path, budget_bytes=22 * KB, min_age_s=0.0, min_free_bytes=0)
    watched = DiskTierManager(config)
    watcher = AccessWatcher(tmp_path, watched.record_access)
    assert watcher.start(), watcher.unavailable_reason
    watched.watcher = watcher
    blind = DiskTierManager(config)  # the manager as it was: atime and mtime only
    try:
        assert watcher.watch_dirs(scan_tree(tmp_path, vllm_fs_block_key).dirs) == 4  # root and 3 levels
        load(hot)
        time.sleep(0.02)
        load(cold)
        time.sleep(0.02)
        for _ in range(5):  # vLLM keeps loading the hot block
            load(hot)
        await asyncio.sleep(0.2)  # the event loop reads the kernel's open events
        assert watcher.events >= 3  # hot, cold, hot: the kernel merges repeats queued back to back

        scan = scan_tree(tmp_path, vllm_fs_block_key)
        hot_f, cold_f = (scan.files[str(p.relative_to(tmp_path))] for p in (hot, cold))
        if hot_f.atime < cold_f.atime:  # relatime (this machine's / is): the repeated loads left no trace
            assert blind.access_time(hot_f) < blind.access_time(cold_f)  # the old order: hot looked colder
        assert watched.access_time(hot_f) > watched.access_time(cold_f)

        report = await watched.run_cycle()
        assert [f.relpath for f in report.evicted] == [cold_f.relpath]
        assert hot.exists() and not cold.exists()
        assert watched.metrics.access_opens._value.get() >= 3
        assert watched.metrics.access_watches._value.get() == 4
    finally:
        watcher.close()


async def test_directories_vllm_creates_later_are_watched_from_the_next_scan(tmp_path):
    manager = DiskTierManager(DiskTierConfig(root=tmp_path, budget_bytes=1 << 20, min_free_bytes=0))
    watcher = AccessWatcher(tmp_path, manager.record_access)
    assert watcher.start()
    manager.watcher = watcher
    try:
        await manager.run_cycle()
        assert watcher.watches == 1
        block = write_block(tmp_path, 7, KB)
        await manager.run_cycle()
        assert watcher.watches == 4
        load(block)
        await asyncio.sleep(0.2)
        rel = str(block.relative_to(tmp_path))
        assert manager._access.get(rel, 0) > time.time() - 5
        assert manager.status()["access_watch"] == 4
    finally:
        watcher.close()


def test_without_inotify_the_manager_orders_by_atime_and_mtime(tmp_path):
    """No inotify instance left (here: no file descriptor left): the watcher says why, the manager goes on."""
    script = textwrap.dedent(f"""
        import asyncio, os, resource
        from pathlib import Path
        from epp.engine.disk_tier.access_watch import AccessWatcher
        from epp.engine.disk_tier.manager import DiskTierConfig, DiskTierManager
        watcher = AccessWatcher(Path({str(tmp_path)!r}), print)
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        held = []
        while True:
            try:
                held.append(os.dup(0))
            except OSError:
                break
        print("opened", watcher.open(), watcher.unavailable_reason)
        for fd in held:
            os.close(fd)
        manager = DiskTierManager(DiskTierConfig(root=Path({str(tmp_path)!r}), budget_bytes=1 << 20,
                                                 min_free_bytes=0), watcher=watcher)
        report = asyncio.run(manager.run_cycle())
        print("healthy", report.healthy, manager.status()["access_watch"])
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, PYTHONDONTWRITEBYTECODE="1"))
    assert out.returncode == 0, out.stderr
    assert "opened False inotify_init1: Too many open files" in out.stdout
    assert "healthy True None" in out.stdout
