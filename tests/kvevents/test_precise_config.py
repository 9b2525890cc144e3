"""The precise producer and the predicted-TTFT scorer configured through EndpointPickerConfig YAML."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from epp.config.loader import load_config_text
from epp.framework.plugin import CycleState, PluginContext
from epp.framework.registry import PluginRegistry
from epp.framework.types import ApiKind, Endpoint, InferenceRequest
from epp.kvevents import producer as precise_prefix
from epp.kvevents.decoding import decode_batch
from epp.scorers import predicted_ttft, register_builtin_plugins
from tests.kvevents import wire

CONFIG = """
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
  - type: precise-prefix-cache-producer
    parameters:
      blockSizeTokens: 4
      subscribe: false
      tierWeights: {gpu: 1.0, cpu: %(cpu)s, disk: 0.2}
      speculativeTTL: 500ms
  - type: prefix-cache-scorer
  - type: predicted-ttft-scorer
    parameters:
      prefillSecondsPerToken: 0.001
  - type: max-score-picker
schedulingProfiles:
  - name: default
    plugins:
      - pluginRef: prefix-cache-scorer
        weight: 2
      - pluginRef: predicted-ttft-scorer
        weight: 0
      - pluginRef: max-score-picker
"""


def registry() -> PluginRegistry:
    reg = PluginRegistry()
    register_builtin_plugins(reg)
    for module in (precise_prefix, predicted_ttft):  # until the built-in list names them
        try:
            module.register(reg)
        except ValueError:
            pass
    return reg


async def pick(cpu_weight: float) -> str:
    loaded = load_config_text(CONFIG % {"cpu": cpu_weight}, registry=registry(),
                              context=PluginContext(metrics_registry=CollectorRegistry()))
    producer = loaded.plugin("precise-prefix-cache-producer")
    a, b = Endpoint("10.0.0.1", 8000), Endpoint("10.0.0.2", 8000)
    tokens = list(range(32))
    producer.index.apply_batch(a.name, decode_batch(wire.encode_batch([wire.stored([1, 2], tokens[:8])])), "m")
    producer.index.apply_batch(b.name, decode_batch(wire.encode_batch(
        [wire.stored([1, 2, 3, 4], tokens[:16], medium="CPU")])), "m")
    request = InferenceRequest("r", ApiKind.COMPLETIONS, "m", "m", {"prompt": tokens})
    state = CycleState()
    for data_producer in loaded.data_producers:
        await data_producer.prepare(state, request, [a, b])
    return loaded.scheduler.schedule(state, request, [a, b]).targets[0].name


async def test_cpu_tier_weight_in_the_config_decides_between_gpu_short_and_cpu_long_prefixes():
    assert await pick(0.8) == "10.0.0.2:8000"  # 4 CPU blocks x 0.8 > 2 GPU blocks
    assert await pick(0.3) == "10.0.0.1:8000"  # 4 x 0.3 < 2
