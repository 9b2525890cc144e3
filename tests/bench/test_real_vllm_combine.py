"""The real-vLLM table of truth over several runs: each of ours against the best peer with a 95 % interval."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from bench.routing.real_vllm import MEASURED_REQUESTS, combine, main


def row(name: str, scale: float, rng: random.Random) -> dict:
    ttft = [round(rng.expovariate(1 / scale), 4) for _ in range(220)]
    p90 = sorted(ttft)[int(0.9 * len(ttft))]
    return {"name": name, "status": "ok", "verdict": "valid", "refused": None, "ttft_p50": scale, "ttft_p90": p90,
            "hit_rate": 0.9, "tok_s": 13.0, "groups": {}, "samples": {"ttft": ttft}}


def write_run(folder: Path, seed: int) -> Path:
    rng = random.Random(seed)
    rows = [row("epp-precise", 0.05, rng), row("epp-approx", 0.101, rng), row("vllm-router-kv-aware", 0.15, rng),
            row("llmd-optimized-baseline", 0.10, rng), row("round-robin", 0.2, rng)]
    folder.mkdir(parents=True)
    (folder / "results.json").write_text(json.dumps({
        "command": "python -m bench.routing.real_vllm", "started": f"2026-12-0{seed} 10:00:00 UTC",
        "real": {"shared-prefix": rows}, "sim": {"shared-prefix": rows}}))
    return folder


def test_the_table_of_truth_says_how_sure_each_claim_against_the_best_peer_is(tmp_path):
    runs = [write_run(tmp_path / f"run{i}", i) for i in (1, 2, 3)]
    md = combine(runs, tmp_path / "truth")
    table = json.loads((tmp_path / "truth" / "table.json").read_text())["workloads"]["shared-prefix"]
    precise, approx = table["epp-precise"]["vs_best_peer"], table["epp-approx"]["vs_best_peer"]
    # llm-d's pipeline is a peer here, and the best one.
    assert precise["peer"] == "llmd-optimized-baseline" and "vs_best_peer" not in table["llmd-optimized-baseline"]
    assert precise["runs"] == 3 and precise["low"] > 1 and precise["verdict"] == "met"
    assert approx["low"] < 1 < approx["high"] and approx["verdict"] == "tie"
    text = md.read_text()
    assert "| epp-precise | " in text and "| tie |" in text


def test_the_measured_stage_holds_enough_requests_for_a_p90_by_default():
    assert MEASURED_REQUESTS >= 200
    with pytest.raises(SystemExit):  # refused before anything starts
        main(["--requests", "0"])
