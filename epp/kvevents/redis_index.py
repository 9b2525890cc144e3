"""A KV-index backend on Redis: the entries (request key → endpoints → tiers) shared by every picker.

Layout: one Redis hash per request key, `<prefix><8-byte big-endian key>`, field = endpoint name,
value = tier mask (1 GPU, 2 CPU, 4 disk). Every picker of a pool reads the same entries; pickers
that subscribe to KV events write them.

Who holds what:
- Redis: the entries, the part that grows with the pool (10^8 blocks across thousands of replicas).
- Each subscribing picker: the engine map of the endpoints it subscribes to (`engine_map.py`, the
  one the in-memory index uses: the same events make the same holder changes, the same bound
  and trim rule), its holder changes queued as Redis writes.
  Writes are idempotent bit sets and clears, so two pickers applying the same endpoint's events
  leave the same entries (run two writers per endpoint for redundancy; pickers with
  `subscribe: false` only read).
- Each picker: its own speculative claims (after its picks, short TTL), never written to Redis.

Writes: event application runs the engine map synchronously and queues bit
operations per (key, endpoint), composed (set then clear = clear); one task flushes them as one
Lua script call per chunk of `write_chunk` keys (500: Redis runs a script alone, so a chunk
delays concurrent lookups by its run time, ~1.3 ms at the ~2.5 µs a block measured in
bench/kv_index_redis.py). With `eventShard` (the subscriber's shard of the replicas) several
groups of writers split a large pool's events and engine maps.
Lookups: one Lua script call (one round trip) runs the in-memory index's run rule where the
entries are (this picker's speculative claims passed along) and returns only each candidate's
run, one character a block. Keys travel packed (8 bytes each) in one argument and the scripts
name the Redis keys themselves: one Redis primary (replicas or Sentinel for failover), not Redis
Cluster, whose scripts must declare keys of one hash slot.

Capacity and eviction: Redis's `maxmemory` with `maxmemory-policy allkeys-lru` (approximated
LRU over keys; a lookup touches every key it reads, so entries are evicted least recently stored
or matched first, as in the in-memory index). The picker checks the policy at start and warns when
the Redis it uses has no maxmemory or a policy that does not evict; `epp_kv_index_evictions` mirrors
Redis's `evicted_keys`, `epp_kv_redis_used_memory_bytes` / `_maxmemory_bytes` its memory. An
evicted key's entries are gone (a lost match, never a wrong one); the writer's engine map still
resolves later removals of it (a removal of a missing key does nothing).

Redis down or slow: a lookup that fails or takes longer than `timeout_s` returns no match (no
prefix scores: routing falls back to the other scorers), counts
`epp_kv_redis_errors_total{op="lookup"}`, logs one line and opens a circuit: lookups return at once
without asking Redis until the health check (every `health_interval_s`) answers again, logged once.
Writes wait meanwhile (queued, composed; bounded by `max_pending_writes` pairs, beyond which
they are dropped, counted, and this writer's whole engine map is written again on recovery).
A Redis that restarted empty (its run id changed) is rewritten from the engine map the same way;
removals lost in an outage leave stale entries until the block is announced again or evicted.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import struct
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from epp.kvevents.decoding import DecodedBatch, Tier
from epp.kvevents.engine_map import ALL_TIERS, BEST_TIER, ApplyStats, tiers_in
from epp.kvevents.index_base import DEFAULT_POOL, KVIndexBase
from epp.kvevents.metrics import KVIndexMetrics
from epp.kvevents.redis_writes import WRITE_LUA, PendingWrites, write_args

try:  # optional dependency: `pip install llm-epp[redis]`
    import redis.asyncio as redis_asyncio
    from redis.exceptions import RedisError
except ImportError:  # pragma: no cover - exercised only without the extra
    redis_asyncio = None  # type: ignore[assignment]
    RedisError = OSError  # type: ignore[assignment,misc]

log = logging.getLogger(__name__)

# A write call's deadline: a batch of writes on a busy Redis may take long without Redis being down.
_WRITE_TIMEOUT_S = 10.0
_RESYNC_SLICE = 2_000  # engine blocks queued again between yields of the loop
# A lookup run's characters (byte values) → tier: '1'..'7' a stored mask's best tier, 'g' a claim (GPU).
_RUN_TIER: list[Tier | None] = [None] * 256
for _mask in range(1, 8):
    _RUN_TIER[ord(str(_mask))] = BEST_TIER[_mask]
_RUN_TIER[ord("g")] = Tier.GPU

# The lookup script takes the prompt's block keys packed as the write script does (redis_writes.py):
# the keys are not declared, so no Redis Cluster (see the module docstring).
# The in-memory index's run rule, run where the entries are (one round trip, only the runs return).
# ARGV[1]: key prefix, ARGV[2]: the prompt's packed keys in order, ARGV[3]: candidate endpoints
# '\n'-joined (empty: every holder of the first key and every endpoint claimed for it),
# ARGV[4..]: per key from the first, the endpoints the caller claimed for it, '\n'-joined.
# Returns {keys matched, endpoint, run, endpoint, run, ...}: a run has one character per block,
# the stored mask ('1'..'7') or 'g' for a claim Redis does not confirm.
_LOOKUP_LUA = """
local prefix, keys = ARGV[1], ARGV[2]
local s = #ARGV - 3
local alive = {}
for name in string.gmatch(ARGV[3], '[^\\n]+') do alive[#alive + 1] = name end
local given = #alive > 0
local runs = {}
local matched = 0
for i = 1, #keys / 8 do
  local h = redis.call('HGETALL', prefix .. string.sub(keys, 8 * i - 7, 8 * i))
  local held = {}
  for j = 1, #h, 2 do held[h[j]] = h[j + 1] end
  local claimed = {}
  local any_claim = false
  if i <= s then
    for name in string.gmatch(ARGV[3 + i], '[^\\n]+') do claimed[name] = true; any_claim = true end
  end
  if i == 1 and not given then
    for j = 1, #h, 2 do alive[#alive + 1] = h[j] end
    for name in pairs(claimed) do if not held[name] then alive[#alive + 1] = name end end
  end
  if #h == 0 and not any_claim then break end
  local still = {}
  for _, name in ipairs(alive) do
    local mark = held[name]
    if not mark and claimed[name] then mark = 'g' end
    if mark then
      local run = runs[name]
      if not run then run = {}; runs[name] = run end
      run[#run + 1] = mark
      still[#still + 1] = name
    end
  end
  if #still == 0 then break end
  alive = still
  matched = i
end
local out = {matched}
for name, run in pairs(runs) do
  out[#out + 1] = name
  out[#out + 1] = table.concat(run)
end
return out
"""


def _text(value: Any) -> str:
    """A Redis reply item as text (replies are bytes: the client does not decode them)."""
    return value.decode() if isinstance(value, bytes) else str(value)


class RedisIndexMetrics:
    """Health, memory, errors and queued writes of the Redis backend."""

    def __init__(self, registry: CollectorRegistry | None, prefix: str = "epp_kv_redis") -> None:
        kw: dict[str, Any] = {"registry": registry}
        self.up = Gauge(f"{prefix}_up", "1 while Redis answers, 0 while lookups skip it", **kw)
        self.errors = Counter(f"{prefix}_errors", "Redis calls that failed or timed out, by operation",
                              ["op"], **kw)
        self.degraded_lookups = Counter(
            f"{prefix}_degraded_lookups", "Lookups answered with no match because Redis was down or slow", **kw)
        self.used_memory = Gauge(f"{prefix}_used_memory_bytes", "Redis used_memory (polled)", **kw)
        self.maxmemory = Gauge(f"{prefix}_maxmemory_bytes", "Redis maxmemory, 0 = unbounded (polled)", **kw)
        self.pending_writes = Gauge(
            f"{prefix}_pending_writes", "(key, endpoint) bit operations queued for Redis", **kw)
        self.written = Counter(f"{prefix}_written_ops", "(key, endpoint) bit operations written", **kw)
        self.dropped_writes = Counter(
            f"{prefix}_dropped_writes", "Queued operations dropped while Redis was away (engine map rewritten)",
            **kw)
        self.resyncs = Counter(f"{prefix}_resyncs", "Engine maps written again after an outage or a Redis restart",
                               **kw)


class RedisKVIndex(KVIndexBase):
    """KV-index backend whose entries live in Redis (shared by pickers); see the module docstring."""

    def __init__(self, url: str, block_size: int = 16, *, key_prefix: str = "epp:kv:", timeout_s: float = 0.05,
                 health_interval_s: float = 0.5, poll_interval_s: float = 5.0, write_chunk: int = 500,
                 max_pending_writes: int = 1_000_000, redis_metrics: RedisIndexMetrics | None = None,
                 # as the in-memory index's (KVIndexBase):
                 engine_capacity_per_endpoint: int = 200_000, offload_chunk_blocks: int = 1,
                 speculative_ttl_s: float = 2.0, speculative_capacity: int = 200_000,
                 metrics: KVIndexMetrics | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        if redis_asyncio is None:
            raise RuntimeError("the Redis KV-index backend needs the `redis` package: pip install 'llm-epp[redis]'")
        super().__init__(block_size, engine_capacity_per_endpoint=engine_capacity_per_endpoint,
                         offload_chunk_blocks=offload_chunk_blocks, speculative_ttl_s=speculative_ttl_s,
                         speculative_capacity=speculative_capacity, metrics=metrics, clock=clock)
        self.url = url
        self.prefix = key_prefix.encode()
        self.timeout_s = timeout_s
        self.health_interval_s = health_interval_s
        self.poll_interval_s = poll_interval_s
        self.write_chunk = write_chunk
        self.max_pending_writes = max_pending_writes
        self.redis_metrics = redis_metrics or RedisIndexMetrics(None)
        # The client fails fast (no retries): the circuit below decides when to try again. Each call
        # has its own deadline (lookups `timeout_s`, writes `_WRITE_TIMEOUT_S`); the socket's is a backstop.
        self._redis = redis_asyncio.Redis.from_url(
            url, socket_timeout=_WRITE_TIMEOUT_S, socket_connect_timeout=max(timeout_s, 1.0),
            retry_on_timeout=False, retry=None)
        self._write_script = self._redis.register_script(WRITE_LUA)
        self._lookup_script = self._redis.register_script(_LOOKUP_LUA)
        self._ops = PendingWrites()
        self._ops_ready = asyncio.Event()
        self._writing = asyncio.Lock()  # one flush at a time: a later batch never lands before an earlier one
        self._healthy = False
        self._run_id: str | None = None
        self._needs_resync = False
        self._evicted_seen: int | None = None
        self._keys_count = 0
        self._tasks: list[asyncio.Task[None]] = []
        self._running = False
        self.metrics.bind_size(lambda: float("nan"), lambda: self._keys_count)
        self.redis_metrics.pending_writes.set_function(lambda: len(self._ops))
        self.redis_metrics.up.set(0)

    # ---- lifecycle -----------------------------------------------------------------------------
    async def start(self) -> None:
        """Check Redis once (a picker starts even when it is down: lookups then degrade) and start
        the writer and the health/memory poller."""
        await self._check_health()
        if self._healthy:
            await self._check_policy()
        self._running = True
        self._tasks = [asyncio.ensure_future(self._flush_loop()), asyncio.ensure_future(self._poll_loop())]

    async def stop(self) -> None:
        """Write what is queued (briefly, if Redis answers), stop the tasks, close the connections."""
        if self._healthy and self._ops:
            try:
                await asyncio.wait_for(self._flush_once(), 2.0)
            except (RedisError, OSError, TimeoutError):
                pass
        self._running = False
        self._ops_ready.set()  # wake the writer so it sees it must end
        pending = set(self._tasks)
        for _ in range(3):  # asyncio.wait_for may swallow a cancellation (Python < 3.12): ask again
            if not pending:
                break
            for task in pending:
                task.cancel()
            _, pending = await asyncio.wait(pending, timeout=1.0)
        self._tasks = []
        try:
            await asyncio.wait_for(self._redis.aclose(), 2.0)
        except (RedisError, OSError, TimeoutError):
            pass  # a connection that does not close cleanly is dropped with the client

    async def flush(self) -> None:
        """Write every queued operation now (tests and benchmarks; the writer task does it on its own)."""
        while self._ops:
            await self._flush_once()

    @property
    def healthy(self) -> bool:
        """Whether lookups ask Redis now (False: the circuit is open)."""
        return self._healthy

    def _redis_key(self, key: int) -> bytes:
        return self.prefix + key.to_bytes(8, "big")

    # ---- events (the engine map, its holder changes queued as Redis writes) -----------------------
    def apply_batch(self, endpoint: str, batch: DecodedBatch, model: str | None) -> ApplyStats:
        """Apply one decoded batch from `endpoint`'s publisher; its entry writes are queued."""
        stats = self._engine.apply(endpoint, batch, model)
        self._queued()
        return stats

    def _queued(self) -> None:
        if len(self._ops) > self.max_pending_writes:
            self.redis_metrics.dropped_writes.inc(len(self._ops))
            self._ops = PendingWrites()
            self._needs_resync = True
        if self._ops:
            self._ops_ready.set()

    def hold(self, endpoint: str, keys: Sequence[int], bits: int) -> None:
        """`endpoint` holds each of `keys` in the tiers of `bits` too: queue the bit sets."""
        self._ops.add(endpoint, keys, bits, 0)
        if self._spec:
            self._confirm_claims(endpoint, keys)

    def release(self, endpoint: str, keys: Iterable[int], bits: int) -> None:
        """`endpoint` no longer holds `keys` in the tiers of `bits`: queue the bit clears."""
        self._ops.add(endpoint, keys, 0, bits)

    def release_endpoint(self, endpoint: str, keys: Iterable[int]) -> int:
        """`endpoint` holds nothing any more: clear `keys` in every tier, drop this picker's claims on it."""
        keys = list(keys)
        self._ops.add(endpoint, keys, 0, ALL_TIERS)
        self._claims.forget_endpoint(endpoint)
        self._queued()
        return len(keys)

    async def _resync(self) -> None:
        """Write this picker's whole view again (after lost writes or a Redis that restarted empty),
        in slices that yield the loop and flush as they go (an engine map may hold millions of blocks)."""
        self._needs_resync = False
        self.redis_metrics.resyncs.inc()
        try:
            for endpoint in self._engine.endpoints():
                for held in self._engine.held(endpoint, _RESYNC_SLICE):  # ends if cleared meanwhile
                    for keys, mask in held:
                        self._ops.add(endpoint, keys, mask, 0)
                    if len(self._ops) >= 4 * self.write_chunk:
                        await self._flush_once()
                    else:
                        await asyncio.sleep(0)
        except (RedisError, OSError, TimeoutError) as exc:
            self._needs_resync = True
            self._mark_down("write", exc)
            return
        if self._ops:
            self._ops_ready.set()

    # ---- writing -------------------------------------------------------------------------------
    async def _flush_loop(self) -> None:
        while self._running:
            await self._ops_ready.wait()
            if not self._running:
                return
            if not self._healthy:
                await asyncio.sleep(self.health_interval_s)
                continue
            try:
                await self._flush_once()
            except (RedisError, OSError, TimeoutError) as exc:
                self._mark_down("write", exc)
            if not self._ops:
                self._ops_ready.clear()

    async def _flush_once(self) -> None:
        """Write the queued operations, one script call per `write_chunk` of them; on failure the
        unwritten ones go back under what was queued since (writes are idempotent)."""
        async with self._writing:
            await self._write_queued()

    async def _write_queued(self) -> None:
        taken, self._ops = self._ops, PendingWrites()
        pending = taken.items()
        chunk: list[tuple[str, int, int]] = []
        try:
            while True:
                chunk = list(itertools.islice(pending, self.write_chunk))
                if not chunk:
                    return
                await asyncio.wait_for(self._write_script(args=write_args(self.prefix, chunk)), _WRITE_TIMEOUT_S)
                self.redis_metrics.written.inc(len(chunk))
        except BaseException:
            newer, self._ops = self._ops, PendingWrites()
            for endpoint, key, op in itertools.chain(chunk, pending, newer.items()):
                self._ops.add(endpoint, (key,), op & 7, op >> 3)
            raise

    # ---- health ----------------------------------------------------------------------------------
    def _mark_down(self, op: str, exc: BaseException) -> None:
        self.redis_metrics.errors.labels(op).inc()
        if self._healthy:
            self._healthy = False
            self.redis_metrics.up.set(0)
            log.warning("Redis KV index at %s unavailable (%s: %r): precise prefix scores are off until it answers",
                        self.url, op, exc)

    async def _check_health(self) -> None:
        """Ping Redis; on the first answer after an outage close the circuit (and resync if needed)."""
        try:
            if not self._healthy:
                # Pooled connections opened before the outage may be dead (a restarted server):
                # start over, so the first lookups after recovery do not trip on them.
                await asyncio.wait_for(self._redis.connection_pool.disconnect(), max(self.timeout_s, 1.0))
            info = await asyncio.wait_for(self._redis.info("server"), max(self.timeout_s, 1.0))
        except (RedisError, OSError, TimeoutError) as exc:
            self._mark_down("health", exc)
            return
        run_id = info.get("run_id")
        if self._run_id is not None and run_id != self._run_id and self._engine.endpoints():
            log.warning("Redis KV index at %s restarted: writing this picker's engine maps again", self.url)
            self._needs_resync = True
        self._run_id = run_id
        if not self._healthy:
            self._healthy = True
            self.redis_metrics.up.set(1)
            log.info("Redis KV index at %s answers: precise prefix scores are on", self.url)
        if self._needs_resync:
            await self._resync()

    async def _check_policy(self) -> None:
        """Warn when Redis would grow without bound or refuse writes when full."""
        try:
            conf = await asyncio.wait_for(self._redis.config_get("maxmemory*"), max(self.timeout_s, 1.0))
        except (RedisError, OSError, TimeoutError):
            return  # CONFIG may be disabled (managed Redis): the operator's policy stands
        conf = {_text(k): _text(v) for k, v in conf.items()}
        maxmemory = int(conf.get("maxmemory") or 0)
        policy = conf.get("maxmemory-policy") or ""
        if maxmemory == 0 or not policy.startswith("allkeys"):
            log.warning("Redis KV index at %s: maxmemory=%s maxmemory-policy=%s; set maxmemory and "
                        "maxmemory-policy allkeys-lru so the index is bounded and evicts least recently used keys",
                        self.url, maxmemory, policy)

    async def _poll_loop(self) -> None:
        last_poll = float("-inf")
        while self._running:
            await asyncio.sleep(self.health_interval_s)
            if not self._healthy:
                await self._check_health()
                continue
            if time.monotonic() - last_poll >= self.poll_interval_s:
                last_poll = time.monotonic()
                await self._poll_memory()
            if self._healthy and self._needs_resync:  # writes dropped while Redis answered too slowly
                await self._resync()

    async def _poll_memory(self) -> None:
        """Memory, evictions and key count for the metrics; a run-id change means Redis restarted."""
        try:
            info = await asyncio.wait_for(self._redis.info("memory", "stats", "server"), max(self.timeout_s, 1.0))
            self._keys_count = await asyncio.wait_for(self._redis.dbsize(), max(self.timeout_s, 1.0))
        except (RedisError, OSError, TimeoutError) as exc:
            self._mark_down("poll", exc)
            return
        self.redis_metrics.used_memory.set(info.get("used_memory", 0))
        self.redis_metrics.maxmemory.set(info.get("maxmemory", 0))
        evicted = int(info.get("evicted_keys", 0))
        if self._evicted_seen is not None and evicted > self._evicted_seen:
            self.metrics.evictions.inc(evicted - self._evicted_seen)
        self._evicted_seen = evicted
        if self._run_id is not None and info.get("run_id") != self._run_id:
            await self._check_health()

    async def contents(self) -> dict[int, dict[str, frozenset[Tier]]]:
        """Every request key under this index's prefix with its endpoints and their tiers, as the
        in-memory index's `contents` (tests and debugging: O(entries), a SCAN of the prefix)."""
        found: dict[int, dict[str, frozenset[Tier]]] = {}
        async for name in self._redis.scan_iter(match=self.prefix + b"*", count=1_000):
            held = await self._redis.hgetall(name)
            if held:
                found[int.from_bytes(name[len(self.prefix):], "big")] = {
                    _text(ep): tiers_in(int(mask)) for ep, mask in held.items()}
        return found

    # ---- lookups ---------------------------------------------------------------------------------
    async def lookup_async(self, keys: Sequence[int], endpoints: Iterable[str] | None = None,
                           pool: str | None = None) -> dict[str, list[Tier]]:
        """Per endpoint, the best tier of each block in its longest run of keys from the start
        (one round trip); no match at all while Redis is down or slower than `timeout_s`."""
        if not keys:
            return {}
        if not self._healthy:
            self.redis_metrics.degraded_lookups.inc()
            return {}
        if self._claims.expiries:
            self._claims.purge(self._clock())
        spec_all = self._spec
        claims: list[str] = []  # per key from the first, the endpoints this picker claimed for it
        if spec_all:
            claims = ["\n".join(spec_all.get(key, ())) for key in keys]
            while claims and not claims[-1]:
                claims.pop()
        names = None if endpoints is None else list(endpoints)
        if names is not None and pool is not None:
            names = [n for n in names if self._pools.get(n, DEFAULT_POOL) == pool]
        if names is not None and not names:
            return {}
        try:
            reply = await asyncio.wait_for(
                self._lookup_script(args=[self.prefix, struct.pack(f">{len(keys)}Q", *keys),
                                          "\n".join(names or ()), *claims]),
                self.timeout_s)
        except (RedisError, OSError, TimeoutError) as exc:
            self._mark_down("lookup", exc)
            self.redis_metrics.degraded_lookups.inc()
            return {}
        matched = int(reply[0])
        self.metrics.record_lookup(matched, len(keys) - matched)
        tier_of = _RUN_TIER
        result: dict[str, list[Tier]] = {}
        for i in range(1, len(reply), 2):
            name = reply[i].decode()
            if pool is None or self._pools.get(name, DEFAULT_POOL) == pool:
                result[name] = [tier_of[c] for c in reply[i + 1]]  # type: ignore[misc]
        return result
