"""llm-d's optimized-baseline pipeline as a contender: a config file of ours, loaded by our loader, unmodified in
meaning, and reported unavailable with the loader's reason while a plugin type it needs is not registered."""

from __future__ import annotations

import asyncio

import pytest
import yaml

from bench.routing.contenders import (
    CONTENDERS,
    LLMD_CONFIGS,
    Tuning,
    Unavailable,
    calibrate_peak_prefill,
    check_loads,
    llmd_config,
    missing_plugin_types,
)
from bench.routing.real_vllm import DEFAULT_CONTENDERS
from epp.config import load_config_text
from epp.engine.sim.fleet import FleetConfig, SimFleet, default_tokenizer_dir

TUNING = Tuning(tokenizer_dir=default_tokenizer_dir(), block_size=16, prefill_s_per_token=0.0, mean_prompt_tokens=0,
                max_model_len=8192, chunk_tokens=2048)


def test_the_guide_pipeline_is_ours_to_read_and_holds_the_guides_values():
    doc = yaml.safe_load((LLMD_CONFIGS / "llmd-optimized-baseline.yaml").read_text())
    assert doc["apiVersion"] == "llm-d.ai/v1alpha1" and doc["kind"] == "EndpointPickerConfig"
    plugins = {p["type"]: p.get("parameters", {}) for p in doc["plugins"]}
    assert set(plugins) == {"token-load-scorer", "inflight-load-producer", "approx-prefix-cache-producer",
                            "prefix-cache-affinity-filter"}
    assert plugins["prefix-cache-affinity-filter"] == {"affinityThreshold": 0.8, "maxTokensInFlightPenalty": 286720,
                                                       "maxTTFTPenaltyMs": 0}
    [profile] = doc["schedulingProfiles"]
    assert [p["pluginRef"] for p in profile["plugins"]] == ["prefix-cache-affinity-filter", "token-load-scorer"]
    # In every comparison: the simulated workloads and the trace (`all`) and real vLLM-CPU.
    assert CONTENDERS["llmd-optimized-baseline"].default
    assert "llmd-optimized-baseline" in DEFAULT_CONTENDERS


def test_what_an_operator_sets_for_the_fleet_is_set_the_same_way():
    doc = yaml.safe_load(llmd_config("llmd-optimized-baseline", TUNING, peak_prefill_tokens_per_s=6000.0))
    params = {p["type"]: p.get("parameters", {}) for p in doc["plugins"]}
    assert params["approx-prefix-cache-producer"]["maxPrefixTokensToMatch"] == 8192  # the engines' max-model-len
    # The guide's gate is 18 s of its fleet's peak prefill; here 18 s of this fleet's.
    assert params["prefix-cache-affinity-filter"]["maxTokensInFlightPenalty"] == int(286720 / 15928 * 6000)
    assert params["prefix-cache-affinity-filter"]["affinityThreshold"] == 0.8


def test_it_loads_through_our_loader_or_is_unavailable_with_the_loaders_reason():
    config = llmd_config("llmd-optimized-baseline", TUNING)
    missing = missing_plugin_types(config)
    if missing:
        # Until the llm-d plugins are registered: the harness reports the contender unavailable, with why.
        with pytest.raises(Unavailable, match=f"our loader refuses llmd.*{missing[0]}"):
            check_loads(config, "llmd-optimized-baseline")
    else:
        # Once they are: it loads as written, the affinity filter before the token-load scorer.
        check_loads(config, "llmd-optimized-baseline")
        loaded = load_config_text(config, source="llmd-optimized-baseline")
        assert {e.type_name for e in loaded.plugins} >= {"prefix-cache-affinity-filter", "token-load-scorer"}


def test_the_peak_prefill_is_calibrated_on_the_fleet_as_the_guides_job_does():
    async def go() -> float:
        fleet = SimFleet(FleetConfig(replicas=1, profile="fast", processes=0, num_gpu_blocks=2048))
        await fleet.start()
        try:
            return await calibrate_peak_prefill(fleet.endpoints[0], TUNING, samples=2)
        finally:
            await fleet.stop()

    tokens_per_s = asyncio.run(go())
    assert tokens_per_s > 1000  # the fast profile prefills far faster than that; the HTTP path bounds it
