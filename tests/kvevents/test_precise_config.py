"""The precise producer and the predicted-TTFT scorer configured through an EndpointPickerConfig."""

from __future__ import annotations

from epp.config.compose import endpoint_picker_config, plugin
from epp.framework.types import Endpoint, InferenceRequest
from epp.kvevents.decoding import decode_batch
from tests.kvevents import wire
from tests.support.requests import format_of
from tests.support.scheduling import DirectorHarness


def config(cpu_weight: float) -> str:
    """Precise prefix producer (tiers GPU 1, CPU `cpu_weight`, disk 0.2), prefix scorer 2, predicted TTFT 0."""
    producer = plugin("precise-prefix-cache-producer", blockSizeTokens=4, subscribe=False,
                      tierWeights={"gpu": 1.0, "cpu": cpu_weight, "disk": 0.2}, speculativeTTL="500ms")
    return endpoint_picker_config(
        [producer, "prefix-cache-scorer", plugin("predicted-ttft-scorer", prefillSecondsPerToken=0.001),
         "max-score-picker"],
        {"prefix-cache-scorer": 2, "predicted-ttft-scorer": 0, "max-score-picker": None})


async def pick(cpu_weight: float) -> str:
    picker = DirectorHarness(config(cpu_weight))
    producer = picker.loaded.plugin("precise-prefix-cache-producer")
    a, b = Endpoint("10.0.0.1", 8000), Endpoint("10.0.0.2", 8000)
    tokens = list(range(32))
    producer.index.apply_batch(a.name, decode_batch(wire.encode_batch([wire.stored([1, 2], tokens[:8])])), "m")
    producer.index.apply_batch(b.name, decode_batch(wire.encode_batch(
        [wire.stored([1, 2, 3, 4], tokens[:16], medium="CPU")])), "m")
    result, _ = await picker.cycle(InferenceRequest("r", "completions", "m", "m", {"prompt": tokens}, format=format_of("completions")), [a, b])
    return result.targets[0].name


async def test_cpu_tier_weight_in_the_config_decides_between_gpu_short_and_cpu_long_prefixes():
    assert await pick(0.8) == "10.0.0.2:8000"  # 4 CPU blocks x 0.8 > 2 GPU blocks
    assert await pick(0.3) == "10.0.0.1:8000"  # 4 x 0.3 < 2
