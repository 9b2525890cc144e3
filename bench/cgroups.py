"""CPU a benchmark's processes own: cgroup v1 `cpu`, `cpuacct` and `cpuset` groups, measured and removed.

A run's groups live under `<controller>/epp-bench-<owner pid>/` in each of the three v1
hierarchies (`/sys/fs/cgroup/{cpu,cpuacct,cpuset}`), one child per `GroupSpec`:
- `cpuset.cpus` pins the group to its cores (a vLLM-CPU replica to the core its OMP thread is
  bound to);
- `cpu.cfs_quota_us` caps it at `quota_cores` per period, so no group can take another's share
  however much it burns (the quotas of one run add up to at most the machine); `burst_cores`
  (`cpu.cfs_burst_us`, at most the quota) lets a mostly idle group spend quota it saved in a
  short burst, so a router's spikes are not throttled while its average stays within its share;
- `cpu.shares` is its weight against everything else on its cores: a task at nice 10 in the root
  group weighs 110, a group `shares` (default 8192), so other users' jobs barely slow it.
Each `sample()` reads every group's CPU time (`cpuacct.usage`) and its throttling (`cpu.stat`:
`nr_periods`, `nr_throttled`, `throttled_time`).

Every exit path removes the groups: `close()` (also the context manager's exit and an `atexit`
hook) stops nothing it did not start but moves any task left behind back to the root group, then
removes the directories. A run killed outright leaves its groups behind; the next run's
`clean_stale()` removes every `epp-bench-<pid>` group whose owner is gone, killing the tasks
still in it first (processes that run started: its replicas outlive it in their own sessions).
`unavailable()` says in one line why groups cannot be used (not root, controllers not mounted
or read-only); callers then run without them.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")
CONTROLLERS = ("cpu", "cpuacct", "cpuset")
PREFIX = "epp-bench-"
DEFAULT_PERIOD_US = 100_000  # the kernel's default
DEFAULT_SHARES = 8192
_TERM_GRACE_S = 5.0


class CgroupError(RuntimeError):
    """A group could not be created, joined or removed (the message names the file)."""


@dataclass(frozen=True, slots=True)
class GroupSpec:
    """One group: its name, the cores it may run on (None: all of the run's), its CPU cap and weight."""

    name: str
    cpus: str | None = None
    quota_cores: float | None = None  # None: no cap (only the weight)
    shares: int = DEFAULT_SHARES
    burst_cores: float = 0.0  # unused quota it may save up and spend at once (at most quota_cores)


@dataclass(frozen=True, slots=True)
class GroupStats:
    """One group's counters at one instant (cumulative since it was created)."""

    usage_s: float  # CPU seconds its tasks ran
    nr_periods: int  # CFS periods in which it had runnable tasks
    nr_throttled: int  # periods that ended with it throttled (quota spent)
    throttled_s: float  # seconds its tasks were held back by the quota

    def minus(self, before: GroupStats) -> GroupStats:
        """The change since `before`."""
        return GroupStats(self.usage_s - before.usage_s, self.nr_periods - before.nr_periods,
                          self.nr_throttled - before.nr_throttled, self.throttled_s - before.throttled_s)


def unavailable(root: Path = ROOT) -> str | None:
    """Why this process cannot make CPU groups, in one line; None when it can."""
    if os.geteuid() != 0:
        return "cgroups not used: not running as root"
    for controller in CONTROLLERS:
        d = root / controller
        if not (d / "cgroup.procs").exists():
            return f"cgroups not used: the cgroup v1 '{controller}' controller is not mounted at {d}"
        if not os.access(d, os.W_OK):
            return f"cgroups not used: {d} is not writable"
    return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _tasks(directory: Path) -> list[int]:
    try:
        return [int(x) for x in (directory / "cgroup.procs").read_text().split()]
    except OSError:
        return []


def _write(path: Path, value: str | int) -> None:
    try:
        path.write_text(f"{value}\n")
    except OSError as exc:
        raise CgroupError(f"cannot write {value!r} to {path}: {exc.strerror or exc}") from None


def _remove_tree(directory: Path, *, kill: bool) -> None:
    """Remove `directory` and its child groups; their tasks are killed (`kill`) or moved to the root group."""
    if not directory.is_dir():
        return
    for child in sorted((p for p in directory.iterdir() if p.is_dir()), reverse=True):
        _remove_tree(child, kill=kill)
    root_procs = _controller_root(directory) / "cgroup.procs"
    deadline = time.monotonic() + _TERM_GRACE_S * 2
    signals = [signal.SIGTERM] * 20 + [signal.SIGKILL]  # a second of SIGTERM, then SIGKILL each round
    while True:
        for pid in _tasks(directory):  # a task can still be joining (a wrapper between its writes)
            with contextlib.suppress(OSError):  # gone meanwhile
                if kill:
                    os.kill(pid, signals.pop(0) if len(signals) > 1 else signal.SIGKILL)
                else:
                    root_procs.write_text(f"{pid}\n")
        try:
            directory.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            if time.monotonic() > deadline:
                raise CgroupError(f"cannot remove {directory}: tasks {_tasks(directory)} are still in it") from None
            time.sleep(0.05)


def _controller_root(directory: Path) -> Path:
    """The hierarchy's root (`/sys/fs/cgroup/<controller>`) above a group directory."""
    for parent in directory.parents:
        if (parent / "cgroup.sane_behavior").exists() or parent.parent == parent:
            return parent
    return directory.parent


def owned_groups(root: Path = ROOT) -> dict[int, list[Path]]:
    """Every `epp-bench-<pid>` group directory in the hierarchies, by owner pid."""
    out: dict[int, list[Path]] = {}
    for controller in CONTROLLERS:
        base = root / controller
        if not base.is_dir():
            continue
        for d in base.glob(PREFIX + "*"):
            suffix = d.name[len(PREFIX):]
            if d.is_dir() and suffix.isdigit():
                out.setdefault(int(suffix), []).append(d)
    return out


def clean_stale(root: Path = ROOT) -> list[str]:
    """Remove the groups of runs whose owner process is gone (killing what they left running); their names."""
    removed = []
    for pid, dirs in owned_groups(root).items():
        if pid == os.getpid() or _pid_alive(pid):
            continue
        # cpu first: its tasks are the same processes as in cpuset / cpuacct, killed once.
        for d in sorted(dirs, key=lambda p: p.parent.name != "cpu"):
            _remove_tree(d, kill=True)
            removed.append(str(d))
    return removed


@dataclass
class CpuGroups:
    """The groups of one run (see the module docstring); use as a context manager or call `close()`."""

    specs: list[GroupSpec]
    period_us: int = DEFAULT_PERIOD_US
    root: Path = ROOT
    cpus: str = field(default="")  # the run's cores: the machine's when empty
    _made: list[Path] = field(default_factory=list, init=False)
    _closed: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        names = [s.name for s in self.specs]
        if len(set(names)) != len(names) or any(not n.replace("-", "").isalnum() for n in names):
            raise ValueError(f"group names must be unique words, got {names}")
        quota = sum(s.quota_cores or 0.0 for s in self.specs)
        if quota > (os.cpu_count() or 1) + 1e-9:
            raise ValueError(f"the quotas add up to {quota:g} cores, more than the machine's {os.cpu_count()}")

    @property
    def run_name(self) -> str:
        return f"{PREFIX}{os.getpid()}"

    def path(self, controller: str, group: str | None = None) -> Path:
        base = self.root / controller / self.run_name
        return base / group if group else base

    def create(self) -> CpuGroups:
        """Make the run's groups (removing any stale ones first); raise CgroupError when the kernel refuses."""
        clean_stale(self.root)
        atexit.register(self.close)
        try:
            cpus = self.cpus or (self.root / "cpuset" / "cpuset.effective_cpus").read_text().strip()
            mems = (self.root / "cpuset" / "cpuset.effective_mems").read_text().strip()
            for controller in CONTROLLERS:
                self._mkdir(self.path(controller))
            _write(self.path("cpuset") / "cpuset.cpus", cpus)
            _write(self.path("cpuset") / "cpuset.mems", mems)
            _write(self.path("cpu") / "cpu.shares", sum(s.shares for s in self.specs))
            for s in self.specs:
                for controller in CONTROLLERS:
                    self._mkdir(self.path(controller, s.name))
                _write(self.path("cpuset", s.name) / "cpuset.cpus", s.cpus or cpus)
                _write(self.path("cpuset", s.name) / "cpuset.mems", mems)
                _write(self.path("cpu", s.name) / "cpu.shares", s.shares)
                _write(self.path("cpu", s.name) / "cpu.cfs_period_us", self.period_us)
                self.set_quota(s.name, s.quota_cores)
                if s.burst_cores and s.quota_cores is not None:
                    burst = round(min(s.burst_cores, s.quota_cores) * self.period_us)
                    _write(self.path("cpu", s.name) / "cpu.cfs_burst_us", burst)
        except BaseException:
            self.close()
            raise
        return self

    def _mkdir(self, d: Path) -> None:
        try:
            d.mkdir()
        except OSError as exc:
            raise CgroupError(f"cannot create {d}: {exc.strerror or exc}") from None
        self._made.append(d)

    def procs_files(self, group: str) -> list[Path]:
        """The `cgroup.procs` files a process writes its pid into to join `group` (one per controller)."""
        return [self.path(c, group) / "cgroup.procs" for c in CONTROLLERS]

    def add(self, group: str, pid: int) -> None:
        """Move process `pid` (all its threads) into `group`."""
        for procs in self.procs_files(group):
            _write(procs, pid)

    def wrap(self, group: str, argv: list[str]) -> list[str]:
        """`argv` behind a shell that joins `group` and then execs it (the same pid), so every child starts inside."""
        files = [str(p) for p in self.procs_files(group)]
        script = 'for f in "$0" "$1" "$2"; do echo $$ > "$f" || exit 125; done; shift 2; exec "$@"'
        return ["/bin/sh", "-c", script, *files, *argv]

    def set_quota(self, group: str, cores: float | None) -> None:
        """Change `group`'s CPU cap (None: uncapped, its weight only)."""
        quota = -1 if cores is None else max(1000, round(cores * self.period_us))
        _write(self.path("cpu", group) / "cpu.cfs_quota_us", quota)

    def pids(self, group: str) -> list[int]:
        """The processes now in `group`."""
        return _tasks(self.path("cpu", group))

    def sample(self) -> dict[str, GroupStats]:
        """Every group's cumulative counters now."""
        return {s.name: self._stats(s.name) for s in self.specs}

    def _stats(self, group: str) -> GroupStats:
        usage = int((self.path("cpuacct", group) / "cpuacct.usage").read_text())
        stat = dict(line.split() for line in (self.path("cpu", group) / "cpu.stat").read_text().splitlines())
        return GroupStats(usage / 1e9, int(stat.get("nr_periods", 0)), int(stat.get("nr_throttled", 0)),
                          int(stat.get("throttled_time", 0)) / 1e9)

    def close(self) -> None:
        """Move this process back to the root group if it joined one, and remove every group (idempotent)."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        me = os.getpid()
        for controller in CONTROLLERS:
            with contextlib.suppress(OSError):
                if any(me in _tasks(d) for d in self.path(controller).glob("*") if d.is_dir()):
                    (self.root / controller / "cgroup.procs").write_text(f"{me}\n")
        errors = []
        for controller in CONTROLLERS:
            try:
                _remove_tree(self.path(controller), kill=False)
            except CgroupError as exc:
                errors.append(str(exc))
        self._made.clear()
        if errors:
            raise CgroupError("; ".join(errors))

    def __enter__(self) -> CpuGroups:
        return self.create()

    def __exit__(self, *exc: object) -> None:
        self.close()


def interrupt_on_sigterm() -> None:
    """Make SIGTERM and SIGINT unwind the main thread like Ctrl-C, so `finally` blocks stop processes and remove groups."""
    signal.signal(signal.SIGTERM, _interrupt)
    # A run started as a background job of a non-interactive shell (`nohup ... &`) inherits SIGINT
    # ignored, and Python then installs no Ctrl-C handler: a SIGINT would leave the groups behind.
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


__all__ = ["CONTROLLERS", "PREFIX", "CgroupError", "CpuGroups", "GroupSpec", "GroupStats", "clean_stale",
           "interrupt_on_sigterm", "owned_groups", "unavailable"]
