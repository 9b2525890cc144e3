"""Agentic benchmark smoke run (tiny scale, through real Envoy): the command runs the contenders, reports
what cannot run with its reason, and writes the report, the results with their seeds and the CDF plot."""

from __future__ import annotations

import json
import logging

import pytest

from bench.agentic.__main__ import main

pytestmark = [pytest.mark.envoy, pytest.mark.slow, pytest.mark.timeout(300)]


def test_a_tiny_run_measures_programs_and_reports_what_cannot_run(tmp_path):
    logging.getLogger("aiohttp.server").setLevel(logging.CRITICAL)
    out = tmp_path / "agentic"
    rc = main(["run", "--scale", "tiny", "--load", "light", "--sessions", "4", "--quiet", "--contenders",
               "round-robin,epp-agentic,llmd-agentic,llmd-optimized-baseline", "--out", str(out)])
    assert rc == 0
    doc = json.loads((out / "results.json").read_text())
    assert doc["workload"]["generator"]["seed"] == 2026 and doc["workload"]["generator"]["sessions"] == 4
    assert doc["pauses"] == {"tool": 0.05, "human": 0.005, "trace": 0.05}
    rows = {r["name"]: r for r in doc["results"]}
    for name in ("round-robin", "epp-agentic"):
        r = rows[name]
        assert r["status"] == "ok" and r["verdict"] == "valid", r
        s = r["sessions"]
        assert s["complete"] == s["programs"] == 4 and s["completion_p90"] > 0
        assert r["overall"]["errors"] == 0 and r["overall"]["ttft_p90"] > 0
        assert len(r["samples"]["completion"]) == 4 and None not in r["samples"]["ttft"]
        assert 0 < s["jain_slowdown"] <= 1 and s["slowdown_p50"] >= 0.9
    # epp-agentic keeps a session on its replica (its turns stay home in a light load).
    assert rows["epp-agentic"]["sessions"]["turns_moved"] < rows["round-robin"]["sessions"]["turns_moved"]
    # llm-d's pipelines run once they load; until then each is reported with the reason.
    for name, reason in (("llmd-agentic", "config loader refuses"), ("llmd-optimized-baseline", "not registered")):
        r = rows[name]
        assert r["status"] == "ok" or (r["status"].startswith("unavailable") and reason in r["status"]), r["status"]
    md = (out / "report.md").read_text()
    assert "| epp-agentic | valid | 4/4 |" in md and "llmd-agentic" in md
    assert (out / "completion_cdf.png").exists()


def test_a_bailian_trace_replays_as_sessions(tmp_path):
    from tests.bench.test_trace_replay import bailian_rows, write_trace

    trace = write_trace(tmp_path / "qwen.jsonl", bailian_rows(conversations=3, turns=3, gap_s=0.5))
    out = tmp_path / "bailian"
    assert main(["run", "--scale", "tiny", "--trace", trace, "--trace-block-tokens", "16", "--quiet",
                 "--contenders", "round-robin", "--out", str(out)]) == 0
    doc = json.loads((out / "results.json").read_text())
    assert doc["scenario"] == "bailian" and doc["workload"]["trace"]["block_tokens"] == 16
    assert doc["pauses"]["trace"] == 1.0  # one wall second per trace second at speedup 1
    row = doc["results"][0]
    assert row["sessions"]["programs"] == row["sessions"]["complete"] == 3
    assert row["overall"]["requests"] == 9 and row["overall"]["errors"] == 0
    # Closed loop: a conversation of 3 turns 0.5 trace seconds apart takes at least its two gaps.
    assert min(v for v in row["samples"]["completion"]) >= 1.0
