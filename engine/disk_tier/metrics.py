"""Prometheus metrics of the disk-tier capacity manager, in their own registry."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

PREFIX = "epp_disk_tier"


class DiskTierMetrics:
    """Usage, budget, evictions, bytes freed, errors and health of one disk tier."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.usage_bytes = Gauge(f"{PREFIX}_usage_bytes", "Bytes of files under the tier root", registry=r)
        self.budget_bytes = Gauge(f"{PREFIX}_budget_bytes", "Disk budget of the tier", registry=r)
        self.files = Gauge(f"{PREFIX}_files", "Files under the tier root", ["kind"], registry=r)
        self.disk_free_bytes = Gauge(f"{PREFIX}_disk_free_bytes", "Free bytes on the tier's filesystem", registry=r)
        self.healthy = Gauge(f"{PREFIX}_healthy", "1 when the tier is usable, 0 when it is skipped", registry=r)
        self.over_budget = Gauge(
            f"{PREFIX}_over_budget", "1 when usage stays above the budget after eviction", registry=r)
        self.evictions = Counter(f"{PREFIX}_evictions", "Block files deleted to stay in budget", registry=r)
        self.freed_bytes = Counter(f"{PREFIX}_freed_bytes", "Bytes freed by evictions", registry=r)
        self.orphans_removed = Counter(
            f"{PREFIX}_orphan_temp_files_removed", "Stale temp files of interrupted writes removed", registry=r)
        self.vanished = Counter(
            f"{PREFIX}_vanished_blocks", "Block files removed by someone else, seen by a scan", registry=r)
        self.errors = Counter(f"{PREFIX}_errors", "Filesystem errors", ["op"], registry=r)
        self.events_published = Counter(
            f"{PREFIX}_events_published", "BlockRemoved events published for the disk medium", registry=r)
        self.access_records = Gauge(
            f"{PREFIX}_access_records", "In-process access records held (bounded)", registry=r)
        self.access_watches = Gauge(
            f"{PREFIX}_access_watches", "Tier directories watched for opens (inotify)", registry=r)
        self.access_opens = Counter(
            f"{PREFIX}_access_opens", "Block-file opens reported by the kernel (inotify)", registry=r)
        self.access_watch_errors = Counter(
            f"{PREFIX}_access_watch_errors", "Directories left unwatched (watch limit): atime/mtime order there",
            registry=r)
        self.access_overflows = Counter(
            f"{PREFIX}_access_event_overflows", "Times the kernel's inotify queue overflowed (opens lost)",
            registry=r)
        self.scan_seconds = Histogram(
            f"{PREFIX}_scan_seconds", "Duration of one walk of the tier", registry=r,
            buckets=(0.001, 0.01, 0.05, 0.1, 0.5, 1, 5, 30))
