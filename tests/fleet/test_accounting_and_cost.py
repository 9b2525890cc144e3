"""Cached-token counters and `epp cost` on a known workload, numbers worked out by hand.

One simulated replica (blocks of 16 tokens, a GPU pool of 31 usable blocks, every computed
block also written to a CPU tier) behind real Envoy and the picker in precise mode. Prompts are
token ids, so every count is exact:

  tenant t1  R1  A (64 tokens)            nothing cached               computed 64
  tenant t1  R2  A + B (96 tokens)        A's 4 blocks in GPU          cached 64 (gpu), computed 32
  tenant t2  R3  C (384 tokens)           nothing                      computed 384
  tenant t2  R4  D (384 tokens)           nothing; D's 25 blocks evict A and B from the GPU (LRU)
  tenant t1  R5  A + E (80 tokens)        A's 4 blocks in the CPU tier cached 64 (cpu), computed 16

Each request generates 4 tokens. t1: prompt 240 = 128 cached (64 gpu + 64 cpu) + 112 computed,
output 12. t2: prompt 768, all computed, output 8. The picker predicted exactly what the replica
reported, so the prediction error is 0.

Prices per 1000 tokens: input 2.0, cached gpu 0.5 / cpu 1.0 / disk 1.5, output 8.0.
  t1 input  = 112 x 2.0 + 64 x 0.5 + 64 x 1.0 = 224 + 32 + 64 = 320 -> 0.320; without cache 240 x 2.0 -> 0.480;
     saved 0.160; output 12 x 8.0 -> 0.096.
  t2 input  = 768 x 2.0 -> 1.536; saved 0; output 8 x 8.0 -> 0.064.
  total: input 1.856, output 0.160, spent 2.016, saved 0.160, without cache 2.016 (prompt 1008 x 2.0).
"""

from __future__ import annotations

import json
import subprocess
import sys

import aiohttp
import pytest

from epp.config.compose import endpoint_picker_config, plugin
from epp.engine.sim import FleetConfig, SimFleet
from epp.envoy import EnvoyProcess, render_config
from epp.kvevents.decoding import Tier
from tests.support.ports import free_port
from tests.support.precise import Picker, fleet_specs
from tests.support.wait import wait_until

pytestmark = [pytest.mark.envoy, pytest.mark.timeout(60)]

MODEL = "sim-model"
CONFIG = endpoint_picker_config([plugin("precise-prefix-cache-producer", blockSizeTokens=16), "prefix-cache-scorer"],
                                ["prefix-cache-scorer"])
PRICES = """
unit_tokens: 1000
currency: USD
default: {input: 2.0, cached: {gpu: 0.5, cpu: 1.0, disk: 1.5}, output: 8.0}
"""

A = list(range(100, 164))
B = list(range(200, 232))
C = list(range(1000, 1384))
D = list(range(2000, 2384))
E = list(range(300, 316))


def sample(picker: Picker, name: str, **labels: str) -> float:
    return picker.metric(name, {"model": MODEL, **labels})


async def test_counters_and_cost_report_on_a_known_workload(tmp_path):
    fleet_config = FleetConfig(replicas=1, model=MODEL, block_size=16, num_gpu_blocks=32, cpu_blocks=256)
    async with SimFleet(fleet_config) as fleet, aiohttp.ClientSession() as http:
        [replica] = fleet.endpoints
        picker = await Picker.start(CONFIG, fleet_specs(fleet.info))
        listen, admin = free_port(), free_port()
        envoy = EnvoyProcess(render_config(listen_port=listen, admin_port=admin, epp_port=picker.server.grpc_port),
                             admin)
        await envoy.start()
        url = f"http://127.0.0.1:{listen}/v1/completions"
        metrics_url = f"http://127.0.0.1:{picker.server.metrics_port}/metrics"

        async def send(tenant: str, prompt: list[int]) -> dict:
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 4}
            async with http.post(url, json=body, headers={"x-gateway-inference-fairness-id": tenant}) as resp:
                assert resp.status == 200, await resp.text()
                return (await resp.json())["usage"]

        async def tiers_of(prompt: list[int]) -> list:
            producer = picker.producer
            keys = producer.index.keyer.request_keys(prompt, MODEL, None)
            return list(producer.index.lookup(keys, [replica]).get(replica, ()))

        try:
            async with http.get(metrics_url) as resp:
                (tmp_path / "before.txt").write_text(await resp.text())
            assert (await send("t1", A))["prompt_tokens_details"]["cached_tokens"] == 0
            async def a_in_gpu() -> bool:
                return await tiers_of(A) == [Tier.GPU] * 4
            await wait_until(a_in_gpu, "A's blocks in the picker's index", 5)
            assert (await send("t1", A + B))["prompt_tokens_details"]["cached_tokens"] == 64
            await send("t2", C)
            await send("t2", D)
            async def a_in_cpu() -> bool:
                return await tiers_of(A) == [Tier.CPU] * 4
            await wait_until(a_in_cpu, "A evicted from the GPU and held in the CPU tier", 5)
            assert (await send("t1", A + E))["prompt_tokens_details"]["cached_tokens"] == 64
            await wait_until(lambda: sample(picker, "epp_accounted_requests_total", tenant="t1", usage="details") == 3,
                             "the last request to be accounted", 5)
            async with http.get(metrics_url) as resp:
                (tmp_path / "after.txt").write_text(await resp.text())
        finally:
            await envoy.stop()
            await picker.stop()

    # The counters, as worked out in the module docstring.
    reported = {(t, k): sample(picker, "epp_prompt_tokens_reported_total", tenant=t, kind=k)
                for t in ("t1", "t2") for k in ("cached", "computed")}
    assert reported == {("t1", "cached"): 128, ("t1", "computed"): 112, ("t2", "cached"): 0, ("t2", "computed"): 768}
    predicted = {tier: sample(picker, "epp_prompt_tokens_predicted_total", tenant="t1", tier=tier)
                 for tier in ("gpu", "cpu", "disk", "computed")}
    assert predicted == {"gpu": 64, "cpu": 64, "disk": 0, "computed": 112}
    assert sample(picker, "epp_prompt_tokens_predicted_total", tenant="t2", tier="computed") == 768
    assert sample(picker, "epp_output_tokens_total", tenant="t1") == 12
    assert sample(picker, "epp_output_tokens_total", tenant="t2") == 8
    for direction in ("over", "under"):
        assert sample(picker, "epp_cached_tokens_prediction_error_total", tenant="t1", direction=direction) == 0

    # `epp cost` over the window between the two scrapes.
    (tmp_path / "prices.yaml").write_text(PRICES)
    out = subprocess.run([sys.executable, "-m", "epp.cli", "cost", "--prices", str(tmp_path / "prices.yaml"),
                          "--before", str(tmp_path / "before.txt"), "--after", str(tmp_path / "after.txt"),
                          "--by-tenant", "--json"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    lines = {ln["tenant"]: ln for ln in report["lines"]}
    t1, t2, total = lines["t1"], lines["t2"], report["total"]
    assert t1["cached_by_tier"] == {"gpu": 64, "cpu": 64, "disk": 0}
    assert t1["input_cost"] == pytest.approx(0.320)
    assert t1["uncached_input_cost"] == pytest.approx(0.480)
    assert t1["saved"] == pytest.approx(0.160)
    assert t1["output_cost"] == pytest.approx(0.096)
    assert t1["hit_rate"] == pytest.approx(128 / 240)
    assert t2["input_cost"] == pytest.approx(1.536) and t2["saved"] == 0
    assert t2["output_cost"] == pytest.approx(0.064)
    assert total["input_cost"] == pytest.approx(1.856)
    assert total["input_cost"] + total["output_cost"] == pytest.approx(2.016)
    assert total["saved"] == pytest.approx(0.160)
    # The same window as a table: the spent / saved line a person reads.
    table = subprocess.run([sys.executable, "-m", "epp.cli", "cost", "--prices", str(tmp_path / "prices.yaml"),
                            "--before", str(tmp_path / "before.txt"), "--after", str(tmp_path / "after.txt")],
                           capture_output=True, text=True, timeout=30)
    assert table.returncode == 0, table.stderr
    assert "spent 2.0160 USD (input 1.8560, output 0.1600); caching saved 0.1600 USD" in table.stdout
