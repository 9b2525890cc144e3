"""llm-d's multimodal embeddings cache affinity: `mm-embeddings-cache-producer` and `mm-embeddings-cache-scorer`.

A model server keeps the encoder's output (the embeddings of an image, a video, an audio clip) for
a while; a request that brings the same item again is served without encoding it again where the
item was encoded before. The producer remembers, per endpoint, the items of the requests sent there
(an LRU of `cacheSizeInMBPerServer` / 2 MiB entries, as llm-d sizes it: 2048 for the default
4096); before scheduling it publishes, for every candidate, which of the request's items it is
likely to hold (`ENCODER_CACHE_MATCH`). The scorer scores `matched items / request items` (0 with no
media). An item counts once per request.

An item is identified by its content as the request's parser reads it (`request.media()`: the
digest of an image, video or audio part of an OpenAI chat or Responses body, an Anthropic image
block, a vLLM `generate` request's features...); llm-d reads the renderer's own multimodal hashes
when a token-producer gives them, else the same typed media blocks. An endpoint that leaves the
pool is forgotten at once.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram

from epp.framework import (
    CycleState,
    DataKey,
    DataProducer,
    Endpoint,
    InferenceRequest,
    PluginContext,
    PluginParams,
    PluginRegistry,
    PreRequestHook,
    SchedulingResult,
    Scorer,
    once_per_registry,
)

DEFAULT_CACHE_SIZE_MB = 4096
MB_PER_ITEM = 2  # llm-d's fixed assumption: one tracked item stands for 2 MiB of encoder cache


@dataclass(frozen=True, slots=True)
class EncoderCacheMatch:
    """Which of the request's multimodal items an endpoint is likely to hold (sizes: 1 per item)."""

    matched: int
    total: int

    @property
    def fraction(self) -> float:
        return self.matched / self.total if self.total else 0.0


ENCODER_CACHE_MATCH: DataKey[EncoderCacheMatch] = DataKey("encoder-cache-match-info")


# The modalities a model server encodes (a file or document is read as text, not encoded).
ENCODED_MODALITIES = frozenset({"image", "video", "audio"})


def media_items(request: InferenceRequest) -> dict[str, str]:
    """digest -> modality of every image, video and audio item of the request's prompt, as its parser finds them."""
    return {item.digest: item.modality for item in request.media() if item.modality in ENCODED_MODALITIES}


@dataclass
class _Metrics:
    queries: Counter
    hits: Counter
    ratio: Histogram


def _metrics(registry: CollectorRegistry | None) -> _Metrics:
    return _Metrics(
        Counter("epp_encoder_cache_queries", "Multimodal item lookups of mm-embeddings-cache-producer",
                ["plugin", "modality"], registry=registry),
        Counter("epp_encoder_cache_hits", "Lookups that found the item remembered on some endpoint",
                ["plugin", "modality"], registry=registry),
        Histogram("epp_encoder_cache_hit_ratio", "Matched over total multimodal items, per endpoint and request",
                  ["plugin"], buckets=(0.0, 0.25, 0.5, 0.75, 1.0), registry=registry))


class MMEmbeddingsCacheProducer(DataProducer, PreRequestHook):
    """Per endpoint, the multimodal items of the requests sent there (LRU); each candidate's match."""

    type_name = "mm-embeddings-cache-producer"

    def __init__(self, name: str, params: PluginParams, context: PluginContext) -> None:
        super().__init__(name)
        size_mb = params.int("cacheSizeInMBPerServer", 0)
        if size_mb <= 0:  # llm-d: unset or <= 0 is the default
            size_mb = DEFAULT_CACHE_SIZE_MB
        self.size_mb = size_mb
        self.capacity = max(1, size_mb // MB_PER_ITEM)
        self._caches: dict[str, OrderedDict[str, None]] = {}
        self.metrics = once_per_registry(context.metrics_registry, "epp_encoder_cache", _metrics)
        if context.endpoints is not None:
            context.endpoints.add_listener(self._on_endpoints_changed)

    def describe(self) -> str:
        return f"{self.capacity} items per endpoint ({self.size_mb} MiB at {MB_PER_ITEM} MiB per item)"

    def produces(self) -> frozenset[str]:
        return frozenset({ENCODER_CACHE_MATCH})

    def _on_endpoints_changed(self, added: tuple[Endpoint, ...], removed: tuple[Endpoint, ...]) -> None:
        for ep in removed:
            self._caches.pop(ep.name, None)

    async def prepare(self, state: CycleState, request: InferenceRequest, endpoints: Sequence[Endpoint]) -> None:
        items = media_items(request)
        if not items:
            return
        state.put(self.name, items)
        for digest, modality in items.items():
            self.metrics.queries.labels(self.name, modality).inc()
            if any(digest in cache for cache in self._caches.values()):
                self.metrics.hits.labels(self.name, modality).inc()
        for ep in endpoints:
            cache = self._caches.get(ep.name)
            matched = sum(1 for digest in items if cache is not None and digest in cache)
            self.metrics.ratio.labels(self.name).observe(matched / len(items))
            state.put_endpoint_data(ENCODER_CACHE_MATCH, ep.name, EncoderCacheMatch(matched, len(items)))

    def pre_request(self, state: CycleState, request: InferenceRequest, result: SchedulingResult) -> None:
        items: Mapping[str, str] | None = state.get(self.name)
        if not items:
            return
        for ep in result.targets:
            cache = self._caches.setdefault(ep.name, OrderedDict())
            for digest in items:
                cache[digest] = None
                cache.move_to_end(digest)
            while len(cache) > self.capacity:
                cache.popitem(last=False)

    def debug_state(self) -> Mapping[str, Any]:
        return {"capacity": self.capacity, "endpoints": {name: len(c) for name, c in sorted(self._caches.items())}}


class MMEmbeddingsCacheScorer(Scorer):
    """matched / total multimodal items of the request on each endpoint; 0 without media."""

    type_name = "mm-embeddings-cache-scorer"

    def __init__(self, name: str, params: PluginParams | None = None, context: PluginContext | None = None) -> None:
        super().__init__(name)

    def consumes(self) -> frozenset[str]:
        return frozenset({ENCODER_CACHE_MATCH})

    def score(self, state: CycleState, request: InferenceRequest,
              endpoints: Sequence[Endpoint]) -> Mapping[str, float]:
        data = state.all_endpoint_data(ENCODER_CACHE_MATCH)
        out: dict[str, float] = {}
        for ep in endpoints:
            match = data.get(ep.name)
            out[ep.name] = match.fraction if isinstance(match, EncoderCacheMatch) else 0.0
        return out


def register(registry: PluginRegistry) -> None:
    """Entry point of the `epp.plugins` group: registers the producer and the scorer."""
    registry.register_class(MMEmbeddingsCacheProducer, default_producer_for=[ENCODER_CACHE_MATCH])
    registry.register_class(MMEmbeddingsCacheScorer)
