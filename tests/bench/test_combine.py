"""Several runs of one scenario as one result: medians, every run kept whole, claims with intervals."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from bench.routing.__main__ import main
from bench.routing.combine import best_peer, claim_lines, combined, comparison, load_runs


def run(started: str, p90s: dict[str, float], seed: int, scenario: str = "shared-prefix") -> dict:
    """One run's results.json: per contender 200 exponential TTFTs scaled to the given p90 (roughly)."""
    rng = random.Random(seed)
    results = []
    for name, p90 in p90s.items():
        ttft = [round(rng.expovariate(2.3 / p90), 4) for _ in range(200)]
        results.append({"name": name, "status": "ok", "verdict": "valid", "validity": "ok",
                        "overall": {"ttft_p90": p90, "hit_rate": 0.5, "goodput": {"good": 10}, "per_replica": {"r0": 1}},
                        "samples": {"ttft": ttft, "prompt": [100] * 200, "cached": [50] * 200}})
    return {"scenario": scenario, "scale": "small", "command": "python -m bench.routing run x", "started": started,
            "results": results}


def write(folder: Path, doc: dict) -> Path:
    folder.mkdir(parents=True)
    (folder / "results.json").write_text(json.dumps(doc))
    return folder


def test_the_combination_keeps_every_run_and_the_medians(tmp_path):
    runs = [run(f"2026-12-0{i} 10:00:00 UTC", {"epp-approx": 0.1 * i, "vllm-router-kv-aware": 0.3}, i) for i in (1, 2, 3)]
    doc = combined(runs, "python -m bench.routing run x --repeats 3")
    assert doc["runs"] == runs and doc["started"].startswith("2026-12-03")
    row = next(r for r in doc["results"] if r["name"] == "epp-approx")
    assert row["runs"] == 3 and row["overall"]["ttft_p90"] == pytest.approx(0.2)
    assert row["overall"]["goodput"] == {"good": 10} and row["verdict"] == "valid"
    assert best_peer(runs) == "vllm-router-kv-aware"


def test_runs_made_apart_combine_and_a_combination_combines_again(tmp_path):
    a = write(tmp_path / "a", run("2026-12-01 10:00:00 UTC", {"epp-approx": 0.1, "vllm-router-kv-aware": 0.3}, 1))
    b = write(tmp_path / "b", run("2026-12-02 10:00:00 UTC", {"epp-approx": 0.1, "vllm-router-kv-aware": 0.3}, 2))
    assert main(["combine", str(a), str(b), "--out", str(tmp_path / "ab")]) == 0
    c = write(tmp_path / "c", run("2026-12-03 10:00:00 UTC", {"epp-approx": 0.1, "vllm-router-kv-aware": 0.3}, 3))
    assert main(["combine", str(tmp_path / "ab"), str(c), "--out", str(tmp_path / "abc")]) == 0
    runs = load_runs([tmp_path / "abc"])
    assert len(runs) == 3
    assert comparison(runs, "epp-approx", "vllm-router-kv-aware").verdict() == "met"
    report = (tmp_path / "abc" / "report.md").read_text()
    assert "3 runs" in report and "| epp-approx | vllm-router-kv-aware | " in report and "| faster |" in report


def test_close_contenders_read_as_a_tie_and_other_scenarios_do_not_mix(tmp_path):
    runs = [run(f"2026-12-0{i} 10:00:00 UTC", {"epp-approx": 0.100, "vllm-router-kv-aware": 0.101}, 10 + i)
            for i in (1, 2, 3)]
    assert any("**tie**" in line for line in claim_lines(runs))
    a = write(tmp_path / "a", runs[0])
    b = write(tmp_path / "b", run("2026-12-02 10:00:00 UTC", {"epp-approx": 0.1}, 1, scenario="multi-turn"))
    with pytest.raises(ValueError, match="different scenarios"):
        load_runs([a, b])
    with pytest.raises(ValueError, match="no results.json"):
        load_runs([tmp_path / "nothing"])


def test_contenders_measured_later_join_the_runs_one_to_one(tmp_path):
    peers = write(tmp_path / "peers", combined(
        [run(f"2026-12-0{i} 10:00:00 UTC", {"epp-approx": 0.5, "vllm-router-kv-aware": 0.3}, i) for i in (1, 2, 3)],
        "python -m bench.routing run x --repeats 3"))
    ours = write(tmp_path / "ours", combined(
        [run(f"2026-12-0{i} 12:00:00 UTC", {"epp-approx": 0.1}, 20 + i) for i in (1, 2, 3)],
        "python -m bench.routing run x --contenders epp-approx --repeats 3"))
    assert main(["combine", str(peers), "--join", str(ours), "--out", str(tmp_path / "joined")]) == 0
    runs = load_runs([tmp_path / "joined"])
    assert len(runs) == 3  # joined run by run, not appended as three more runs
    # the later measurement replaces the earlier row of the same contender, and pairs with the peer's
    assert comparison(runs, "epp-approx", "vllm-router-kv-aware").verdict() == "met"
    assert runs[0]["joined"][0]["contenders"] == ["epp-approx"]
    two = write(tmp_path / "two", combined(runs[:2], "x"))
    with pytest.raises(SystemExit):
        main(["combine", str(peers), "--join", str(two), "--out", str(tmp_path / "bad")])
