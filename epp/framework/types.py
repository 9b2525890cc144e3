"""Immutable data the scheduler works on: endpoints with their metrics, and parsed requests."""

from __future__ import annotations

import enum
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

_EMPTY: Mapping[str, str] = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class EndpointMetrics:
    """One scrape of a model server's `/metrics`; `update_time` is `time.monotonic()` (0 = never)."""

    waiting_queue_size: int = 0
    running_requests_size: int = 0
    kv_cache_usage: float = 0.0
    active_models: frozenset[str] = frozenset()
    waiting_models: frozenset[str] = frozenset()
    max_active_models: int = 0
    cache_block_size: int = 0
    cache_num_blocks: int = 0
    update_time: float = 0.0
    # Cumulative prompt tokens looked up in / served from vLLM's prefix cache (counters).
    prefix_cache_queries: float = 0.0
    prefix_cache_hits: float = 0.0
    # vLLM sleep mode: the engine holds requests without serving them until woken (`/wake_up`).
    sleeping: bool = False
    # KV blocks of the CPU offload tier (`cache_config_info`'s num_cpu_blocks; 0: none or not said).
    cache_num_cpu_blocks: int = 0

    def age(self, now: float | None = None) -> float:
        """Seconds since these metrics were scraped (`time.monotonic()` clock); infinite if never."""
        if self.update_time <= 0.0:
            return float("inf")
        return (time.monotonic() if now is None else now) - self.update_time

    def is_stale(self, threshold: float, now: float | None = None) -> bool:
        """True when the metrics were never scraped or are older than `threshold` seconds."""
        return self.age(now) > threshold


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One model-server endpoint (`ip:port`) of the pool, with its latest metrics snapshot."""

    address: str
    port: int
    labels: Mapping[str, str] = field(default_factory=lambda: _EMPTY)
    metrics: EndpointMetrics = field(default_factory=EndpointMetrics)
    metrics_port: int | None = None
    healthy: bool = True
    # `ip:port`, computed once: scorers read `name` for every endpoint of every request.
    _hostport: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        host = f"[{self.address}]" if ":" in self.address else self.address
        object.__setattr__(self, "_hostport", f"{host}:{self.port}")

    @property
    def hostport(self) -> str:
        """`ip:port`, with IPv6 addresses bracketed, as Envoy expects it."""
        return self._hostport

    @property
    def name(self) -> str:
        """Stable identity of the endpoint inside the picker (its `ip:port`)."""
        return self._hostport

    @property
    def metrics_hostport(self) -> str:
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"{host}:{self.metrics_port or self.port}"


class ApiKind(enum.Enum):
    """The API a request uses, chosen from the request path."""

    COMPLETIONS = "completions"
    CHAT_COMPLETIONS = "chat/completions"
    RESPONSES = "responses"
    CONVERSATIONS = "conversations"
    EMBEDDINGS = "embeddings"
    # Anthropic's Messages API (`/v1/messages`): `system`, then `messages` of content blocks.
    MESSAGES = "messages"
    # vLLM's rerank API (`/rerank`, `/v1/rerank`, `/v2/rerank`): a `query` and its `documents`.
    RERANK = "rerank"
    # A path no parser reads: the body is passed on unread, to an endpoint chosen without its prompt.
    PASSTHROUGH = "passthrough"


@dataclass(frozen=True, slots=True)
class InferenceRequest:
    """A parsed inference request. `body` is the (possibly model-rewritten) JSON object."""

    request_id: str
    api: ApiKind
    model: str
    target_model: str
    body: Mapping[str, Any]
    headers: Mapping[str, str] = field(default_factory=lambda: _EMPTY)
    stream: bool = False
    cache_salt: str | None = None
    priority: int = 0
    objective: str | None = None
    fairness_id: str = "default-flow"
    subset_hint: tuple[str, ...] | None = None
    path: str = "/v1/completions"
    # Latency objectives of this request in milliseconds (`x-llm-d-slo-ttft-ms`, `-tpot-ms`), if any.
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    # Characters of the prompt text as `epp.framework.load.prompt_characters` counts them, when the
    # parser measured them already (None: counted on demand); read by every plugin that needs them.
    prompt_chars: int | None = None
    # The conversation or agent session the body names, as its API spells it (OpenAI's
    # `prompt_cache_key`, else `user`; Anthropic's `metadata.user_id`), if any. Session headers are
    # read by the session plugins, which combine them with this.
    body_session: str | None = None

    @property
    def prompt(self) -> Any:
        """Completions prompt: a string, a list of strings, token ids, or lists of token ids."""
        return self.body.get("prompt")

    @property
    def messages(self) -> list[Any] | None:
        """Chat messages, when the API is chat completions."""
        value = self.body.get("messages")
        return value if isinstance(value, list) else None


@dataclass(slots=True)
class ResponseInfo:
    """What the picker sees of a response; hooks may add headers to `set_headers`."""

    status: str = ""
    headers: dict[str, str] = field(default_factory=dict)
    served_endpoint: str | None = None
    streaming: bool = False
    usage: dict[str, Any] | None = None
    end_of_stream: bool = False
    set_headers: dict[str, str] = field(default_factory=dict)
