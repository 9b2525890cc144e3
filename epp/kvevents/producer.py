"""precise-prefix-cache-producer: prefix match info from the KV events the replicas publish.

It owns the KV-event machinery (subscriber, block index, tokenizers), so it lives with it here
rather than among the built-ins in `scorers/`, which use only `epp.framework`; it registers
through its own `epp.plugins` entry point (`kvevents`).

Per request: the prompt is tokenized in process (vLLM's rendering), cut into index blocks,
keyed by our own hash chain (model or LoRA name, cache_salt), and looked up in the KV block
index that the producer's subscriber keeps up to date from vLLM KV events. It writes, for every
candidate endpoint:
- `PREFIX_MATCH_INFO`: matched blocks consecutive from the start, each weighted by the best tier
  holding it on that endpoint (`tierWeights`, default gpu 1.0, cpu 0.8, disk 0.5), over the
  prompt's total blocks (the `prefix-cache-scorer` scores `matched / total`);
- `PREFIX_TIER_MATCH`: the same run in tokens, unweighted, split by tier.
A conversation's next turn costs what its new part costs: tokenization reuses the previous
turn's tokens (`tokenizationCacheTokens`), keying its keys (`keyCacheBytes`, epp.kvevents.keys)
and the lookup its match, walking only the new blocks (`matchMemoBytes`, for at most
`matchReuseSeconds` after a full walk; in-memory index only; epp.kvevents.match_memo).
As a pre-request hook it claims the request's blocks on each profile's chosen endpoint for
`speculativeTTL` (those past the run the endpoint holds confirmed already), so a burst of
same-prefix requests does not scatter before events arrive; with peer pickers (`--workers`,
`--peers`) each claim goes over the peer link too, and each picker claims its peers' picks for
its own TTL.
With `rendezvousHome: true` (default false), when no endpoint holds any block of the prompt, it
names the prefix's rendezvous home (`epp.framework.rendezvous`), the same in every picker of a pool.
Topics: vLLM publishes on topic `""` unless `--kv-events-config` sets one. `mode: per-endpoint`
(the default) accepts it: the socket it dialled names the replica, and the model is
`defaultModel`, or the one model of `tokenizers` when there is exactly one. `mode: centralized`
binds one socket for all replicas and needs the topic `kv@<ip:port>@<model>` to tell them
apart; messages on any other topic are dropped, counted and explained in a warning.
Data-parallel ranks on consecutive ports (`rankPortBase`, `ranksPerHost`): the endpoint of rank r
subscribes at `eventsPort + r` (and replays at `replayPort + r`), vLLM's per-rank offsets.
Index backend: `indexBackend: memory` (default, this process) or `redis` (entries in the Redis
at `redisUrl`, shared by every picker of the pool; see epp.kvevents.redis_index: capacity is
Redis's maxmemory, and a Redis that is down or slower than `redisTimeout` means no prefix scores).
With Redis, `eventShard: "i/n"` makes this picker apply the events of shard i of n of the
replicas only (by a hash of the endpoint name), so n groups of writers split the pool's events
and engine-hash maps; every picker still reads every replica's entries.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from epp.framework import (
    ConfigError,
    CycleState,
    DataProducer,
    Endpoint,
    InferenceRequest,
    MediaItem,
    PluginContext,
    PluginParams,
    PluginRegistry,
    PreRequestHook,
    SchedulingResult,
    once_per_registry,
)
from epp.framework.datakeys import (
    PREFIX_CACHE_FREE_BLOCKS,
    PREFIX_MATCH_INFO,
    PREFIX_TIER_MATCH,
    PROMPT_TOKENS,
    PrefixMatchInfo,
    PromptTokens,
    TierMatch,
)
from epp.framework.rendezvous import publish_home
from epp.kvevents.backend import BACKENDS, InMemoryKVIndex, KVIndexBackend
from epp.kvevents.decoding import Tier
from epp.kvevents.keys import DEFAULT_KEY_CACHE_BYTES, BlockKeyCache, media_extras
from epp.kvevents.match_memo import MatchMemo, MatchMemoMetrics
from epp.kvevents.metrics import KVIndexMetrics, KVSubscriberMetrics
from epp.kvevents.subscriber import MODES, KVEventSubscriber, SubscriberConfig
from epp.tokenization.pool import TokenizerPool, token_ids_of
from epp.tokenization.prefix_store import PrefixStoreMetrics

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

log = logging.getLogger(__name__)

DEFAULT_TIER_WEIGHTS = {"gpu": 1.0, "cpu": 0.8, "disk": 0.5}
OFFLOAD_KEYING_BLOCKS = 2048
DEFAULT_MATCH_MEMO_BYTES = 4 * 1024 * 1024  # ~1,000 remembered 200 KB prompts on two endpoints each
DEFAULT_MATCH_REUSE_S = 10.0


class PrecisePrefixCacheProducer(DataProducer, PreRequestHook):
    """Prefix match per endpoint, by tier, from vLLM KV events (owns the index and subscriber)."""

    type_name = "precise-prefix-cache-producer"

    def __init__(self, name: str, params: PluginParams, context: PluginContext) -> None:
        super().__init__(name)
        self.block_size = params.int("blockSizeTokens", 16, minimum=1)
        capacity = params.int("indexCapacity", 1_000_000, minimum=1)
        engine_capacity = params.int("engineKeyCapacity", 200_000, minimum=1)
        offload_chunk = params.int("offloadChunkBlocks", 1, minimum=1)
        self.max_blocks = params.int("maxPrefixBlocks", 16_384, minimum=1)
        weights = dict(DEFAULT_TIER_WEIGHTS)
        for tier, weight in (params.mapping("tierWeights", None) or {}).items():
            if tier not in weights:
                raise ConfigError(f"plugin {name!r}: tierWeights key {tier!r} must be one of {sorted(weights)}")
            if isinstance(weight, bool) or not isinstance(weight, (int, float)) or weight < 0:
                raise ConfigError(f"plugin {name!r}: tierWeights[{tier!r}] must be a number >= 0")
            weights[tier] = float(weight)
        self.tier_weights = (weights["gpu"], weights["cpu"], weights["disk"])  # indexed by Tier
        speculative_ttl = params.duration("speculativeTTL", 2.0)
        self.rendezvous_home = params.bool("rendezvousHome", False)
        self._ledger = context.load
        self._endpoints = context.endpoints
        # Peer pickers learn this one's claims and it theirs: KV events confirm a pick only after its
        # prefill, and until then a peer would not see the prefix at all (epp.framework.sharing).
        self.sharing = context.sharing
        self.sharing.share_claims(self._learn_peer_claim)
        mode = params.str("mode", "per-endpoint", choices=MODES)
        shard, shards = _event_shard(name, params.str("eventShard", None))
        config = SubscriberConfig(
            mode=mode,
            bind_endpoint=params.str("zmqEndpoint", "tcp://*:5557"),
            events_port=params.int("eventsPort", 5557, minimum=1),
            replay_port=params.int("replayPort", 0, minimum=0) or None,  # 0: no replay socket
            rank_port_base=params.int("rankPortBase", None, minimum=1),
            ranks_per_host=params.int("ranksPerHost", 1, minimum=1),
            topic_filter=params.str("topicFilter", ""),
            default_model=params.str("defaultModel", None),
            replay_timeout_s=params.duration("replayTimeout", 10.0),
            replay_cooldown_s=params.duration("replayCooldown", 30.0),
            shard=shard, shards=shards,
        )
        self.subscribe = params.bool("subscribe", True)
        tokenizer_dirs = params.mapping("tokenizers", None) or {}
        for model, path in tokenizer_dirs.items():
            if not isinstance(path, str):
                raise ConfigError(f"plugin {name!r}: tokenizers[{model!r}] must be a directory path")
        if config.default_model is None and len(tokenizer_dirs) == 1:
            # vLLM publishes on topic "" by default, which names no model; with one model
            # configured, that is the model of every event.
            config.default_model = str(next(iter(tokenizer_dirs)))
        # The tokens of a token-producer (llm-d's shape) instead of our own tokenizer files.
        self.use_token_producer = params.bool("useTokenProducer", False)
        if self.use_token_producer and tokenizer_dirs:
            raise ConfigError(f"plugin {name!r}: useTokenProducer and tokenizers both give the tokens; set one")
        cache_tokens = params.int("tokenizationCacheTokens", 4_000_000, minimum=0)
        key_cache_bytes = params.int("keyCacheBytes", DEFAULT_KEY_CACHE_BYTES, minimum=0)
        memo_bytes = params.int("matchMemoBytes", DEFAULT_MATCH_MEMO_BYTES, minimum=0)
        memo_age = params.duration("matchReuseSeconds", DEFAULT_MATCH_REUSE_S)
        offload_chars = params.int("offloadTokenizationChars", 4096, minimum=0)

        backend = params.str("indexBackend", "memory", choices=BACKENDS)
        redis_url = params.str("redisUrl", None)
        redis_prefix = params.str("redisKeyPrefix", "epp:kv:")
        redis_timeout = params.duration("redisTimeout", 0.05)
        if backend == "redis" and not redis_url:
            raise ConfigError(f"plugin {name!r}: indexBackend redis needs redisUrl (redis://host:port/db)")
        if backend != "redis" and shards > 1:
            raise ConfigError(f"plugin {name!r}: eventShard needs indexBackend redis (a shard's events alone "
                              "make an incomplete local index)")
        if backend != "redis" and redis_url:
            raise ConfigError(f"plugin {name!r}: redisUrl is set but indexBackend is {backend!r} (set it to redis)")

        registry = context.metrics_registry
        self.index: KVIndexBackend
        if backend == "redis":
            self.index = _redis_index(name, redis_url or "", self.block_size, redis_prefix, redis_timeout,
                                      engine_capacity, offload_chunk, speculative_ttl, registry)
        else:
            self.index = InMemoryKVIndex(
                self.block_size, capacity, engine_capacity_per_endpoint=engine_capacity,
                offload_chunk_blocks=offload_chunk,
                speculative_ttl_s=speculative_ttl,
                metrics=once_per_registry(registry, "epp_kv_index", KVIndexMetrics, shared=False))
        self.subscriber = KVEventSubscriber(
            self.index, config, context.endpoints,
            once_per_registry(registry, "epp_kv_events", KVSubscriberMetrics, shared=False))
        self.tokenizers = (TokenizerPool(tokenizer_dirs, cache_tokens=cache_tokens, offload_chars=offload_chars,
                                         registry=registry)
                           if tokenizer_dirs else None)
        # The next turn of a conversation is keyed from where its previous turn's keys end.
        self.key_cache = BlockKeyCache(
            self.index.keyer, key_cache_bytes,
            metrics=once_per_registry(registry, "epp_kv_key_cache",
                                      lambda r: PrefixStoreMetrics(r, "epp_kv_key_cache"), shared=False))
        # ... and looked up from where its previous turn's match ends. Not with Redis: there each
        # lookup is a round trip, and one walk of all blocks costs less than three short ones.
        self.match_memo = (MatchMemo(memo_bytes, memo_age,
                                     metrics=once_per_registry(registry, "epp_kv_match_memo", MatchMemoMetrics,
                                                               shared=False))
                           if backend == "memory" and memo_bytes > 0 and memo_age > 0 else None)

    # ---- lifecycle -----------------------------------------------------------------------------
    async def start(self) -> None:
        if self.tokenizers is not None:
            await self.tokenizers.preload()
        await self.index.start()
        if self.subscribe:
            await self.subscriber.start()

    async def stop(self) -> None:
        if self.subscribe:
            await self.subscriber.stop()
        await self.index.stop()
        if self.tokenizers is not None:
            self.tokenizers.close()

    def debug_state(self) -> Mapping[str, Any]:
        return {"index_backend": type(self.index).__name__, "block_size_tokens": self.block_size,
                "engine_blocks": {ep: self.index.engine_blocks(ep) for ep in self.index.endpoints()}}

    # ---- producing -----------------------------------------------------------------------------
    def produces(self) -> frozenset[str]:
        return frozenset({PREFIX_MATCH_INFO, PREFIX_TIER_MATCH, PREFIX_CACHE_FREE_BLOCKS})

    def consumes(self) -> frozenset[str]:
        return frozenset({PROMPT_TOKENS}) if self.use_token_producer else frozenset()

    async def prompt_tokens(self, request: InferenceRequest) -> Sequence[int] | None:
        """The prompt's token ids as vLLM will see them, or None when they cannot be known."""
        if self.tokenizers is not None:
            return await self.tokenizers.tokenize(request)
        return token_ids_of(request)

    async def prepare(self, state: CycleState, request: InferenceRequest,
                      endpoints: Sequence[Endpoint]) -> None:
        tokens: Sequence[int] | None
        media: Sequence[MediaItem] = ()
        if self.use_token_producer:
            produced: PromptTokens | None = state.get(PROMPT_TOKENS)
            # Estimated ids are no engine's: keyed, they would never match an event.
            tokens = produced.token_ids if produced is not None and produced.exact else None
            media = produced.media if produced is not None else ()
        else:
            tokens = await self.prompt_tokens(request)
            media = request.media()
        if tokens is None:
            return
        bs = self.block_size
        tokens = tokens[: self.max_blocks * bs]
        # Media placed in the token ids (the renderer's or a token-in client's features) salt the keys where
        # vLLM's block hashes carry them; media without a place (local tokenization) cannot be placed, and
        # their blocks then simply match nothing.
        placed = [(m.engine_hash, m.token_offset) for m in media
                  if m.engine_hash is not None and m.token_offset is not None and m.token_offset < len(tokens)]
        previous_last_key = None
        shared_blocks = 0
        if placed:
            keys = self.index.keyer.chain(self.index.keyer.root(request.target_model, request.cache_salt), tokens,
                                          media_extras(placed, bs))
        else:
            work = self.key_cache.start(tokens, request.target_model, request.cache_salt)
            shared_blocks = len(work.keys)
            previous_last_key = work.found.value[-1] if work.found is not None and work.found.value else None
            if work.to_hash > OFFLOAD_KEYING_BLOCKS:  # ~1 ms per 3,000 blocks: keep the loop responsive
                keys = await asyncio.to_thread(self.key_cache.finish, work)
            else:
                keys = self.key_cache.finish(work)
        names = [ep.name for ep in endpoints]
        matches: Mapping[str, Sequence[int]]
        if not keys:
            matches = {}
        elif self.match_memo is not None:
            matches = await self.match_memo.match(self.index.lookup_async, keys, names, previous_last_key,
                                                  shared_blocks)
        else:
            matches = await self.index.lookup_async(keys, names)
        state.put(self.name, _Picked(keys, {ep: len(run) for ep, run in matches.items()}))
        weights = self.tier_weights
        total_blocks = len(keys)
        for ep in endpoints:
            run = matches.get(ep.name, ())
            counts = (run.count(Tier.GPU), run.count(Tier.CPU), run.count(Tier.DISK)) if run else (0, 0, 0)
            weighted = counts[0] * weights[0] + counts[1] * weights[1] + counts[2] * weights[2]
            state.put_endpoint_data(PREFIX_MATCH_INFO, ep.name, PrefixMatchInfo(weighted, total_blocks, bs))
            state.put_endpoint_data(PREFIX_TIER_MATCH, ep.name, TierMatch(
                counts[Tier.GPU] * bs, counts[Tier.CPU] * bs, counts[Tier.DISK] * bs, len(tokens)))
            if ep.metrics.cache_num_blocks > 0:  # engine blocks of any tier: an estimate, exact before offload
                state.put_endpoint_data(PREFIX_CACHE_FREE_BLOCKS, ep.name,
                                        max(0, ep.metrics.cache_num_blocks - self.index.engine_blocks(ep.name)))
        if keys and not matches and self.rendezvous_home:
            publish_home(state, keys[0], endpoints, self._ledger.load)

    # ---- after the pick ------------------------------------------------------------------------
    def pre_request(self, state: CycleState, request: InferenceRequest, result: SchedulingResult) -> None:
        picked: _Picked | None = state.get(self.name)
        if picked is None or not picked.keys or not request.generates:  # a token count caches no prefix
            return
        for profile in result.profile_results.values():
            if profile is not None and profile.targets:
                target = profile.targets[0].name
                keys = self._to_claim(picked, target)
                if keys:
                    self.index.add_speculative(target, keys)
                    self.sharing.publish_claim(target, keys)

    def _to_claim(self, picked: _Picked, endpoint: str) -> Sequence[int]:
        """The keys to claim on `endpoint`: past the run it holds, when the index confirms that run's last block.

        A run the endpoint holds only by an earlier claim (its prefill not confirmed yet) is claimed
        again, as every block once was: the claim's TTL starts anew with each pick.
        """
        run = picked.runs.get(endpoint, 0)
        tiers_of = getattr(self.index, "tiers_of", None)  # the in-memory index can tell; Redis cannot cheaply
        if run and tiers_of is not None and tiers_of(picked.keys[run - 1], endpoint):
            return picked.keys[run:]
        return picked.keys

    def _learn_peer_claim(self, endpoint: str, keys: Sequence[int]) -> None:
        """A peer picker sent a request with these keys to `endpoint`: claim them as if we had."""
        if self._endpoints is not None and self._endpoints.get(endpoint) is None:
            return  # not (or no longer) in this picker's pool
        self.index.add_speculative(endpoint, keys)


@dataclass(frozen=True, slots=True)
class _Picked:
    """A request's block keys and, per endpoint, how many of them it held from the start when looked up."""

    keys: Sequence[int]
    runs: Mapping[str, int]


def _event_shard(name: str, text: str | None) -> tuple[int, int]:
    """`eventShard: "i/n"`: this picker applies the KV events of shard i of n of the pool."""
    if text is None:
        return 0, 1
    shard, _, shards = text.partition("/")
    if not (shard.isdigit() and shards.isdigit() and int(shard) < int(shards)):
        raise ConfigError(f"plugin {name!r}: eventShard must be \"i/n\" with 0 <= i < n, got {text!r}")
    return int(shard), int(shards)


def _redis_index(name: str, url: str, block_size: int, prefix: str, timeout_s: float, engine_capacity: int,
                 offload_chunk: int, speculative_ttl: float, registry: CollectorRegistry | None) -> KVIndexBackend:
    """The Redis backend (optional dependency), with a config error when it cannot be built."""
    try:
        from epp.kvevents.redis_index import RedisIndexMetrics, RedisKVIndex
        return RedisKVIndex(
            url, block_size, key_prefix=prefix, timeout_s=timeout_s, engine_capacity_per_endpoint=engine_capacity,
            offload_chunk_blocks=offload_chunk, speculative_ttl_s=speculative_ttl,
            metrics=once_per_registry(registry, "epp_kv_index", KVIndexMetrics, shared=False),
            redis_metrics=once_per_registry(registry, "epp_kv_redis", RedisIndexMetrics, shared=False))
    except (RuntimeError, ValueError) as exc:  # no redis package, or a URL it cannot parse
        raise ConfigError(f"plugin {name!r}: indexBackend redis: {exc}") from exc


def register(registry: PluginRegistry) -> None:
    """Entry point of the `epp.plugins` group: registers `precise-prefix-cache-producer`."""
    registry.register_class(PrecisePrefixCacheProducer)


__all__: list[Any] = ["DEFAULT_TIER_WEIGHTS", "PrecisePrefixCacheProducer", "register"]
