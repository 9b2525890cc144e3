"""Data keys that producers publish in `CycleState`, each typed by the values stored under it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

from epp.framework.types import MediaItem

T = TypeVar("T")


class DataKey(str, Generic[T]):
    """A `CycleState` data key: a plain string (configs and `produces()` name it), typed by its values.

    Reads are typed: `state.endpoint_data(PREFIX_MATCH_INFO, name)` is a `PrefixMatchInfo | None`
    to a type checker, `state.all_endpoint_data(INFLIGHT_LOAD)` a `Mapping[str, InflightLoad]`.
    """

    __slots__ = ()




@dataclass(frozen=True, slots=True)
class PrefixMatchInfo:
    """How much of the request's prefix an endpoint holds, in blocks (matched may be tier-weighted)."""

    matched_blocks: float
    total_blocks: int
    block_size_tokens: int

    @property
    def fraction(self) -> float:
        return self.matched_blocks / self.total_blocks if self.total_blocks > 0 else 0.0


@dataclass(frozen=True, slots=True)
class TierMatch:
    """Prompt tokens found cached on an endpoint, consecutive from the start, by best tier."""

    gpu_tokens: int
    cpu_tokens: int
    disk_tokens: int
    total_tokens: int

    @property
    def cached_tokens(self) -> int:
        return self.gpu_tokens + self.cpu_tokens + self.disk_tokens


@dataclass(frozen=True, slots=True)
class InflightLoad:
    """Requests and estimated tokens the picker has sent to an endpoint and not seen finish."""

    requests: int
    tokens: int
    # What this request would add on the endpoint (its uncached prompt tokens; llm-d's UncachedRequestTokens).
    request_tokens: int = 0


@dataclass(frozen=True, slots=True)
class PromptTokens:
    """The prompt's token ids; `exact` when they are the engine's own (its renderer or tokenizer), not estimated."""

    token_ids: tuple[int, ...]
    exact: bool
    # The media items with the placeholder tokens each takes in `token_ids` and the engine's identifier of it
    # (`token_offset`, `engine_hash`), when the renderer said; the precise prefix keys hash them in.
    media: tuple[MediaItem, ...] = ()


@dataclass(frozen=True, slots=True)
class SessionKey:
    """The agent session (conversation, program) a request belongs to, and the session that spawned it, if named."""

    session: str
    # A sub-agent's parent session (from an operator-configured header), else None.
    parent: str | None = None
    # Where the key was read: a header name, or a body field such as `prompt_cache_key`.
    source: str = ""


# Per endpoint. Written by approx-prefix-cache-producer or precise-prefix-cache-producer.
PREFIX_MATCH_INFO: DataKey[PrefixMatchInfo] = DataKey("prefix-cache-match-info")
# Per endpoint. Written by precise-prefix-cache-producer only.
PREFIX_TIER_MATCH: DataKey[TierMatch] = DataKey("prefix-cache-tier-match")
# Per endpoint: the blocks of its prefix cache its index believes hold no prefix yet (its
# capacity less the blocks indexed on it; absent when the capacity is unknown), in blocks of the
# model server's block size. Written by the prefix producers; max-score-picker breaks ties with it,
# predicted-ttft-scorer counts what a pick would evict beyond it.
PREFIX_CACHE_FREE_BLOCKS: DataKey[int] = DataKey("prefix-cache-free-blocks")
# Per endpoint. Written by inflight-load-producer.
INFLIGHT_LOAD: DataKey[InflightLoad] = DataKey("inflight-load")
# Request-wide (`CycleState.put`/`get` under this key). Written by token-producer.
PROMPT_TOKENS: DataKey[PromptTokens] = DataKey("prompt-tokens")
# Per endpoint: 1.0 on the rendezvous home of a prefix no endpoint holds (see epp.framework.rendezvous).
# Written by the prefix producers when several pickers route one pool.
PREFIX_HOME: DataKey[float] = DataKey("prefix-home")
# Request-wide (`CycleState.put`/`get` under this key). Written by the session producers (agent-identity).
SESSION: DataKey[SessionKey] = DataKey("session")
