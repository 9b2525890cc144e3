"""Price files, counter windows and the pool's scaling gauges, without servers."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest
from prometheus_client import CollectorRegistry

from epp.datalayer.registry import EndpointRegistry, EndpointSpec
from epp.fleet.cost import PriceError, cost_lines, load_prices, read_counters, window_counters
from epp.fleet.pool_gauges import PoolGauges, RateWindow
from epp.framework.plugin import CycleState
from epp.framework.types import EndpointMetrics, InferenceRequest, ResponseInfo
from epp.server.runner import EppServer, ServeOptions

PAGE = """# TYPE epp_prompt_tokens_reported counter
epp_prompt_tokens_reported_total{{kind="cached",model="m",tenant="t"}} {cached}
epp_prompt_tokens_reported_total{{kind="computed",model="m",tenant="t"}} {computed}
epp_prompt_tokens_reported_total{{kind="unknown",model="m",tenant="t"}} {unknown}
# TYPE epp_output_tokens counter
epp_output_tokens_total{{model="m",tenant="t"}} {output}
"""


def test_one_cached_price_covers_every_tier_and_models_inherit_the_default():
    prices = load_prices({"default": {"input": 3, "cached": 0.3, "output": 15},
                          "models": {"big": {"input": 10}}})
    assert prices.default.cached == {"gpu": 0.3, "cpu": 0.3, "disk": 0.3}
    big = prices.for_model("big")
    assert (big.input, big.cached["cpu"], big.output) == (10, 0.3, 15)
    assert prices.for_model("other") is prices.default


@pytest.mark.parametrize(("doc", "message"), [
    ({}, "default: required"),
    ({"default": {"input": 1, "cached": 0.1}}, "default.output: required"),
    ({"default": {"input": -1, "cached": 0.1, "output": 1}}, "default.input: must be a number >= 0"),
    ({"default": {"input": 1, "cached": {"gpu": 0.1}, "output": 1}}, "missing tiers ['cpu', 'disk']"),
    ({"default": {"input": 1, "cached": {"hbm": 0.1}, "output": 1}}, "unknown tiers ['hbm']"),
    ({"default": {"input": 1, "cached": 1, "output": 1}, "pricing": 2}, "unknown fields ['pricing']"),
])
def test_bad_price_files_name_the_field(doc, message):
    with pytest.raises(PriceError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_prices(doc)


def test_window_prices_unknown_tokens_as_computed_and_survives_a_counter_reset():
    before = read_counters(PAGE.format(cached=500, computed=500, unknown=0, output=10))
    after = read_counters(PAGE.format(cached=800, computed=600, unknown=100, output=30))
    prices = load_prices({"default": {"input": 4, "cached": 1, "output": 10}, "unit_tokens": 100})
    [line] = cost_lines(window_counters(before, after), prices)
    # 300 cached, 100 computed, 100 unknown: input (100 + 100) x 4 + 300 x 1 = 1100 -> 11.0 per 100 tokens.
    assert (line.cached_tokens, line.computed_tokens, line.unknown_tokens) == (300, 100, 100)
    assert line.input_cost == pytest.approx(11.0)
    assert line.saved == pytest.approx(300 * 3 / 100)
    assert line.output_cost == pytest.approx(20 * 10 / 100)
    # The picker restarted between the scrapes: its counters start again from 0.
    reset = read_counters(PAGE.format(cached=50, computed=50, unknown=0, output=1))
    [line] = cost_lines(window_counters(before, reset), prices)
    assert (line.cached_tokens, line.computed_tokens) == (50, 50)


def test_cost_command_rejects_a_bad_price_file_with_exit_2(tmp_path):
    (tmp_path / "p.yaml").write_text("default: {input: cheap, cached: 0.1, output: 1}\n")
    (tmp_path / "m.txt").write_text("")
    out = subprocess.run([sys.executable, "-m", "epp.cli", "cost", "--prices", str(tmp_path / "p.yaml"),
                          "--after", str(tmp_path / "m.txt")], capture_output=True, text=True, timeout=30)
    assert out.returncode == 2
    assert "default.input: must be a number >= 0, got 'cheap'" in out.stderr


def test_pool_gauges_per_model():
    registry = EndpointRegistry()
    registry.set_endpoints([EndpointSpec("127.0.0.1", 8000 + i, {"model": m}) for i, m in enumerate("aab")])
    registry.update("127.0.0.1:8000", metrics=EndpointMetrics(waiting_queue_size=3, running_requests_size=2,
                                                              kv_cache_usage=0.5))
    registry.update("127.0.0.1:8001", metrics=EndpointMetrics(waiting_queue_size=1, kv_cache_usage=0.3))
    registry.update("127.0.0.1:8002", metrics=EndpointMetrics(sleeping=True, waiting_queue_size=9))
    prom = CollectorRegistry()
    gauges = PoolGauges(registry, prefill_capacity_tokens_per_s=1000.0, window=10.0).register(prom)
    for _ in range(4):
        gauges.record_prefill(registry.get("127.0.0.1:8000"), 5000)  # 20k tokens over a 10 s window

    def value(name: str, model: str, **labels: str) -> float | None:
        return prom.get_sample_value(name, {"model": model, **labels})

    assert value("epp_pool_replicas", "a", state="awake") == 2
    assert value("epp_pool_replicas", "b", state="sleeping") == 1
    assert value("epp_pool_waiting_requests", "a") == 4
    assert value("epp_pool_waiting_requests", "b") == 0  # a sleeping replica's stale queue is not demand served
    assert value("epp_pool_running_requests", "a") == 2
    assert value("epp_pool_kv_cache_usage", "a") == pytest.approx(0.4)
    assert value("epp_pool_prefill_demand_tokens_per_second", "a") == pytest.approx(2000.0)
    assert value("epp_pool_prefill_capacity_tokens_per_second", "a") == 2000.0
    assert value("epp_pool_prefill_demand_ratio", "a") == pytest.approx(1.0)
    assert value("epp_pool_prefill_capacity_tokens_per_second", "b") == 0.0


def test_rate_window_forgets_old_buckets():
    window = RateWindow(window=10.0, bucket=5.0)
    window.add(100, now=0.0)
    window.add(100, now=6.0)
    assert window.rate(now=6.0) == pytest.approx(20.0)
    assert window.rate(now=12.0) == pytest.approx(10.0)
    assert window.rate(now=30.0) == 0.0


async def test_cost_command_scrapes_a_live_picker_twice(tmp_path):
    """`--metrics-url` takes the window between two scrapes: what was counted before it is left out."""
    server = EppServer(ServeOptions(grpc_port=0, grpc_health_port=0, metrics_port=0, bind_address="127.0.0.1",
                                    scrape_metrics=False))
    await server.start()
    try:
        request = InferenceRequest("r", "completions", "m", "m", {})
        usage = {"prompt_tokens": 100, "completion_tokens": 5, "prompt_tokens_details": {"cached_tokens": 60}}
        server.accounting.on_response_complete(CycleState(), request, ResponseInfo(usage=usage), None)
        (tmp_path / "p.yaml").write_text("default: {input: 1, cached: 0.5, output: 2}\n")
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "epp.cli", "cost", "--prices", str(tmp_path / "p.yaml"), "--json",
            "--metrics-url", f"http://127.0.0.1:{server.metrics_port}/metrics", "--window", "0.2",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(), 30)
    finally:
        await server.stop(0)
    assert proc.returncode == 0, err.decode()
    report = json.loads(out)
    assert report["window_seconds"] == 0.2
    assert report["total"]["prompt_tokens"] == 0 and report["total"]["input_cost"] == 0
