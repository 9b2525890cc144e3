"""approx-prefix-cache-producer: prefix match info from our own routing history (GIE §4).

GIE's algorithm hashes the prompt in blocks of `blockSizeTokens x 4` characters and models each
endpoint's cache as an LRU of `cache_num_blocks` hash blocks, i.e. it assumes 4 characters per
token. Real tokenizers differ (the simulator's: ~2.3 characters a token on its benchmark text;
code and CJK text differ more), and then the index believes an endpoint holds prefixes it
evicted long ago, or forgets ones it still holds. `approx-prefix-cache-producer` learns the
characters per token from the responses it sees (`usage.prompt_tokens` against the prompt's
characters) and sizes each endpoint's LRU to what its cache really holds; `charsPerToken` fixes
the ratio instead. What it hashes is the request's input as bytes (a chat's messages as JSON: a
few percent more bytes than the text has characters), so it also learns the hashed bytes per
prompt character and converts hash blocks to tokens with both.

Its index models the cache as vLLM keeps it (`PrefixIndex(chain_aware=True)`): a request's
blocks are touched tail first, so under pressure a chain loses its tail and keeps its head (vLLM
frees a finished request's blocks in reverse order), and an endpoint matches only the blocks it
holds contiguously from the start (`chainAware: false` turns this off). GIE's index instead evicts a chain's head first, after which
the endpoint's whole match is gone while the replica still holds most of the prefix: on a
multi-turn chat that sends a session's next turn elsewhere, a cold prefill of its history.
`publishTierMatch: true` also publishes `PREFIX_TIER_MATCH` (matched and
total prompt tokens, all as GPU hits), so `predicted-ttft-scorer` can run on approximate
matching. GIE's algorithm, unchanged, is `gie-approx-prefix-cache-producer`.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Gauge, Histogram

from epp.framework import (
    PREFIX_CACHE_FREE_BLOCKS,
    PREFIX_HOME,
    PREFIX_MATCH_INFO,
    PREFIX_TIER_MATCH,
    Booking,
    ConfigError,
    CycleState,
    DataProducer,
    DecisionSharing,
    Endpoint,
    InferenceRequest,
    PluginContext,
    PluginParams,
    PrefixMatchInfo,
    PreRequestHook,
    ResponseInfo,
    SchedulingResult,
    TierMatch,
    once_per_registry,
    prompt_characters,
    publish_home,
)
from epp.scorers.prefix_hashing import AVERAGE_CHARACTERS_PER_TOKEN, block_hashes, chain_seed
from epp.scorers.prefix_index import PrefixIndex
from epp.scorers.prompt_text import user_input_bytes

PREFILL_PROFILE = "prefill"
# How far each learned ratio (characters per token, hashed bytes per character) moves toward an observation.
_LEARNING_STEP = 0.05


@dataclass(frozen=True)
class PrefixIndexMetrics:
    """The prefix-indexer series of GIE (`inference_extension_prefix_indexer_*`)."""

    size: Gauge
    hit_ratio: Histogram
    hit_bytes: Histogram


def prefix_index_metrics(registry: CollectorRegistry) -> PrefixIndexMetrics:
    """The metrics on `registry`, created once per registry (several producers share them)."""
    return once_per_registry(registry, "inference_extension_prefix_indexer", lambda r: PrefixIndexMetrics(
        size=Gauge("inference_extension_prefix_indexer_size",
                   "Entries in the approximate prefix index, over all endpoints.", registry=r),
        hit_ratio=Histogram("inference_extension_prefix_indexer_hit_ratio",
                            "Fraction of the prompt's blocks found on the picked endpoint.",
                            buckets=[i / 10 for i in range(11)], registry=r),
        hit_bytes=Histogram("inference_extension_prefix_indexer_hit_bytes",
                            "Prompt bytes found cached on the picked endpoint.",
                            buckets=[0, 256, 1024, 4096, 16384, 65536, 262144, 1048576], registry=r),
    ))


@dataclass(frozen=True, slots=True)
class _RequestPrefix:
    hashes: list[int]
    matched: dict[str, int]
    block_size_tokens: int


class ApproxPrefixCacheProducer(DataProducer, PreRequestHook):
    """Hashes the prompt into blocks, matches them against what each endpoint was sent, records the pick."""

    type_name = "approx-prefix-cache-producer"
    # GIE's algorithm: 4 characters per token, no learning, no token match published.
    gie_compatible = False

    def __init__(self, name: str, params: PluginParams, context: PluginContext) -> None:
        super().__init__(name)
        self.auto_tune = params.bool("autoTune", True)
        block_tokens = params.int("blockSizeTokens", None)
        legacy_chars = params.int("blockSize", None)
        if legacy_chars is not None and block_tokens is None:
            raise ConfigError(f"plugin {name!r}: parameter 'blockSize' (characters) is deprecated; "
                              "set 'blockSizeTokens' instead")
        if block_tokens is not None and block_tokens < 1:
            raise ConfigError(f"plugin {name!r}: parameter 'blockSizeTokens' must be >= 1, got {block_tokens}")
        self.block_size_tokens = block_tokens or 16
        self.max_prefix_blocks = params.int("maxPrefixBlocksToMatch", 256, minimum=1)
        self.max_prefix_tokens = params.int("maxPrefixTokensToMatch", 0, minimum=0)
        self.lru_capacity_per_server = params.int("lruCapacityPerServer", 31250, minimum=1)
        if self.gie_compatible:
            fixed_cpt, self.publish_tier_match = float(AVERAGE_CHARACTERS_PER_TOKEN), False
        else:
            fixed_cpt = params.float("charsPerToken", 0.0, minimum=0.0, maximum=64.0)
            self.publish_tier_match = params.bool("publishTierMatch", False)
        # With `rendezvousHome`, a prefix no endpoint holds goes to its rendezvous home
        # (epp/framework/rendezvous.py: off by default, and why); GIE's algorithm has no home.
        self.rendezvous_home = not self.gie_compatible and params.bool("rendezvousHome", False)
        self._ledger = context.load
        #: Characters per token: fixed when configured (or GIE), else learned from responses.
        self.learn_chars_per_token = fixed_cpt == 0.0
        self.chars_per_token = fixed_cpt or float(AVERAGE_CHARACTERS_PER_TOKEN)
        #: Hashed input bytes per prompt character (learned; GIE's algorithm takes them as equal).
        self.bytes_per_character = 1.0
        chain_aware = False if self.gie_compatible else params.bool("chainAware", True)
        self.index = PrefixIndex(chain_aware=chain_aware)
        # Where each data key is written: its own name unless several producers of it are configured.
        self._keys: dict[str, str] = {}
        if self.learn_chars_per_token:
            context.load.add_observer(self._learn_chars_per_token)
        self.metrics = prefix_index_metrics(context.metrics_registry or CollectorRegistry())
        if context.endpoints is not None:
            context.endpoints.add_listener(self._on_endpoints_changed)
        self._endpoints = context.endpoints
        # Other pickers of the pool learn this one's routes and it theirs (epp.framework.sharing).
        self.sharing = context.sharing
        _peer_link(context.sharing).add(self)

    def describe(self) -> str:
        cpt = "learned" if self.learn_chars_per_token else f"{self.chars_per_token:g}"
        return (f"autoTune={str(self.auto_tune).lower()} blockSizeTokens={self.block_size_tokens} "
                f"maxPrefixBlocksToMatch={self.max_prefix_blocks} maxPrefixTokensToMatch={self.max_prefix_tokens} "
                f"lruCapacityPerServer={self.lru_capacity_per_server} charsPerToken={cpt} "
                f"chainAware={str(self.index.chain_aware).lower()} "
                f"publishTierMatch={str(self.publish_tier_match).lower()} "
                f"rendezvousHome={str(self.rendezvous_home).lower()}")

    def debug_state(self) -> Mapping[str, Any]:
        index = self.index
        return {"entries": index.size, "chain_aware": index.chain_aware,
                "chars_per_token": round(self.chars_per_token, 3),
                "bytes_per_character": round(self.bytes_per_character, 3),
                "endpoints": {ep: {"held": index.held(ep), "capacity": index.capacity(ep)} for ep in index.endpoints()}}

    def produces(self) -> frozenset[str]:
        keys = {PREFIX_MATCH_INFO, PREFIX_CACHE_FREE_BLOCKS}
        if self.publish_tier_match:
            keys.add(PREFIX_TIER_MATCH)
        return frozenset(self.output_key(k) for k in keys)

    def publish_under(self, keys: Mapping[str, str]) -> bool:
        """Several prefix producers (llm-d's GPU and CPU tiers): this one writes under its own name, and keeps
        its routes from the pool's other pickers (their capacities are another producer's)."""
        self._keys.update(keys)
        if keys:
            self._keys.setdefault(PREFIX_HOME, f"{PREFIX_HOME}/{self.name}")
        return True

    def output_key(self, key: str) -> str:
        return self._keys.get(key, key)

    @property
    def shares_routes(self) -> bool:
        """Whether this producer's routes travel to the pool's other pickers (the one writing the plain key)."""
        return not self._keys

    def _on_endpoints_changed(self, added: tuple[Endpoint, ...], removed: tuple[Endpoint, ...]) -> None:
        for ep in removed:
            self.index.remove_endpoint(ep.name)
        self.metrics.size.set(self.index.size)

    def effective_block_size(self, endpoints: Sequence[Endpoint]) -> int:
        """Block size in tokens: the model server's own when auto-tuning and it is known."""
        if self.auto_tune and endpoints and endpoints[0].metrics.cache_block_size > 0:
            return endpoints[0].metrics.cache_block_size
        return self.block_size_tokens

    @property
    def bytes_per_token(self) -> float:
        """Hashed input bytes per prompt token: what converts hash blocks into tokens."""
        return self.chars_per_token * self.bytes_per_character

    def hash_request(self, request: InferenceRequest, block_size_tokens: int) -> list[int]:
        """The request's block-hash chain (empty when the prompt is shorter than one block)."""
        max_blocks = self.max_prefix_blocks
        if self.max_prefix_tokens > 0:
            max_blocks = max(1, self.max_prefix_tokens // block_size_tokens)
        block_chars = block_size_tokens * AVERAGE_CHARACTERS_PER_TOKEN
        limit = block_chars * max_blocks
        data = user_input_bytes(request, limit=limit)
        if not self.gie_compatible and len(data) < limit:
            self._learn_bytes_per_character(request, len(data))
        return block_hashes(data, block_chars, max_blocks, chain_seed(request.target_model, request.cache_salt))

    def _learn_bytes_per_character(self, request: InferenceRequest, input_bytes: int) -> None:
        """Learn the hashed bytes per prompt character from a prompt hashed whole (so the cost stays bounded)."""
        characters = prompt_characters(request, limit=input_bytes)
        if characters >= 64:  # short prompts are mostly JSON syntax
            ratio = input_bytes / characters
            if 1.0 <= ratio <= 8.0:
                self.bytes_per_character += _LEARNING_STEP * (ratio - self.bytes_per_character)

    async def prepare(self, state: CycleState, request: InferenceRequest,
                      endpoints: Sequence[Endpoint]) -> None:
        block_tokens = self.effective_block_size(endpoints)
        hashes = self.hash_request(request, block_tokens)
        matched = self.index.match_longest_prefix(hashes) if hashes else {}
        total = len(hashes)
        no_match = PrefixMatchInfo(0, total, block_tokens)  # immutable: shared by every endpoint without a hit
        index = self.index
        key_info, key_free = self.output_key(PREFIX_MATCH_INFO), self.output_key(PREFIX_CACHE_FREE_BLOCKS)
        bytes_per_token = self.bytes_per_token
        # Free space in blocks of `block_tokens` tokens (the model server's), as the precise producer
        # counts them: a hash block covers AVERAGE_CHARACTERS_PER_TOKEN / bytes_per_token of those.
        engine_blocks_per_hash_block = AVERAGE_CHARACTERS_PER_TOKEN / bytes_per_token
        for ep in endpoints:
            name = ep.name
            hit = matched.get(name)
            state.put_endpoint_data(key_info, name,
                                    no_match if hit is None else PrefixMatchInfo(hit, total, block_tokens))
            capacity = self._capacity_for(ep, bytes_per_token)
            state.put_endpoint_data(key_free, name, int(max(0, capacity - index.held(name)) * engine_blocks_per_hash_block))
        if self.publish_tier_match:
            self._publish_tier_match(state, request, endpoints, matched, block_tokens)
        if hashes and not matched and self.rendezvous_home:
            publish_home(state, hashes[0], endpoints, self._ledger.load, self.output_key(PREFIX_HOME))
        state.put(self.name, _RequestPrefix(hashes, matched, block_tokens))

    def _publish_tier_match(self, state: CycleState, request: InferenceRequest, endpoints: Sequence[Endpoint],
                            matched: dict[str, int], block_tokens: int) -> None:
        """Matched and total prompt tokens per endpoint, converted with the characters (bytes) per token."""
        total = int(prompt_characters(request) / self.chars_per_token)
        block_tokens_estimate = block_tokens * AVERAGE_CHARACTERS_PER_TOKEN / self.bytes_per_token
        no_match = TierMatch(0, 0, 0, total)
        key = self.output_key(PREFIX_TIER_MATCH)
        for ep in endpoints:
            hit = matched.get(ep.name)
            state.put_endpoint_data(key, ep.name, no_match if not hit else
                                    TierMatch(min(total, int(hit * block_tokens_estimate)), 0, 0, total))

    def _learn_chars_per_token(self, booking: Booking, response: object) -> None:
        """Learn the characters per token from a completed response's prompt token count."""
        usage = response.usage if isinstance(response, ResponseInfo) else None
        if not usage or booking.prompt_characters <= 0:
            return
        tokens = usage.get("prompt_tokens")
        if not isinstance(tokens, int) or tokens < 16:
            return
        if self._count_prompt_tokens(booking.prompt_characters, tokens) and self.shares_routes:
            self.sharing.publish_prompt_tokens(booking.prompt_characters, tokens)

    def _count_prompt_tokens(self, characters: int, tokens: int) -> bool:
        """Move the characters per token toward this prompt's; False when its ratio is nonsense."""
        ratio = characters / tokens if tokens > 0 else 0.0
        if not 0.5 <= ratio <= 64:  # a prompt of token ids, a wrong usage
            return False
        # An average that starts at GIE's 4.0 and forgets it over ~60 responses. A ratio of sums
        # taking the first response whole was tried and taken back: no better on shared-prefix, and
        # 1.2-2.3 hit points below this average on multi-turn in two comparisons, about as much as this
        # code itself varied between runs
        # (bench/notes/2026-12-pickers-and-cost-issue14-round2-s7-s13.md, "The learned characters per token").
        # A mean of the first 20 ratios, then this average, was tried in round 4 and not kept either: the
        # approximate predicted-TTFT pipeline gained (bursts 3.5 s p90 against 4.1-4.2), GIE's default
        # pipeline lost on shared-prefix in 3 of 3 runs (bench/notes/2026-12-round4-measurements.md).
        self.chars_per_token += _LEARNING_STEP * (ratio - self.chars_per_token)
        return True

    def _capacity_for(self, ep: Endpoint, bytes_per_token: float | None = None) -> int:
        """Hash blocks the endpoint's cache holds: its blocks, scaled by how many tokens a hash block covers."""
        if self.auto_tune and ep.metrics.cache_num_blocks > 0:
            per_token = self.bytes_per_token if bytes_per_token is None else bytes_per_token
            return max(1, int(ep.metrics.cache_num_blocks * per_token / AVERAGE_CHARACTERS_PER_TOKEN))
        return self.lru_capacity_per_server

    def pre_request(self, state: CycleState, request: InferenceRequest, result: SchedulingResult) -> None:
        info: _RequestPrefix | None = state.get(self.name)
        if info is None or not info.hashes or not request.generates:  # a token count caches no prefix
            return
        targets = list(result.targets[:1])
        prefill = result.profile_results.get(PREFILL_PROFILE)
        if prefill is not None and prefill.targets and PREFILL_PROFILE != result.primary_profile:
            targets.append(prefill.targets[0])
        if not targets:
            return
        primary = targets[0]
        hit_blocks = info.matched.get(primary.name, 0)
        self.metrics.hit_ratio.observe(hit_blocks / len(info.hashes))
        self.metrics.hit_bytes.observe(hit_blocks * info.block_size_tokens * AVERAGE_CHARACTERS_PER_TOKEN)
        for ep in targets:
            capacity = self._capacity_for(ep)
            self.index.add(info.hashes, ep.name, capacity)
            if self.shares_routes:
                self.sharing.publish_prefix(ep.name, info.hashes, capacity)
        self.metrics.size.set(self.index.size)

    def _learn_peer_route(self, endpoint: str, hashes: Sequence[int], capacity: int) -> None:
        """A peer picker sent a request with these blocks to `endpoint`: it holds them now, as if we had."""
        if self._endpoints is not None and self._endpoints.get(endpoint) is None:
            return  # not (or no longer) in this picker's pool: nothing would ever remove it
        self.index.add(hashes, endpoint, max(1, capacity))
        self.metrics.size.set(self.index.size)


class _PeerLink:
    """The approximate producers of one picker behind its one peer link (`DecisionSharing` takes one learner).

    Every producer learns the characters per token the peers counted; the peers' routes go to the
    producers that share theirs (those writing the plain data key), and a late peer is sent the
    first such producer's index.
    """

    def __init__(self, sharing: DecisionSharing) -> None:
        producers: weakref.WeakSet[ApproxPrefixCacheProducer] = weakref.WeakSet()
        self.producers = producers

        def learn_route(endpoint: str, hashes: Sequence[int], capacity: int) -> None:
            for producer in list(producers):
                if producer.shares_routes:
                    producer._learn_peer_route(endpoint, hashes, capacity)

        def snapshot() -> Any:
            sharing_ones = [p for p in list(producers) if p.shares_routes]
            return sharing_ones[0].index.entries() if sharing_ones else iter(())

        def learn_tokens(characters: int, tokens: int) -> None:
            for producer in list(producers):
                if producer.learn_chars_per_token:
                    producer._count_prompt_tokens(characters, tokens)

        sharing.share_prefixes(learn_route, snapshot)
        # Every picker of a pool learns from every response: with a share each, their LRUs were
        # sized apart for minutes (four pods, shared-prefix: groups kept on replicas that had
        # evicted them).
        sharing.share_prompt_tokens(learn_tokens)

    def add(self, producer: ApproxPrefixCacheProducer) -> None:
        self.producers.add(producer)


_PEER_LINKS: weakref.WeakKeyDictionary[DecisionSharing, _PeerLink] = weakref.WeakKeyDictionary()


def _peer_link(sharing: DecisionSharing) -> _PeerLink:
    """The peer link of `sharing`, registered with it once."""
    link = _PEER_LINKS.get(sharing)
    if link is None:
        link = _PEER_LINKS[sharing] = _PeerLink(sharing)
    return link


class GIEApproxPrefixCacheProducer(ApproxPrefixCacheProducer):
    """GIE's approximate prefix producer exactly: 4 characters per token, LRU of cache_num_blocks hash blocks."""

    type_name = "gie-approx-prefix-cache-producer"
    gie_compatible = True
