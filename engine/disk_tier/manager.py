"""The disk-tier capacity manager: evict least-recently-used block files between watermarks.

vLLM's fs tier writes block files and never deletes them. Every `interval_s` the manager walks
the tier (in a thread), and when usage reaches `high_watermark` × budget it deletes the least
recently accessed block files until usage is at most `low_watermark` × budget, then publishes
one vLLM-format `BlockRemoved` (medium "STORAGE") per deleted block, so the picker's index
stays true. Files it never deletes:
- temp names (`*.tmp`): vLLM is writing them (they are renamed into place when complete);
  a temp file older than `stale_temp_s` is an orphan of an interrupted write and is removed
  (no event: it was never a block);
- block files younger than `min_age_s` (by mtime or access): just written or just read, a load
  may be about to open them;
- anything that is not a block file by the naming function (config.json, probes).
A file under its final name is complete, because vLLM renames it into place atomically.

Access order: `max(atime, mtime, in-process record)`; atime alone is unreliable under
relatime/noatime (see scanner.probe_strict_atime), mtime is when the block was written, and the
records come from the kernel's open notifications (`access_watch.AccessWatcher`, inotify: every
load of a block by vLLM is an open) or from `record_access` (a hook, a test).

A disk that fails never stops serving: a failed scan, a read-only filesystem or unlink errors in
`unlink_error_cycles` (3) cycles in a row (no write permission, an immutable file, EIO) mark the
tier unhealthy (metric `epp_disk_tier_healthy` 0, a log line on each change);
the manager keeps running and retries each interval; vLLM itself falls back to recompute
(`kv_load_failure_policy: recompute` from the launcher). A full disk is also unhealthy and
triggers eviction down to the low watermark even below the budget's high mark.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol

from epp.engine.disk_tier.access_watch import AccessWatcher
from epp.engine.disk_tier.membership import ChunkMembership
from epp.engine.disk_tier.metrics import DiskTierMetrics
from epp.engine.disk_tier.naming import BlockNamer, vllm_fs_block_key
from epp.engine.disk_tier.scanner import TierFile, TreeScan, probe_strict_atime, scan_tree, unlink_files
from epp.engine.kv_publisher import MEDIUM_STORAGE, BlockRemoved

log = logging.getLogger(__name__)


class RemovedBlockSink(Protocol):
    """Where BlockRemoved events go; `epp.engine.kv_publisher.KVEventPublisher` is one."""

    def publish(self, events: Sequence[BlockRemoved], ts: float | None = None) -> None: ...


@dataclass(frozen=True)
class DiskTierConfig:
    """Budget and policy of one disk tier."""

    root: Path
    budget_bytes: int
    high_watermark: float = 0.85
    low_watermark: float = 0.50
    interval_s: float = 5.0
    min_age_s: float = 5.0
    stale_temp_s: float = 600.0
    min_free_bytes: int = 64 << 20
    access_clock: Literal["auto", "mtime"] = "auto"
    int_hashes: bool = True
    max_events_per_batch: int = 1000
    access_record_capacity: int = 1_000_000
    unlink_error_cycles: int = 3  # this many cycles in a row with failed deletions: unhealthy

    def __post_init__(self) -> None:
        if self.budget_bytes <= 0:
            raise ValueError("budget_bytes must be positive")
        if not 0 < self.low_watermark < self.high_watermark <= 1:
            raise ValueError("watermarks must satisfy 0 < low < high <= 1")
        if self.unlink_error_cycles < 1:
            raise ValueError("unlink_error_cycles must be at least 1")


@dataclass
class CycleReport:
    """What one manager cycle saw and did (for tests, logs and /status)."""

    usage_bytes: int = 0
    evicted: list[TierFile] = field(default_factory=list)
    freed_bytes: int = 0
    orphans_removed: int = 0
    vanished: int = 0
    events_published: int = 0
    healthy: bool = True
    reason: str = ""


def select_victims(
    files: Sequence[TierFile], usage_bytes: int, target_bytes: int, now: float, min_age_s: float,
    stale_temp_s: float, access_time: Callable[[TierFile], float],
) -> tuple[list[TierFile], list[TierFile]]:
    """(orphan temp files, block files oldest-access first) whose deletion brings usage to target."""
    orphans = [f for f in files if f.temp and now - f.mtime >= stale_temp_s]
    remaining = usage_bytes - sum(f.size for f in orphans)
    candidates = [f for f in files if not f.temp and f.key is not None and now - access_time(f) >= min_age_s]
    candidates.sort(key=access_time)
    victims = []
    for f in candidates:
        if remaining <= target_bytes:
            break
        victims.append(f)
        remaining -= f.size
    return orphans, victims


class DiskTierManager:
    """Keeps one tier directory within budget; run `run()` as a task, or `run_cycle()` step by step."""

    def __init__(
        self, config: DiskTierConfig, sink: RemovedBlockSink | None = None, *,
        namer: BlockNamer = vllm_fs_block_key, metrics: DiskTierMetrics | None = None,
        clock: Callable[[], float] = time.time, membership: ChunkMembership | None = None,
        watcher: AccessWatcher | None = None,
    ):
        self.config = config
        self.sink = sink
        self.namer = namer
        self.metrics = metrics or DiskTierMetrics()
        self.clock = clock
        self.membership = membership
        self.watcher = watcher  # started by the caller; the manager adds a watch for each directory it scans
        self._watcher_counts = (0, 0, 0)
        self.healthy = True
        self.reason = ""
        self.strict_atime: bool | None = None
        self.ready = asyncio.Event()
        self.last_report: CycleReport | None = None
        self._known: dict[str, TierFile] = {}
        self._access: collections.OrderedDict[str, float] = collections.OrderedDict()
        self._failing_unlink_cycles = 0  # consecutive cycles whose deletions failed
        self._last_unlink_error = ""
        self.metrics.budget_bytes.set(config.budget_bytes)
        self.metrics.healthy.set(1)

    def record_access(self, relpath: str, when: float | None = None) -> None:
        """Note that a block file was read (bounded LRU of records; the oldest record is dropped)."""
        self._access[relpath] = self.clock() if when is None else when
        self._access.move_to_end(relpath)
        while len(self._access) > self.config.access_record_capacity:
            self._access.popitem(last=False)
        self.metrics.access_records.set(len(self._access))

    def access_time(self, f: TierFile) -> float:
        """The file's last access as the manager knows it."""
        seen = self._access.get(f.relpath, 0.0)
        if self.config.access_clock == "mtime":
            return max(f.mtime, seen)
        return max(f.atime, f.mtime, seen)

    def _set_health(self, healthy: bool, reason: str) -> None:
        if healthy != self.healthy or reason != self.reason:
            if healthy:
                log.info("disk tier %s is healthy again", self.config.root)
            else:
                log.warning("disk tier %s skipped: %s (serving goes on; vLLM recomputes)", self.config.root, reason)
        self.healthy, self.reason = healthy, reason
        self.metrics.healthy.set(1 if healthy else 0)

    def _removed_hashes(self, f: TierFile) -> list[int | bytes]:
        assert f.key is not None
        own = f.key.event_hash(self.config.int_hashes)
        if self.membership is None or not isinstance(own, int):
            return [own]
        hashes = list(self.membership.hashes_for(own, f.key.group_idx))
        self.membership.forget(own, f.key.group_idx)
        return hashes

    def _publish_removed(self, files: Sequence[TierFile]) -> int:
        # One event per block hash, as vLLM fans out evictions of a chunk.
        events = [
            BlockRemoved(block_hashes=[h], medium=MEDIUM_STORAGE, group_idx=f.key.group_idx)
            for f in files if f.key is not None
            for h in self._removed_hashes(f)
        ]
        if self.sink is None or not events:
            return 0
        step = self.config.max_events_per_batch
        for i in range(0, len(events), step):
            self.sink.publish(events[i:i + step])
        self.metrics.events_published.inc(len(events))
        return len(events)

    async def run_cycle(self) -> CycleReport:
        """One scan, and one eviction round if needed; never raises on filesystem errors."""
        cfg = self.config
        report = CycleReport()
        if self.strict_atime is None and cfg.access_clock == "auto":
            self.strict_atime = await asyncio.to_thread(probe_strict_atime, cfg.root)
        scan: TreeScan = await asyncio.to_thread(scan_tree, cfg.root, self.namer)
        self.metrics.scan_seconds.observe(scan.duration_s)
        if not scan.ok:
            self.metrics.errors.labels("scan").inc(len(scan.errors) or 1)
            self._set_health(False, "scan failed: " + "; ".join(scan.errors[:3]))
            return self._finish(report)

        vanished = [f for rel, f in self._known.items() if rel not in scan.files and f.key is not None]
        if vanished:
            report.vanished = len(vanished)
            self.metrics.vanished.inc(len(vanished))
            report.events_published += self._publish_removed(vanished)
            for f in vanished:
                self._access.pop(f.relpath, None)
        self._known = scan.files
        report.usage_bytes = scan.total_bytes
        if self.watcher is not None and self.watcher.available:
            await asyncio.to_thread(self.watcher.watch_dirs, scan.dirs)
        self._observe(scan)

        disk_full = scan.disk_free_bytes < cfg.min_free_bytes
        if scan.read_only:
            self._set_health(False, "filesystem is read-only")
            return self._finish(report)

        high = cfg.high_watermark * cfg.budget_bytes
        if scan.total_bytes < high and not disk_full:
            self._failing_unlink_cycles = 0  # nothing to delete: whatever failed before no longer matters
            self._set_health(True, "")
            return self._finish(report)
        target = int(cfg.low_watermark * cfg.budget_bytes)
        if disk_full:
            # Free at least what the filesystem lacks, even when the tier is within budget.
            target = min(target, scan.total_bytes - (cfg.min_free_bytes - scan.disk_free_bytes))
        now = self.clock()
        orphans, victims = select_victims(list(scan.files.values()), scan.total_bytes, target, now,
                                          cfg.min_age_s, cfg.stale_temp_s, self.access_time)
        errors: list[str] = []
        read_only = False
        if orphans:
            done = await asyncio.to_thread(unlink_files, cfg.root, orphans)
            report.orphans_removed = len(done.removed)
            self.metrics.orphans_removed.inc(len(done.removed))
            errors += done.errors
            read_only |= done.read_only
            for f in done.removed + done.already_gone:
                self._known.pop(f.relpath, None)
            report.usage_bytes -= done.freed_bytes
        if victims and not read_only:
            done = await asyncio.to_thread(unlink_files, cfg.root, victims)
            gone = done.removed + done.already_gone
            report.evicted = done.removed
            report.freed_bytes = done.freed_bytes
            report.usage_bytes -= done.freed_bytes
            self.metrics.evictions.inc(len(done.removed))
            self.metrics.freed_bytes.inc(done.freed_bytes)
            errors += done.errors
            read_only |= done.read_only
            for f in gone:
                self._known.pop(f.relpath, None)
                self._access.pop(f.relpath, None)
            report.events_published += self._publish_removed(gone)
        self._count_unlink_errors(errors)
        self.metrics.usage_bytes.set(report.usage_bytes)
        self.metrics.over_budget.set(1 if report.usage_bytes > cfg.budget_bytes else 0)
        if read_only:
            self._set_health(False, "filesystem is read-only")
        elif self._failing_unlink_cycles >= cfg.unlink_error_cycles:
            # A stable reason (no counts, no file names), so the change is logged once.
            self._set_health(False, f"deletions failing ({self._last_unlink_error}) in "
                                    f"{cfg.unlink_error_cycles}+ cycles in a row")
        else:
            self._set_health(not disk_full, "disk full" if disk_full else "")
        return self._finish(report)

    def _count_unlink_errors(self, errors: list[str]) -> None:
        if not errors:
            self._failing_unlink_cycles = 0
            return
        self._failing_unlink_cycles += 1
        self._last_unlink_error = errors[0].rsplit(": ", 1)[-1]  # the strerror, without the file name
        self.metrics.errors.labels("unlink").inc(len(errors))
        if self._failing_unlink_cycles == 1:  # once per failing streak; the metric counts every error
            log.warning("disk tier %s: %d deletions failed: %s", self.config.root, len(errors), errors[0])

    def _observe(self, scan: TreeScan) -> None:
        blocks = sum(1 for f in scan.files.values() if f.key is not None)
        temps = sum(1 for f in scan.files.values() if f.temp)
        self.metrics.usage_bytes.set(scan.total_bytes)
        self.metrics.disk_free_bytes.set(scan.disk_free_bytes)
        self.metrics.files.labels("block").set(blocks)
        self.metrics.files.labels("temp").set(temps)
        self.metrics.files.labels("other").set(len(scan.files) - blocks - temps)
        self.metrics.over_budget.set(1 if scan.total_bytes > self.config.budget_bytes else 0)
        self.metrics.access_records.set(len(self._access))
        if self.watcher is not None:
            w = self.watcher
            counts = (w.events, w.watch_errors, w.overflows)
            opens, errors, overflows = (now - before for now, before in zip(counts, self._watcher_counts, strict=True))
            self._watcher_counts = counts
            self.metrics.access_watches.set(w.watches)
            self.metrics.access_opens.inc(opens)
            self.metrics.access_watch_errors.inc(errors)
            self.metrics.access_overflows.inc(overflows)

    def _finish(self, report: CycleReport) -> CycleReport:
        report.healthy, report.reason = self.healthy, self.reason
        self.last_report = report
        self.ready.set()
        return report

    def status(self) -> dict:
        """A JSON-able summary for /status and /ready."""
        r = self.last_report
        return {
            "root": str(self.config.root),
            "ready": self.ready.is_set(),
            "tier_healthy": self.healthy,
            "reason": self.reason,
            "budget_bytes": self.config.budget_bytes,
            "usage_bytes": r.usage_bytes if r else None,
            "strict_atime": self.strict_atime,
            "access_watch": (self.watcher.watches if self.watcher is not None and self.watcher.available
                             else None),
        }

    async def run(self, stop: asyncio.Event | None = None) -> None:
        """Cycle every interval until `stop` is set; an unexpected error is logged, never fatal."""
        stop = stop or asyncio.Event()
        while not stop.is_set():
            try:
                await self.run_cycle()
            except Exception:  # a bug must not end the sidecar: serving matters more than eviction
                self.metrics.errors.labels("cycle").inc()
                log.exception("disk tier cycle failed")
                self._set_health(False, "internal error (see log)")
                self.ready.set()
            try:
                await asyncio.wait_for(stop.wait(), self.config.interval_s)
            except TimeoutError:
                pass
