"""Several named producers of one data key: llm-d's tiered prefix cache (a GPU-tier and a CPU-tier
approximate prefix index, each read by its own prefix-cache-scorer), loaded from our config of the guide
(tests/fixtures/llmd/tiered-prefix-cache-cpu.yaml)."""

from __future__ import annotations

from pathlib import Path

import pytest

from epp.config import load_config, load_config_text
from epp.config.describe import describe
from epp.framework import (
    PREFIX_MATCH_INFO,
    ConfigError,
    CycleState,
    DataProducer,
    PluginRegistry,
)
from epp.framework.registry import default_registry
from tests.support.scheduling import DirectorHarness, endpoint, request

TIERED = Path(__file__).resolve().parents[1] / "fixtures" / "llmd" / "tiered-prefix-cache-cpu.yaml"
# Each endpoint's GPU cache: 64 blocks of 16 tokens, which the GPU-tier index sizes itself to (autoTune).
EPS = [endpoint(i, block_size=16, num_blocks=64) for i in range(3)]
HEAD = "v1alpha1\nkind: EndpointPickerConfig\n"


def prompt(seed: int) -> str:
    """About 30 hash blocks of distinct text."""
    return " ".join(f"doc{seed}-word{i}" for i in range(170))


def test_each_named_producer_writes_under_its_own_name_and_no_hit_lru_reads_the_default():
    loaded = load_config(TIERED)
    names = [p.name for p in loaded.data_producers]
    assert names == ["gpu-prefix-cache-producer", "cpu-prefix-cache-producer", "approx-prefix-cache-producer"]
    gpu, cpu, default = (loaded.plugin(n) for n in names)
    assert gpu.output_key(PREFIX_MATCH_INFO) == f"{PREFIX_MATCH_INFO}/gpu-prefix-cache-producer"
    assert cpu.output_key(PREFIX_MATCH_INFO) == f"{PREFIX_MATCH_INFO}/cpu-prefix-cache-producer"
    assert default.output_key(PREFIX_MATCH_INFO) == PREFIX_MATCH_INFO  # llm-d auto-creates it too
    assert loaded.plugin("gpu-prefix-cache-scorer").source.read_key == gpu.output_key(PREFIX_MATCH_INFO)
    assert loaded.plugin("cpu-prefix-cache-scorer").source.read_key == cpu.output_key(PREFIX_MATCH_INFO)
    assert loaded.plugin("no-hit-lru-scorer").source.read_key == PREFIX_MATCH_INFO
    assert (cpu.auto_tune, cpu.lru_capacity_per_server) == (False, 4_000_000)
    assert "default producer of 'prefix-cache-match-info' for 'no-hit-lru-scorer'" in describe(loaded)


async def test_the_cpu_tier_remembers_a_prefix_the_gpu_tier_forgot():
    harness = DirectorHarness(TIERED.read_text())
    await harness.cycle(request(prompt(0) + " first turn"), EPS[:1])
    for seed in range(1, 6):  # 150 more blocks through endpoint 0: its 64-block GPU tier forgets prompt 0
        await harness.cycle(request(prompt(seed)), EPS[:1])
    result, state = await harness.pick(request(prompt(0) + " second turn"), EPS)
    gpu = harness.loaded.plugin("gpu-prefix-cache-scorer").score(state, request(), EPS)
    cpu = harness.loaded.plugin("cpu-prefix-cache-scorer").score(state, request(), EPS)
    assert set(gpu.values()) == {0.0}
    assert cpu[EPS[0].name] > 0.9 and cpu[EPS[1].name] == cpu[EPS[2].name] == 0.0
    assert result.targets[0].name == EPS[0].name


def test_a_lone_named_producer_serves_every_consumer():
    text = HEAD.join(["apiVersion: llm-d.ai/", "plugins:\n- type: approx-prefix-cache-producer\n  name: mine\n"
                      "- type: prefix-cache-scorer\n"])
    loaded = load_config_text(text)
    assert [p.name for p in loaded.data_producers] == ["mine"]
    assert loaded.plugin("mine").output_key(PREFIX_MATCH_INFO) == PREFIX_MATCH_INFO


def test_a_producer_that_names_its_source_runs_after_it_whatever_the_config_order():
    text = HEAD.join(["apiVersion: llm-d.ai/", "plugins:\n"
                      "- type: inflight-load-producer\n  parameters: {prefixMatchInfoProducerName: cpu}\n"
                      "- type: token-load-scorer\n"
                      "- type: approx-prefix-cache-producer\n  name: gpu\n"
                      "- type: approx-prefix-cache-producer\n  name: cpu\n"])
    loaded = load_config_text(text)
    order = [p.name for p in loaded.data_producers]
    assert order.index("cpu") < order.index("inflight-load-producer")
    assert loaded.plugin("inflight-load-producer").prefix.read_key == f"{PREFIX_MATCH_INFO}/cpu"


class _OwnKeyProducer(DataProducer):
    """A producer of the prefix key that cannot write it under another name."""

    type_name = "own-key-producer"

    def produces(self) -> frozenset[str]:
        return frozenset({PREFIX_MATCH_INFO})

    async def prepare(self, state: CycleState, request, endpoints) -> None:
        return None


def test_producers_that_cannot_share_a_key_are_refused_two_at_a_time():
    registry = PluginRegistry()
    for type_name in default_registry().types():
        registry.register(default_registry().get(type_name))
    registry.register_class(_OwnKeyProducer)
    one = "plugins:\n- type: own-key-producer\n- type: approx-prefix-cache-producer\n  name: b\n"
    loaded = load_config_text(HEAD.join(["apiVersion: llm-d.ai/", one]), registry=registry)
    assert loaded.plugin("b").output_key(PREFIX_MATCH_INFO) == f"{PREFIX_MATCH_INFO}/b"
    two = "plugins:\n- type: own-key-producer\n- type: own-key-producer\n  name: b\n"
    with pytest.raises(ConfigError, match="data key 'prefix-cache-match-info' is produced by both 'own-key-producer' "
                                          "and 'b'; allowed: one producer per key"):
        load_config_text(HEAD.join(["apiVersion: llm-d.ai/", two]), registry=registry)
