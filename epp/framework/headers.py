"""Request headers with a meaning between the picker, its plugins and the model-server side.

Control headers carry llm-d's names (`x-llm-d-*`); the older GIE names (`x-gateway-*`, `x-slo-*`)
stay accepted as aliases, and where a request sends both, the new name wins (as llm-d reads them).
"""

from __future__ import annotations

from collections.abc import Mapping

# `ip:port` of the prefill endpoint chosen for a disaggregated request (llm-d's name). The decode
# pod's sidecar sends the prefill there, so only the picker may set it: a client's copy is removed.
PREFILLER_HOST_PORT_HEADER = "x-prefiller-host-port"
# Comma-separated `ip:port` of the encode endpoints chosen for a multimodal request's encode stage (E/PD):
# the decode pod's sidecar sends each multimodal item there first. Only the picker may set it.
ENCODER_HOSTS_PORTS_HEADER = "x-encoder-hosts-ports"
# `ip:port` of a peer holding more of the prompt's KV cache than the computing endpoint: its sidecar
# asks the engine to pull those blocks over the P2P connector instead of recomputing. Only the picker may set it.
KV_CACHE_SOURCE_HEADER = "x-kv-cache-source-host-port"
# The port of that peer's P2P KV connector (ours, sent with the hint when p2p-source-producer has
# `p2pPortBase`): the sidecar pulls from there instead of its own `--p2p-connector-port`. Picker-owned.
KV_CACHE_SOURCE_P2P_PORT_HEADER = "x-kv-cache-source-p2p-port"

# Each control header: its current name first, then the aliases still accepted.
OBJECTIVE_HEADERS = ("x-llm-d-inference-objective", "x-gateway-inference-objective")
FAIRNESS_ID_HEADERS = ("x-llm-d-inference-fairness-id", "x-gateway-inference-fairness-id")
MODEL_REWRITE_HEADERS = ("x-llm-d-model-name-rewrite", "x-gateway-model-name-rewrite")
SLO_TTFT_MS_HEADERS = ("x-llm-d-slo-ttft-ms", "x-slo-ttft-ms")
SLO_TPOT_MS_HEADERS = ("x-llm-d-slo-tpot-ms", "x-slo-tpot-ms")


def header_value(headers: Mapping[str, str], names: tuple[str, ...]) -> str | None:
    """The first non-empty value among `names` (a header's current name, then its aliases), else None."""
    for name in names:
        value = headers.get(name)
        if value:
            return value
    return None
