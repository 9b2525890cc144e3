"""CPU groups of a benchmark run: made as asked, measured, refused when held back, and always removed.

These tests make real cgroup v1 groups, so they need root and writable `cpu`, `cpuacct` and
`cpuset` controllers; elsewhere they skip with the reason `unavailable()` gives. Each runs its
processes under a fresh owner pid, so a stale-group sweep never touches another run's groups.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from bench.cgroups import CONTROLLERS, PREFIX, ROOT, CpuGroups, GroupSpec, clean_stale, unavailable
from bench.routing.real_vllm import cpu_plan, refusal

REPO = Path(__file__).resolve().parents[2]
needs_cgroups = pytest.mark.skipif(unavailable() is not None, reason=unavailable() or "")


def run_dirs(owner: int) -> list[Path]:
    return [ROOT / c / f"{PREFIX}{owner}" for c in CONTROLLERS]


def spawn_owner(body: str) -> subprocess.Popen:
    """A process that makes groups (its own run) and prints `ready <child pid>` once they hold a child."""
    script = textwrap.dedent('''
        import subprocess, sys, time
        from bench.cgroups import CpuGroups, GroupSpec, interrupt_on_sigterm
        interrupt_on_sigterm()
        groups = CpuGroups([GroupSpec("replica-0", cpus="0", quota_cores=0.5), GroupSpec("harness", quota_cores=0.2)])
    ''') + textwrap.dedent(body)
    return subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})


def wait_ready(proc: subprocess.Popen) -> int:
    line = proc.stdout.readline()
    assert line.startswith("ready"), line
    return int(line.split()[1])


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    return state != "Z"


@needs_cgroups
def test_groups_are_made_as_specified_hold_their_processes_and_go_on_close():
    groups = CpuGroups([GroupSpec("replica-0", cpus="0", quota_cores=0.5, shares=4096),
                        GroupSpec("harness", quota_cores=0.25, burst_cores=0.25)], period_us=20_000)
    with groups:
        cpu = groups.path("cpu", "replica-0")
        assert (cpu / "cpu.cfs_quota_us").read_text().strip() == "10000"
        assert (cpu / "cpu.cfs_period_us").read_text().strip() == "20000"
        assert (cpu / "cpu.shares").read_text().strip() == "4096"
        assert (groups.path("cpuset", "replica-0") / "cpuset.cpus").read_text().strip() == "0"
        assert (groups.path("cpu", "harness") / "cpu.cfs_quota_us").read_text().strip() == "5000"
        assert (groups.path("cpu", "harness") / "cpu.cfs_burst_us").read_text().strip() == "5000"
        # A wrapped command joins its group before it runs, keeping its pid; a busy loop is capped at the quota.
        proc = subprocess.Popen(groups.wrap("replica-0", [sys.executable, "-c", "while True: pass"]))
        try:
            deadline = time.monotonic() + 10
            while proc.pid not in groups.pids("replica-0") and time.monotonic() < deadline:
                time.sleep(0.05)
            assert groups.pids("replica-0") == [proc.pid]
            cgroup = Path(f"/proc/{proc.pid}/cgroup").read_text()
            assert all(f"{c}:/{groups.run_name}/replica-0" in cgroup for c in CONTROLLERS)
            before = groups.sample()
            time.sleep(1.0)
            delta = groups.sample()["replica-0"].minus(before["replica-0"])
        finally:
            proc.kill()
            proc.wait()
        assert 0.3 < delta.usage_s < 0.7  # half a core for about a second
        assert delta.nr_throttled > 0 and delta.throttled_s > 0.2
    assert not any(d.exists() for d in run_dirs(os.getpid()))


@needs_cgroups
def test_close_moves_the_owner_back_out_of_its_group_before_removing_it():
    groups = CpuGroups([GroupSpec("harness", quota_cores=1.0)]).create()
    try:
        groups.add("harness", os.getpid())
        assert os.getpid() in groups.pids("harness")
    finally:
        groups.close()
    assert f"cpu:/{PREFIX}" not in Path("/proc/self/cgroup").read_text()
    assert not any(d.exists() for d in run_dirs(os.getpid()))


@needs_cgroups
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_run_stopped_by_a_signal_removes_its_groups(sig):
    owner = spawn_owner('''
        with groups:
            child = subprocess.Popen(groups.wrap("replica-0", ["sleep", "60"]))
            try:
                while child.pid not in groups.pids("replica-0"):
                    time.sleep(0.01)
                print("ready", child.pid, flush=True)
                time.sleep(60)
            finally:
                child.kill()
                child.wait()
    ''')
    child = wait_ready(owner)
    assert all(d.exists() for d in run_dirs(owner.pid))
    owner.send_signal(sig)
    assert owner.wait(20) != 0
    assert not any(d.exists() for d in run_dirs(owner.pid))
    assert not alive(child)


@needs_cgroups
def test_the_next_run_removes_the_groups_of_a_killed_run_and_what_it_left_running():
    owner = spawn_owner('''
        groups.create()
        child = subprocess.Popen(groups.wrap("replica-0", ["sleep", "60"]), start_new_session=True)
        while child.pid not in groups.pids("replica-0"):
            time.sleep(0.01)
        print("ready", child.pid, flush=True)
        time.sleep(60)
    ''')
    child = wait_ready(owner)
    mine = CpuGroups([GroupSpec("harness", quota_cores=0.5)]).create()  # a live owner's groups stay
    try:
        assert all(d.exists() for d in run_dirs(owner.pid))
        owner.kill()  # no finally, no atexit: its groups and its replica stay behind
        owner.wait(10)
        assert all(d.exists() for d in run_dirs(owner.pid)) and alive(child)
        removed = clean_stale()
        assert set(removed) == {str(d) for d in run_dirs(owner.pid)}
        assert all(d.exists() for d in run_dirs(os.getpid()))
    finally:
        mine.close()
    assert not any(d.exists() for d in run_dirs(owner.pid))
    deadline = time.monotonic() + 5
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(child)


@needs_cgroups
def test_a_replica_throttled_by_its_quota_makes_its_row_refused():
    groups = CpuGroups([GroupSpec("replica-0", cpus="0", quota_cores=0.2), GroupSpec("replica-1", cpus="1",
                                                                                      quota_cores=1.0)])
    with groups:
        busy = [subprocess.Popen(groups.wrap(f"replica-{i}", [sys.executable, "-c", "while True: pass"]))
                for i in range(2)]
        try:
            time.sleep(0.5)
            before, t0 = groups.sample(), time.monotonic()
            time.sleep(1.0)
            after, wall = groups.sample(), time.monotonic() - t0
        finally:
            for p in busy:
                p.kill()
                p.wait()
    seen = {name: {"throttled_share": after[name].minus(before[name]).throttled_s / wall} for name in after}
    assert seen["replica-0"]["throttled_share"] > 0.5  # it wanted the whole core and had a fifth of it
    why = refusal(seen, bound=0.10)
    assert why is not None and "replica-0 throttled" in why and "replica-1" not in why


def test_the_refusal_bounds_and_the_plan_of_groups():
    assert refusal({"replica-0": {"throttled_share": 0.08}, "replica-1": {"throttled_share": 0.0},
                    "harness": {"throttled_share": 0.01}}, bound=0.10, harness_bound=0.02) is None
    assert refusal({"replica-1": {"throttled_share": 0.12}}, bound=0.10) == (
        "refused (bounds: replicas 10%, harness 2% throttled): replica-1 throttled 12.0% of the wall")
    assert "harness throttled 3.0%" in refusal({"harness": {"throttled_share": 0.03}}, bound=0.10, harness_bound=0.02)
    specs, binds = cpu_plan(2, 2, 0.85, 0.3)
    assert binds == ["0", "1"]
    assert [(s.name, s.cpus, s.quota_cores, s.burst_cores) for s in specs] == [
        ("replica-0", "0", 0.85, 0.0), ("replica-1", "1", 0.85, 0.0), ("harness", None, 0.3, 0.3)]
    with pytest.raises(ValueError, match="more than the machine"):
        CpuGroups([GroupSpec("a", quota_cores=float(os.cpu_count() or 1)), GroupSpec("b", quota_cores=0.5)])


def test_without_root_or_controllers_the_reason_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert unavailable() == "cgroups not used: not running as root"
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    assert unavailable(tmp_path) == f"cgroups not used: the cgroup v1 'cpu' controller is not mounted at {tmp_path / 'cpu'}"
