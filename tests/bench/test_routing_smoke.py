"""Routing benchmark smoke run (tiny scale): every contender starts, routes and reports.

One run of the `shared-prefix` tiny scenario through every contender feeds the per-contender
checks. Peer routers come from the venv `bench/setup-peers` builds; without it (and outside CI)
their checks are skipped with the reason, in CI they must run.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from bench.routing.contenders import CONTENDERS, Tuning, epp_config, missing_plugin_types, peers_venv
from bench.routing.report import write_report
from bench.routing.runner import ContenderResult, run_contender, run_scenario
from bench.routing.scenarios import get_scenario
from epp.engine.sim.fleet import default_tokenizer_dir
from tests.support.require import under_ci

# The module fixture runs every contender once (~4 s each) inside the first test: its limit grows with the list.
pytestmark = [pytest.mark.envoy, pytest.mark.slow, pytest.mark.timeout(600)]


def _peers_installed() -> bool:
    return (peers_venv() / "bin" / "vllm-router").exists() and (peers_venv() / "bin" / "sglang-router").exists()


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> tuple[dict[str, ContenderResult], Path]:
    out = tmp_path_factory.mktemp("routing-smoke")
    logging.getLogger("aiohttp.server").setLevel(logging.CRITICAL)  # peers' HTTP/2 probes
    names = [n for n, c in CONTENDERS.items() if not c.is_peer or _peers_installed() or under_ci()]
    scenario = get_scenario("shared-prefix", "tiny")
    results = asyncio.run(run_scenario(scenario, names, out, progress=False, keep_raw=False))
    write_report(scenario, results, out, "pytest smoke", "now")
    return {r.name: r for r in results}, out


def _not_loadable_yet(name: str) -> list[str]:
    """The plugin types an llm-d guide pipeline needs that this tree has not registered (none: all are built)."""
    tuning = Tuning(tokenizer_dir=default_tokenizer_dir(), block_size=16, prefill_s_per_token=0.0, mean_prompt_tokens=0)
    c = CONTENDERS[name]
    return missing_plugin_types(epp_config(c.variant, tuning)) if c.variant.startswith("llmd:") else []


@pytest.mark.parametrize("name", list(CONTENDERS))
def test_contender_starts_routes_and_reports(smoke, name):
    results, _ = smoke
    if name not in results:
        pytest.skip(f"peer routers not installed in {peers_venv()} (run bench/setup-peers)")
    r = results[name]
    assert not _not_loadable_yet(name), f"{name}: our loader refuses the guide pipeline ({r.status})"
    assert r.status == "ok", r.status
    o = r.overall
    assert o is not None and o.requests >= 8
    assert o.errors == 0, o.error_kinds
    assert o.ok == o.requests and o.output_tokens_per_s > 0
    assert o.ttft_p90 is not None and o.ttft_p90 > 0
    # Every request reached a replica, and the replicas' counters saw each one finish.
    assert sum(o.per_replica.values()) == o.ok
    # The oracle is an upper bound: no router beats it.
    assert o.hit_rate is not None and o.oracle_hit_rate is not None
    assert o.hit_rate <= o.oracle_hit_rate + 1e-9
    # Fair peers: the router's own counters show its policy and cache index worked.
    assert r.verdict == "valid", r.validity


def test_report_has_a_row_per_contender_and_both_plots(smoke):
    results, out = smoke
    report = (out / "report.md").read_text()
    for name in results:
        assert f"| {name} |" in report
    assert "Command: `pytest smoke`" in report
    for png in ("ttft_p90.png", "throughput.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "results.json").exists()


@pytest.mark.parametrize("name", ["epp-precise", "epp-approx"])
def test_prefix_aware_picker_beats_round_robin_on_cache_hits(smoke, name):
    # Four groups whose prefixes fit two to a replica: a picker that puts three on one replica
    # thrashes its cache and falls to round-robin's hit rate (GIE's random tie-break did, at times).
    results, _ = smoke
    rr, ours = results["round-robin"].overall, results[name].overall
    assert rr is not None and ours is not None
    assert ours.hit_rate > rr.hit_rate


def test_a_peer_that_cannot_start_is_reported_unavailable(tmp_path, monkeypatch):
    monkeypatch.setenv("EPP_PEERS_VENV", str(tmp_path / "no-venv"))
    monkeypatch.setenv("PATH", "/nonexistent")
    scenario = get_scenario("shared-prefix", "tiny")
    res = asyncio.run(run_contender(scenario, CONTENDERS["sglang-router-cache-aware"], tmp_path, progress=False))
    assert res.status.startswith("unavailable: sglang-router not installed")
    assert res.overall is None
