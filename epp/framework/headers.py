"""Request headers with a meaning between the picker, its plugins and the model-server side."""

from __future__ import annotations

# `ip:port` of the prefill endpoint chosen for a disaggregated request (llm-d's name). The decode
# pod's sidecar sends the prefill there, so only the picker may set it: a client's copy is removed.
PREFILLER_HOST_PORT_HEADER = "x-prefiller-host-port"
