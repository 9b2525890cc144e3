"""The README's first command, `epp demo`, in its short mode: real Envoy, the picker, the simulator."""

import os
import subprocess
import sys

import pytest

from epp.demo import machine_note

pytestmark = pytest.mark.envoy


def test_demo_short_mode_routes_everything_and_both_pickers_beat_round_robin_on_cache_hits(tmp_path):
    # Its own TMPDIR: whatever the demo leaves in the temporary directory shows up here.
    proc = subprocess.run([sys.executable, "-m", "epp.cli", "demo", "--short"], capture_output=True, text=True,
                          timeout=240, env={**os.environ, "TMPDIR": str(tmp_path)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert sorted(os.listdir(tmp_path)) == []
    assert f"on this machine's {os.cpu_count()} core(s); load average" in proc.stdout
    out = proc.stdout
    assert "| prefix-cache hit rate |" in out
    hit_line = next(line for line in out.splitlines() if line.startswith("| prefix-cache hit rate |"))
    approx, precise, round_robin = (float(cell.strip().rstrip("%")) for cell in hit_line.split("|")[2:5])
    assert approx > round_robin and precise > round_robin
    errors_line = next(line for line in out.splitlines() if line.startswith("| errors |"))
    assert errors_line.split("|")[2:5] == [" 0 ", " 0 ", " 0 "]


def test_the_demo_says_when_the_machine_is_too_small_or_busy_for_its_latency_rows():
    assert "too small or busy" in machine_note(cores=2, load_before=0.1, load_after=1.5, replicas=3)
    assert "too small or busy" in machine_note(cores=16, load_before=12.0, load_after=13.0, replicas=3)
    roomy = machine_note(cores=16, load_before=0.5, load_after=2.0, replicas=3)
    assert "too small or busy" not in roomy
    assert roomy.startswith("Latencies: Envoy, the picker, 3 simulated replicas and the client all ran on this "
                            "machine's 16 core(s); load average 0.5 before the demo")
