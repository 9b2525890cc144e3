"""The README's first command, `epp demo`, in its short mode: real Envoy, the picker, the simulator."""

import subprocess
import sys

import pytest

pytestmark = pytest.mark.envoy


def test_demo_short_mode_routes_everything_and_both_pickers_beat_round_robin_on_cache_hits():
    proc = subprocess.run([sys.executable, "-m", "epp.cli", "demo", "--short"], capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "| prefix-cache hit rate |" in out
    hit_line = next(line for line in out.splitlines() if line.startswith("| prefix-cache hit rate |"))
    approx, precise, round_robin = (float(cell.strip().rstrip("%")) for cell in hit_line.split("|")[2:5])
    assert approx > round_robin and precise > round_robin
    errors_line = next(line for line in out.splitlines() if line.startswith("| errors |"))
    assert errors_line.split("|")[2:5] == [" 0 ", " 0 ", " 0 "]
