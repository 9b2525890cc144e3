"""Everything that defines one simulated replica (read by its server and its P/D part)."""

from __future__ import annotations

from dataclasses import dataclass, field

from epp.engine.sim.engine import EngineConfig


@dataclass
class ReplicaConfig:
    """Everything that defines one simulated replica."""

    name: str = "sim-0"
    model: str = "sim-model"
    tokenizer_dir: str | None = None
    host: str = "127.0.0.1"
    port: int = 0
    engine: EngineConfig = field(default_factory=EngineConfig)
    kv_events: bool = True
    kv_events_endpoint: str | None = None
    kv_replay_endpoint: str | None = None
    kv_replay: bool = True
    kv_events_bind: bool | None = None
    kv_topic: str | None = None
    legacy_array_events: bool = False
    lora_modules: dict[str, str] = field(default_factory=dict)
    max_loras: int = 4
    chat_output_len: tuple[int, int] = (16, 128)
    enable_prompt_tokens_details: bool = False  # vLLM's --enable-prompt-tokens-details (off by default)
    enable_scale_out: bool = False  # vLLM's --enable-scale-out: /v1/completions/render etc. (off: 403)
    labels: dict[str, str] = field(default_factory=dict)
    # P/D: simulated seconds a finished prefill keeps its KV for the decoder (vLLM NIXL: minutes).
    kv_transfer_window: float = 30.0
    # OpenAI Responses kept for `previous_response_id`, the least recently used dropped past this.
    max_stored_responses: int = 4096
    # Fault injection: `/wake_up` answers 500 with this message and the engine stays asleep.
    wake_error: str | None = None
