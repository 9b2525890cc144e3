"""A disk tier the manager cannot delete from turns unhealthy, and healthy again once it can.

Reproduces issue #18 item 10: run as non-root over a tier directory it may not write, the manager
counted and logged unlink errors every cycle but kept reporting healthy. The manager runs here
as `epp engine disk-manager` in its own process, as an unprivileged user: when the test runs as
root (whose CAP_DAC_OVERRIDE ignores permissions), `setpriv` drops it to nobody first.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
import tempfile
from pathlib import Path

import aiohttp
import pytest
from disk_tier_files import write_block

from epp.netutil import free_ports
from tests.support.require import unavailable

KB = 1024
NOBODY = 65534


def unprivileged_prefix() -> list[str]:
    """The command prefix that runs a process without the right to ignore file permissions."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        unavailable("running as root without setpriv: cannot drop privileges")
    return [setpriv, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]


@pytest.fixture
def tier():
    """A tier directory under /tmp that an unprivileged user can read (the pytest tmp_path is 0700)."""
    root = Path(tempfile.mkdtemp(prefix="epp-tier-", dir="/tmp"))
    root.chmod(0o755)
    try:
        yield root
    finally:
        for d in [root, *root.rglob("*")]:
            if d.is_dir():
                d.chmod(0o755)
        shutil.rmtree(root, ignore_errors=True)


def set_dirs_mode(root: Path, mode: int) -> None:
    for d in [root, *(p for p in root.rglob("*") if p.is_dir())]:
        d.chmod(mode)


async def status(session: aiohttp.ClientSession, port: int) -> dict:
    async with session.get(f"http://127.0.0.1:{port}/status") as resp:
        return await resp.json()


async def metric(session: aiohttp.ClientSession, port: int, name: str) -> float:
    async with session.get(f"http://127.0.0.1:{port}/metrics") as resp:
        for line in (await resp.text()).splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    return 0.0


async def wait_for(session: aiohttp.ClientSession, port: int, predicate, what: str, timeout: float = 20.0) -> dict:
    last: dict = {}
    for _ in range(int(timeout / 0.1)):
        try:
            last = await status(session, port)
            if predicate(last):
                return last
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}; last status {last}")


@pytest.mark.slow
async def test_a_tier_it_cannot_delete_from_turns_unhealthy_then_recovers(tier):
    for i in range(12):  # 120 KB on a 100 KB budget: the manager must delete 7 files
        write_block(tier, i, 10 * KB, age_s=1000 - i)
    set_dirs_mode(tier, 0o555 if os.geteuid() != 0 else 0o755)  # readable, not writable by the manager
    [port] = free_ports(1)
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    proc = await asyncio.create_subprocess_exec(
        *unprivileged_prefix(), sys.executable, "-m", "epp.engine.disk_tier.cli", "--root", str(tier),
        "--budget-bytes", str(100 * KB), "--interval", "0.1", "--min-age", "0", "--http-host", "127.0.0.1",
        "--http-port", str(port), env=env, stderr=asyncio.subprocess.PIPE)
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
            bad = await wait_for(session, port, lambda s: not s["tier_healthy"], "the tier to turn unhealthy")
            assert "deletions failing" in bad["reason"] and "Permission denied" in bad["reason"]
            assert await metric(session, port, "epp_disk_tier_healthy") == 0
            assert await metric(session, port, 'epp_disk_tier_errors_total{op="unlink"}') >= 3 * 7
            assert len(list(tier.rglob("*.bin"))) == 12  # nothing was deleted, nothing was lost

            set_dirs_mode(tier, 0o777)  # the operator fixes the permissions
            await wait_for(session, port, lambda s: s["tier_healthy"], "the tier to recover")
            # Back under the high watermark (85 KB), and nothing below the low one (50 KB) deleted. One
            # clean cycle leaves 5 files; a cycle that ran while the directories were being made
            # writable one by one deletes only some victims, and the next finds usage under 85 KB
            # (a CI run saw 7 left).
            assert 5 <= len(list(tier.rglob("*.bin"))) <= 8
    finally:
        proc.terminate()
        _, err = await proc.communicate()
    # One warning per failing streak, not one per cycle.
    assert err.decode().count("deletions failed") == 1, err.decode()
