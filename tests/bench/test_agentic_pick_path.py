"""The agentic request-path benchmark routes every turn of each config it is given and reports its costs."""

from __future__ import annotations

from pathlib import Path

from bench.agentic_pick_path import measure

ROOT = Path(__file__).resolve().parents[2]


async def test_both_agentic_pipelines_route_every_turn_and_report_positive_costs():
    for config in (ROOT / "examples/configs/agentic.yaml", ROOT / "bench/agentic/configs/llmd-agentic.yaml"):
        m = await measure(config, turns=6, warmup=2)
        assert m["cpu_ms"] > 0 and 0 < m["route_p50_ms"] <= m["route_p90_ms"]
