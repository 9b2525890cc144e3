"""The simulated engine: vLLM-v1-style continuous batching in simulated time.

Each step is one forward pass: running requests that finished prefill decode one token each
(one token of the step's token budget each), then prefill chunks of running and newly admitted
requests fill the rest of ``max_num_batched_tokens``. Waiting requests are admitted FCFS while
fewer than ``max_num_seqs`` run and their KV blocks fit (the head of the queue blocks the rest,
like vLLM). Blocks are allocated as vLLM's ``allocate_slots`` does: a prefill chunk's blocks in
the step that schedules it (evicting cached blocks then, and caching the blocks it fills at once,
BlockStored after that chunk's BlockRemoved), a decode block in the step whose token needs it.
Admission sets the rest of the request (later chunks and the whole output) aside, so those
allocations never fail and a request is never preempted: vLLM checks the same fit at admission
for the prompt only and preempts the newest running request when a later allocation finds no
room (a simplification kept here).

Time: simulated seconds advance by the profile's step time; wall time is simulated time times
``time_scale`` (> 1 slows everything uniformly). When requests are only decoding, the engine
jumps to the next finish in one sleep (woken early by an arrival or an abort), so CPU cost grows
with events, not with tokens; while a stream is decoding, a jump lasts at most ``stream_tick``
wall seconds (default 2 ms), so steps shorter than that reach streaming clients in small bursts
(slower profiles stream token by token). If the machine falls behind by more than
``lag_tolerance`` wall seconds, the simulated clock is resynchronised and ``lag_resyncs`` counts it.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import math
import time
from dataclasses import asdict, dataclass, field, replace

from epp.engine.kv_publisher import KVEventPublisher
from epp.engine.sim.hashing import NO_CONTEXT, HashContext, block_hashes, none_hash
from epp.engine.sim.kvcache import BlockInfo, KVCache, TierConfig
from epp.engine.sim.metrics import EngineMetrics
from epp.engine.sim.profiles import FAST, LatencyProfile


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Capacity and timing of one simulated replica (None: take the profile's value)."""

    profile: LatencyProfile = FAST
    num_gpu_blocks: int | None = None
    block_size: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    tiers: TierConfig = field(default_factory=TierConfig)
    time_scale: float = 1.0
    lag_tolerance: float = 0.05
    hash_seed: str | None = None
    stream_tick: float = 0.002

    def limits(self) -> EngineLimits:
        """The capacity configured, the profile's where the config leaves it None."""
        p = self.profile
        return EngineLimits(
            num_gpu_blocks=self.num_gpu_blocks or p.num_gpu_blocks,
            block_size=self.block_size or p.block_size,
            max_num_seqs=self.max_num_seqs or p.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens or p.max_num_batched_tokens,
            max_model_len=self.max_model_len or p.max_model_len,
        )

    def resolved(self) -> EngineConfig:
        """A copy with every None filled from the profile."""
        return replace(self, **asdict(self.limits()))


@dataclass(frozen=True, slots=True)
class EngineLimits:
    """The capacity one engine runs with (an `EngineConfig` with its Nones filled)."""

    num_gpu_blocks: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int


@dataclass(slots=True, eq=False)
class SimRequest:
    """One generation request as the engine tracks it."""

    request_id: str
    prompt_ids: list[int]
    max_tokens: int
    stream: bool = False
    ctx: HashContext = NO_CONTEXT
    natural_len: int | None = None
    hashes: list[bytes] = field(default_factory=list)
    output: list[int] = field(default_factory=list)
    held: list[BlockInfo] = field(default_factory=list)
    private: int = 0
    total_blocks: int = 0
    promised: int = 0  # blocks admission set aside (later prompt chunks, decode) not allocated yet
    allocated: int = 0  # blocks this request holds or has allocated (cached hits included)
    num_computed: int = 0
    num_cached_tokens: int = 0
    arrival: float = 0.0
    scheduled: float | None = None
    first_token: float | None = None
    finished_at: float | None = None
    finish_reason: str | None = None
    aborted: bool = False
    seed: int = 0
    waiter: asyncio.Future | None = None
    # P/D (see engine/sim/pd.py): prompt tokens whose KV a remote prefiller sent (decode side), and
    # how long, in simulated seconds, a finished prefill keeps its blocks for the decoder to pull.
    remote_tokens: int = 0
    hold_for_transfer: float = 0.0

    @property
    def finished(self) -> bool:
        """Whether the request left the engine (done or aborted)."""
        return self.finish_reason is not None

    @property
    def target_len(self) -> int:
        """How many tokens it will generate."""
        return self.max_tokens if self.natural_len is None else min(self.max_tokens, self.natural_len)

    def notify(self) -> None:
        """Wake whoever awaits new tokens or the end."""
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)


class EngineError(ValueError):
    """A request the engine cannot serve (too long for the model or the KV cache)."""


class SimEngine:
    """One simulated vLLM engine: scheduler, KV cache, clock, metrics and KV events."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        output_token_pool: list[int],
        publisher: KVEventPublisher | None = None,
        metrics: EngineMetrics | None = None,
    ) -> None:
        self.config = config.resolved()
        c = self.config
        self.profile = c.profile
        self.slowdown = 1.0  # set_speed: the current profile is the configured one this much slower
        self.limits = config.limits()
        self.block_size = self.limits.block_size
        # Like vLLM's BlockPool, one block is the reserved null block: usable = num_gpu_blocks - 1.
        self.cache = KVCache(self.limits.num_gpu_blocks - 1, self.block_size, c.tiers)
        self.publisher = publisher
        self.metrics = metrics or EngineMetrics()
        self.waiting: collections.deque[SimRequest] = collections.deque()
        self.running: list[SimRequest] = []
        self.sleep_level = 0
        self.sleeping = False
        self.lag_resyncs = 0
        self.steps = 0
        self._pool = output_token_pool
        self._root = none_hash(c.hash_seed)
        self._ids = itertools.count()
        self._clock = 0.0
        self._t0 = 0.0
        self._wake: asyncio.Future | None = None
        self._task: asyncio.Task | None = None
        self._stopped = False
        # Finished prefills whose blocks wait for a decoder's pull: request id -> (held, private).
        self.transfers: dict[str, tuple[list[BlockInfo], int]] = {}

    # -- public API --------------------------------------------------------------------------
    def start(self) -> None:
        """Start the scheduler loop on the running event loop."""
        loop = asyncio.get_running_loop()
        self._t0 = loop.time()
        self._task = loop.create_task(self._run(), name="sim-engine")

    async def stop(self) -> None:
        """Stop the loop; unfinished requests end with finish_reason "abort"."""
        self._stopped = True
        self._interrupt()
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        for r in list(self.running) + list(self.waiting):
            self._finish(r, "abort")
        self.running.clear()
        self.waiting.clear()

    def now(self) -> float:
        """Current simulated time in seconds."""
        return (asyncio.get_running_loop().time() - self._t0) / self.config.time_scale

    def new_request(
        self,
        prompt_ids: list[int],
        max_tokens: int | None,
        *,
        stream: bool = False,
        ctx: HashContext = NO_CONTEXT,
        natural_len: int | None = None,
        request_id: str | None = None,
    ) -> SimRequest:
        """Validate and build a request (raises EngineError like vLLM's 400s)."""
        n = len(prompt_ids)
        max_len = self.limits.max_model_len
        if n == 0:
            raise EngineError("The prompt cannot be empty.")
        if n >= max_len:
            raise EngineError(
                f"This model's maximum context length is {max_len} tokens. However, your request has "
                f"{n} input tokens. Please reduce the length of the input messages.")
        if max_tokens is None:
            max_tokens = max_len - n
        elif max_tokens < 1:
            raise EngineError(f"max_tokens must be at least 1, got {max_tokens}.")
        elif n + max_tokens > max_len:
            raise EngineError(
                f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's maximum "
                f"context length is {max_len} tokens and your request has {n} input tokens "
                f"({max_tokens} > {max_len} - {n}).")
        r = SimRequest(request_id=request_id or f"sim-{next(self._ids)}", prompt_ids=prompt_ids,
                       max_tokens=max_tokens, stream=stream, ctx=ctx, natural_len=natural_len)
        bs = self.block_size
        r.total_blocks = -(-(n + r.target_len) // bs)
        if r.total_blocks > self.cache.capacity:
            raise EngineError(
                f"The request needs {r.total_blocks} KV blocks but the cache has {self.cache.capacity}.")
        r.hashes = block_hashes(prompt_ids, bs, ctx, root=self._root)
        r.seed = hash(tuple(prompt_ids)) & 0x7FFF_FFFF
        return r

    def submit(self, r: SimRequest) -> None:
        """Queue a request for scheduling."""
        r.arrival = self.now()
        self.waiting.append(r)
        self._interrupt()

    def abort(self, r: SimRequest) -> None:
        """Stop a request early (client gone); frees its blocks at the next step boundary."""
        if r.finished or r.aborted:
            return
        r.aborted = True
        if r.scheduled is None:
            try:
                self.waiting.remove(r)
            except ValueError:
                pass
            self._finish(r, "abort")
        self._interrupt()

    def sleep(self, level: int = 1) -> None:
        """Pause scheduling; abort running requests; level >= 1 also drops the KV cache."""
        self.sleeping = True
        self.sleep_level = level
        for r in self.running:
            r.aborted = True
        if level >= 1:
            self._sweep_finished()
            self.cache.clear()
            self._publish()
        self._interrupt()

    def wake_up(self) -> None:
        """Resume scheduling."""
        self.sleeping = False
        self.sleep_level = 0
        self._interrupt()

    def set_speed(self, slowdown: float) -> None:
        """Run every later step `slowdown` times slower than the configured profile (1 = as configured).

        A mid-run change of the replica's speed, like a GPU that throttles or a noisy neighbour:
        benchmarks and tests use it to check that a router's learned costs follow.
        """
        if not (slowdown > 0 and math.isfinite(slowdown)):
            raise ValueError(f"slowdown must be a finite number > 0, got {slowdown!r}")
        base = self.config.profile
        self.profile = base if slowdown == 1 else base.scaled(slowdown)
        self.slowdown = slowdown

    def reset_prefix_cache(self) -> None:
        """Drop every cached block (AllBlocksCleared)."""
        self.cache.clear()
        self._publish()

    # -- scheduler loop ------------------------------------------------------------------------
    def _interrupt(self) -> None:
        w = self._wake
        if w is not None and not w.done():
            w.set_result(True)

    def _wall(self, t_sim: float) -> float:
        return self._t0 + t_sim * self.config.time_scale

    async def _wait(self, until_sim: float | None) -> bool:
        """Sleep until `until_sim` (None: forever); True if interrupted early."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._wake = fut
        handle = None if until_sim is None else loop.call_at(self._wall(until_sim), _resolve_false, fut)
        try:
            return await fut
        finally:
            self._wake = None
            if handle is not None:
                handle.cancel()

    async def _sleep_until(self, until_sim: float) -> None:
        loop = asyncio.get_running_loop()
        delay = self._wall(until_sim) - loop.time()
        # The selector sleeps in whole milliseconds (rounded up), so sleeping for a sub-ms step
        # would stretch every step to 1 ms and the clock would drift. Steps due within the timer
        # resolution run now instead (early by < 1 ms); later sleeps absorb the difference, so
        # the simulated clock stays within about 1 ms of the wall clock.
        await asyncio.sleep(delay if delay >= _TIMER_RESOLUTION else 0)

    async def _run(self) -> None:
        while not self._stopped:
            self._sweep_finished()
            if self.sleeping or (not self.running and not self.waiting):
                await self._wait(None)
                continue
            self._sync_clock()
            load_time = self._admit()
            if not self.running:
                await self._wait(None)  # the head waits for room no finish will ever free
                continue
            prefill: list[tuple[SimRequest, int]] = []
            decoding: list[SimRequest] = []
            budget = self.limits.max_num_batched_tokens
            for r in self.running:
                if r.num_computed >= len(r.prompt_ids):
                    decoding.append(r)
                    budget -= 1
            for r in self.running:
                if r.num_computed < len(r.prompt_ids) and budget > 0:
                    chunk = min(len(r.prompt_ids) - r.num_computed, budget)
                    prefill.append((r, chunk))
                    budget -= chunk
                    # vLLM's allocate_slots when it schedules the chunk: its blocks now, and the
                    # blocks it fills are cached (BlockStored) before the forward pass runs.
                    self._allocate(r, r.num_computed + chunk)
                    self._cache_full_blocks(r, r.num_computed + chunk)
            prefill_tokens = sum(c for _, c in prefill)
            context = sum(r.num_computed for r, _ in prefill)  # KV each chunk's attention reads (before it)
            step = max(self.profile.step_time(prefill_tokens, len(decoding), load_time, context), 1e-9)
            start = self._clock
            # Whatever still waits after _admit stays blocked until a finish or an arrival, and
            # both end a jump early, so a batch of pure decodes can jump to its next finish.
            # Streams jump at most `stream_tick` of wall time, so their tokens keep flowing.
            steady = not prefill and decoding
            if steady:
                k = min(r.target_len - len(r.output) for r in decoding)
                if any(r.stream for r in decoding):
                    k = min(k, max(1, int(self.config.stream_tick / (step * self.config.time_scale))))
                n = k
                if k > 1 and await self._wait(start + k * step):
                    elapsed = self.now() - start
                    n = min(k, int(elapsed // step) + 1)
                    await self._sleep_until(start + n * step)
                elif k <= 1:
                    await self._sleep_until(start + step)
                self._clock = start + n * step
                self.steps += n
                self._decode(decoding, n, step)
                self.metrics.iteration_tokens.observe(len(decoding), n)
            else:
                await self._sleep_until(start + step)
                self._clock = start + step
                self.steps += 1
                self._decode(decoding, 1, step)
                self._prefill(prefill)
                self.metrics.iteration_tokens.observe(prefill_tokens + len(decoding))
            self._sweep_finished()
            self._publish()

    def _sync_clock(self) -> None:
        now = self.now()
        if not self.running:
            self._clock = max(self._clock, now)
        elif (now - self._clock) * self.config.time_scale > self.config.lag_tolerance:
            self._clock = now
            self.lag_resyncs += 1

    def _admit(self) -> float:
        """Admit waiting requests that fit; returns the load time of blocks promoted from tiers."""
        if self.sleeping:
            return 0.0
        load = 0.0
        bs = self.block_size
        p = self.profile
        m = self.metrics
        max_seqs = self.limits.max_num_seqs
        while self.waiting and len(self.running) < max_seqs:
            r = self.waiting[0]
            if r.aborted:
                self.waiting.popleft()
                continue
            n = len(r.prompt_ids)
            # vLLM never counts the last prompt token as a hit: it must be computed to sample.
            hit = self.cache.lookup(r.hashes[: (n - 1) // bs])
            if not self.cache.can_admit(hit, r.total_blocks):
                break
            self.waiting.popleft()
            # Only the hits are held now; every other block is set aside and allocated (evicting
            # if need be) in the step that first needs it: a chunk's when it is scheduled, a
            # decode token's when it is fed back.
            r.held = self.cache.admit(hit, hit.num_blocks, promise=r.total_blocks - hit.num_blocks)
            r.private = hit.num_blocks - len(r.held)
            r.promised = r.total_blocks - hit.num_blocks
            r.allocated = hit.num_blocks
            r.num_cached_tokens = hit.num_blocks * bs
            r.num_computed = r.num_cached_tokens
            if r.remote_tokens > r.num_computed:
                # KV received from the prefiller: committed (BlockStored) like computed blocks.
                r.num_computed = r.remote_tokens
                self._allocate(r, r.remote_tokens)
                self._cache_full_blocks(r, r.remote_tokens)
            r.scheduled = self._clock
            gpu_hit = len(hit.gpu) * bs
            m.prefix_cache_queries += n
            m.prefix_cache_hits += gpu_hit
            if self.cache.cpu is not None or self.cache.disk is not None:
                m.external_prefix_cache_queries += n - gpu_hit
                m.external_prefix_cache_hits += (len(hit.cpu) + len(hit.disk)) * bs
            m.cached_by_source["device"] += gpu_hit
            m.cached_by_source["host"] += len(hit.cpu) * bs
            m.cached_by_source["disk"] += len(hit.disk) * bs
            load += len(hit.cpu) * bs * p.cpu_load_per_token + len(hit.disk) * bs * p.disk_load_per_token
            m.queue_time.observe(max(0.0, self._clock - r.arrival))
            self.running.append(r)
        return load

    def _token(self, r: SimRequest, i: int) -> int:
        pool = self._pool
        return pool[(r.seed + i * 7919) % len(pool)]

    def _prefill(self, plan: list[tuple[SimRequest, int]]) -> None:
        for r, chunk in plan:
            if r.aborted:
                continue
            r.num_computed += chunk
            if r.num_computed >= len(r.prompt_ids):
                r.output.append(self._token(r, 0))
                r.first_token = self._clock
                self.metrics.ttft.observe(max(0.0, self._clock - r.arrival))
                self._after_token(r)

    def _decode(self, decoding: list[SimRequest], n: int, step: float) -> None:
        if not decoding:
            return
        self.metrics.itl.observe(step, n * len(decoding))
        for r in decoding:
            if r.aborted:
                continue
            start = len(r.output)
            r.output.extend(self._token(r, i) for i in range(start, start + n))
            # KV of a token exists once it has been fed back: all but the newest one.
            self._allocate(r, len(r.prompt_ids) + len(r.output) - 1)
            self._cache_full_blocks(r, len(r.prompt_ids) + len(r.output) - 1)
            self._after_token(r)

    def _after_token(self, r: SimRequest) -> None:
        if len(r.output) >= r.target_len:
            self._finish(r, "length" if len(r.output) >= r.max_tokens else "stop")
        elif r.stream:
            r.notify()

    def _allocate(self, r: SimRequest, kv_tokens: int) -> None:
        """Allocate the promised blocks that `kv_tokens` tokens of KV now need (a scheduled
        prefill chunk's, or a decode token's).

        A prompt that fills its last block exactly gets the first decode token's block here, in
        the first decode step: its eviction is published one step after the prefill's events,
        in a batch of removals only, like vLLM's.
        """
        need = min(-(-kv_tokens // self.block_size) - r.allocated, r.promised)
        if need > 0:
            self.cache.allocate_promised(need)
            r.promised -= need
            r.private += need
            r.allocated += need

    def _cache_full_blocks(self, r: SimRequest, computed_tokens: int) -> None:
        bs = self.block_size
        full = computed_tokens // bs
        have = len(r.held)
        if full <= have:
            return
        tokens = r.prompt_ids + r.output if r.output else r.prompt_ids
        if len(r.hashes) < full:
            r.hashes = block_hashes(tokens[: full * bs], bs, r.ctx, known=r.hashes, root=self._root)
        new = []
        for i in range(have, full):
            new.append(BlockInfo(
                digest=r.hashes[i], parent=r.hashes[i - 1] if i else None,
                tokens=tuple(tokens[i * bs:(i + 1) * bs]), extra=r.ctx.event_extra_keys(i),
                lora_name=r.ctx.lora_name))
        r.held.extend(self.cache.commit(new))
        r.private -= len(new)

    def _finish(self, r: SimRequest, reason: str) -> None:
        if r.finished:
            return
        r.finish_reason = reason
        r.finished_at = self._clock
        if r.scheduled is not None:
            if r.hold_for_transfer > 0 and reason != "abort":
                self.cache.release([], 0, r.promised)  # unallocated decode blocks go now; the prompt's wait
                self._hold_for_transfer(r)
            else:
                self.cache.release(r.held, r.private, r.promised)
            r.held = []
            r.private = 0
            r.promised = 0
        m = self.metrics
        m.request_success[reason] = m.request_success.get(reason, 0) + 1
        m.prompt_tokens += len(r.prompt_ids)
        m.generation_tokens += len(r.output)
        if reason != "abort":
            m.e2e.observe(max(0.0, self._clock - r.arrival))
        r.notify()

    def _hold_for_transfer(self, r: SimRequest) -> None:
        """Keep a finished prefill's blocks until the decoder pulls them or the window ends."""
        self.transfers[r.request_id] = (r.held, r.private)
        loop = asyncio.get_running_loop()
        loop.call_later(r.hold_for_transfer * self.config.time_scale, self.release_transfer, r.request_id)

    def release_transfer(self, request_id: str) -> bool:
        """Free the blocks a finished prefill kept for `request_id`; False if none are kept (any more)."""
        kept = self.transfers.pop(request_id, None)
        if kept is None:
            return False
        self.cache.release(*kept)
        self._interrupt()  # freed blocks may admit a waiting request
        return True

    def _sweep_finished(self) -> None:
        if any(r.aborted or r.finished for r in self.running):
            for r in self.running:
                if r.aborted:
                    self._finish(r, "abort")
            self.running = [r for r in self.running if not r.finished]

    def _publish(self) -> None:
        events = self.cache.take_events()
        if events and self.publisher is not None:
            self.publisher.publish(events, ts=time.time())


_TIMER_RESOLUTION = 1e-3


def _resolve_false(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(False)
