"""The disk-tier capacity manager on real directories: watermarks, LRU order, writes in flight, failures."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import msgspec
import pytest
import zmq
from disk_tier_files import block_hash_int, remount, write_block

from epp.engine.disk_tier.manager import DiskTierConfig, DiskTierManager
from epp.engine.disk_tier.naming import vllm_fs_block_key
from epp.engine.kv_publisher import KVEventPublisher
from epp.kvevents.decoding import BlockRemoved as DecodedRemoved
from epp.kvevents.decoding import Tier, decode_batch

KB = 1024


class ListSink:
    """Keeps published batches in memory."""

    def __init__(self):
        self.batches = []

    def publish(self, events, ts=None):
        self.batches.append(list(events))

    @property
    def hashes(self) -> list[int]:
        return [h for batch in self.batches for e in batch for h in e.block_hashes]


def _manager(root, budget, sink=None, **kw) -> DiskTierManager:
    return DiskTierManager(DiskTierConfig(root=root, budget_bytes=budget, min_free_bytes=0, **kw), sink)


async def test_below_high_watermark_nothing_is_deleted(tmp_path):
    for i in range(8):
        write_block(tmp_path, i, 10 * KB)  # 80 KB of a 100 KB budget: under 85 %
    report = await _manager(tmp_path, 100 * KB).run_cycle()
    assert report.evicted == [] and report.usage_bytes == 80 * KB
    assert len(list(tmp_path.rglob("*.bin"))) == 8


async def test_at_high_watermark_oldest_files_go_down_to_low_watermark(tmp_path):
    for i in range(9):
        write_block(tmp_path, i, 10 * KB, age_s=1000 - i)  # block 0 is the oldest
    sink = ListSink()
    report = await _manager(tmp_path, 100 * KB, sink).run_cycle()  # 90 KB >= 85 KB
    assert report.usage_bytes <= 50 * KB
    assert sorted(sink.hashes) == sorted(block_hash_int(i) for i in range(4))
    assert len(list(tmp_path.rglob("*.bin"))) == 5
    assert report.freed_bytes == 40 * KB


async def test_access_time_order_wins_over_write_order(tmp_path):
    # Written in order 0..8, but 0..3 were read recently (atime) and 4 is recorded as accessed.
    for i in range(9):
        write_block(tmp_path, i, 10 * KB, age_s=1000 - i, atime_age_s=(20 if i < 4 else None))
    sink = ListSink()
    manager = _manager(tmp_path, 100 * KB, sink)
    manager.record_access(vllm_fs_block_key_path(tmp_path, 4), time.time() - 10)
    await manager.run_cycle()
    assert sorted(sink.hashes) == sorted(block_hash_int(i) for i in (5, 6, 7, 8))


def vllm_fs_block_key_path(root, index) -> str:
    path = next(p for p in root.rglob("*.bin") if vllm_fs_block_key(str(p.relative_to(root))).digest
                == index.to_bytes(4, "big") * 8)
    return str(path.relative_to(root))


async def test_mtime_clock_ignores_atime(tmp_path):
    for i in range(9):
        write_block(tmp_path, i, 10 * KB, age_s=1000 - i, atime_age_s=(20 if i < 4 else None))
    sink = ListSink()
    await _manager(tmp_path, 100 * KB, sink, access_clock="mtime").run_cycle()
    assert sorted(sink.hashes) == sorted(block_hash_int(i) for i in range(4))


async def test_files_being_written_and_fresh_blocks_are_left_alone(tmp_path):
    old = [write_block(tmp_path, i, 10 * KB) for i in range(3)]
    fresh = [write_block(tmp_path, 10 + i, 10 * KB, age_s=0) for i in range(3)]
    writing = old[0].parent / (old[0].name + "_12345.tmp")  # vLLM's temp name beside the final one
    writing.write_bytes(b"w" * 30 * KB)
    orphan = old[1].parent / (old[1].name + "_999.tmp")
    orphan.write_bytes(b"o" * 5 * KB)
    os.utime(orphan, (time.time() - 7200, time.time() - 7200))
    config = tmp_path / "model_000000000000"
    config.mkdir()
    (config / "config.json").write_text("{}")
    sink = ListSink()
    report = await _manager(tmp_path, 40 * KB, sink, min_age_s=60).run_cycle()
    assert writing.exists() and all(p.exists() for p in fresh) and (config / "config.json").exists()
    assert not orphan.exists() and report.orphans_removed == 1
    assert not any(p.exists() for p in old)
    assert sorted(sink.hashes) == sorted(block_hash_int(i) for i in range(3))  # no event for the orphan


async def test_events_are_published_in_vllm_wire_format_and_decodable(tmp_path):
    for i in range(9):
        write_block(tmp_path, i, 10 * KB, age_s=1000 - i, group=1)
    topic = "kv@10.0.0.5:8000@llama"
    publisher = KVEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*", topic=topic)
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(publisher.bound_endpoint)
    await asyncio.sleep(0.3)
    try:
        await _manager(tmp_path, 100 * KB, publisher).run_cycle()
        assert sub.poll(3000)
        frames = sub.recv_multipart()
    finally:
        sub.close(0)
        publisher.close()
    assert frames[0].decode() == topic and int.from_bytes(frames[1], "big") == 0
    raw_ts, raw_events, dp_rank = msgspec.msgpack.decode(frames[2])
    assert raw_events[0] == {"type": "BlockRemoved", "block_hashes": [block_hash_int(0)], "medium": "STORAGE",
                             "group_idx": 1}
    [removed] = decode_batch(frames[2]).events  # one removal per file, read as one run
    assert isinstance(removed, DecodedRemoved) and removed.tier == Tier.DISK and removed.group_idx == 1
    assert removed.block_hashes == tuple(block_hash_int(i) for i in range(4)) and removed.events == 4


async def test_blocks_removed_by_someone_else_are_announced(tmp_path):
    paths = [write_block(tmp_path, i, KB) for i in range(3)]
    sink = ListSink()
    manager = _manager(tmp_path, 100 * KB, sink)
    await manager.run_cycle()
    paths[1].unlink()
    report = await manager.run_cycle()
    assert report.vanished == 1 and sink.hashes == [block_hash_int(1)]


async def test_missing_root_marks_the_tier_unhealthy_then_recovers(tmp_path):
    root = tmp_path / "tier"
    manager = _manager(root, 100 * KB)
    report = await manager.run_cycle()
    assert not report.healthy and "scan failed" in report.reason
    assert manager.metrics.healthy._value.get() == 0
    root.mkdir()
    assert (await manager.run_cycle()).healthy


async def test_directory_that_turns_read_only_is_skipped_without_crash(tmpfs):
    for i in range(9):
        write_block(tmpfs, i, 100 * KB, age_s=1000 - i)
    sink = ListSink()
    manager = _manager(tmpfs, 1000 * KB, sink)
    remount(tmpfs, "ro")
    try:
        report = await manager.run_cycle()
        assert not report.healthy and report.reason == "filesystem is read-only"
        assert report.evicted == [] and sink.hashes == []
        assert len(list(tmpfs.rglob("*.bin"))) == 9
    finally:
        remount(tmpfs, "rw")
    report = await manager.run_cycle()
    assert report.healthy and len(report.evicted) == 4 and len(sink.hashes) == 4


@pytest.mark.slow
async def test_budget_smaller_than_the_writes_keeps_serving(tmpfs):
    """A writer fills a 2 MiB tmpfs like vLLM (temp file, then rename) far beyond a 512 KiB budget."""
    stop = threading.Event()
    write_errors = []

    def writer():
        i = 0
        while not stop.is_set():
            digest = i.to_bytes(4, "big") * 8
            final = tmpfs / "m_0_r0" / digest.hex()[:3] / f"{digest.hex()[3:5]}_g0" / f"{digest.hex()}.bin"
            tmp = final.parent / (final.name + "_1.tmp")
            try:
                final.parent.mkdir(parents=True, exist_ok=True)
                tmp.write_bytes(b"x" * 64 * KB)
                os.replace(tmp, final)
            except OSError as exc:  # ENOSPC when the manager is behind: vLLM drops the store
                write_errors.append(exc.errno)
                tmp.unlink(missing_ok=True)  # as vLLM's fs tier removes its temp file on failure
            i += 1
            time.sleep(0.002)

    sink = ListSink()
    manager = _manager(tmpfs, 512 * KB, sink, min_age_s=0.0, interval_s=0.02)
    manager_stop = asyncio.Event()
    thread = threading.Thread(target=writer)
    thread.start()
    task = asyncio.create_task(manager.run(manager_stop))
    await asyncio.sleep(2.0)
    stop.set()
    thread.join()
    await asyncio.sleep(0.2)
    manager_stop.set()
    await task
    report = await manager.run_cycle()
    assert manager.metrics.evictions._value.get() > 0 and sink.hashes
    assert report.usage_bytes <= 512 * KB
    assert manager.metrics.errors.labels("cycle")._value.get() == 0


async def test_full_disk_is_reported_and_relieved(tmpfs):
    for i in range(30):
        write_block(tmpfs, i, 64 * KB, age_s=1000 - i)  # about 1.9 MiB of a 2 MiB filesystem
    manager = DiskTierManager(DiskTierConfig(root=tmpfs, budget_bytes=10 << 20, min_free_bytes=512 * KB))
    report = await manager.run_cycle()
    assert report.reason == "disk full" and report.evicted
    assert os.statvfs(tmpfs).f_bavail * os.statvfs(tmpfs).f_frsize >= 512 * KB
    assert (await manager.run_cycle()).healthy


def test_invalid_watermarks_are_refused(tmp_path):
    with pytest.raises(ValueError):
        DiskTierConfig(root=tmp_path, budget_bytes=100, high_watermark=0.5, low_watermark=0.6)
