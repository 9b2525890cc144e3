"""The simulated KV cache: a GPU block pool with prefix caching, and optional CPU / disk tiers.

GPU pool (like vLLM's ``BlockPool``): a physical block is either *private* (reserved by a
running request, not yet full or not hashed) or *cached* (full, hashed, shared by reference
count). Cached blocks whose reference count drops to 0 stay cached in an LRU free list and are
evicted lazily, oldest first, only when an allocation needs the room; blocks still referenced
are never evicted. A request frees its blocks tail first, so chains lose their tails first.

Tiers (like vLLM's offloading connector; events self-describing by default, or vLLM's default
hash-only placeholders with ``self_describing_events=False``): every block cached on
the GPU is copied to the CPU tier, and from there to disk (write-through, or on CPU eviction);
the CPU tier evicts LRU, the disk tier evicts by access time from its high watermark down to its
low watermark. Lookup goes GPU -> CPU -> disk along the request's block chain; blocks found in
a lower tier are promoted (loaded into GPU blocks, disk hits also copied back to the CPU tier).

Every change produces vLLM KV events, collected in ``events`` until the engine publishes them.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from epp.engine.kv_publisher import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    MEDIUM_STORAGE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
)
from epp.engine.sim.hashing import external_hash


@dataclass(slots=True, eq=False)
class BlockInfo:
    """What a tier knows about one cached block (enough to describe it in an event)."""

    digest: bytes
    parent: bytes | None
    tokens: tuple[int, ...]
    extra: tuple[Any, ...] | None
    lora_name: str | None = None
    ref: int = 0


@dataclass(frozen=True, slots=True)
class TierConfig:
    """Capacities (in blocks) and policies of the offload tiers; 0 disables a tier."""

    cpu_blocks: int = 0
    disk_blocks: int = 0
    disk_high_watermark: float = 0.85
    disk_low_watermark: float = 0.50
    disk_write_through: bool = True
    disk_medium: str = MEDIUM_STORAGE
    self_describing_events: bool = True


def _removed_events(digests: list[bytes], medium: str) -> list[KVEvent]:
    """BlockRemoved events, one per block as vLLM's block pool emits them on eviction."""
    return [BlockRemoved(block_hashes=[external_hash(d)], medium=medium, group_idx=0) for d in digests]


def _placeholder_events(blocks: list[BlockInfo], medium: str) -> list[KVEvent]:
    """vLLM's default offload events: one per block, hash only (no tokens, no parent, size 0)."""
    return [BlockStored(block_hashes=[external_hash(b.digest)], parent_block_hash=None, token_ids=[], block_size=0,
                        lora_id=None, medium=medium, lora_name=None, group_idx=0) for b in blocks]


def _stored_events(blocks: list[BlockInfo], medium: str, block_size: int,
                   self_describing: bool = True) -> list[KVEvent]:
    """BlockStored events for `blocks`, one per contiguous parent chain run."""
    if not self_describing:
        return _placeholder_events(blocks, medium)
    out: list[KVEvent] = []
    run: list[BlockInfo] = []
    for b in blocks:
        if run and (b.parent != run[-1].digest or b.lora_name != run[0].lora_name):
            out.append(_one_stored(run, medium, block_size))
            run = []
        run.append(b)
    if run:
        out.append(_one_stored(run, medium, block_size))
    return out


def _one_stored(run: list[BlockInfo], medium: str, block_size: int) -> BlockStored:
    tokens: list[int] = []
    for b in run:
        tokens.extend(b.tokens)
    parent = run[0].parent
    return BlockStored(
        block_hashes=[external_hash(b.digest) for b in run],
        parent_block_hash=None if parent is None else external_hash(parent),
        token_ids=tokens,
        block_size=block_size,
        lora_id=None,
        medium=medium,
        lora_name=run[0].lora_name,
        extra_keys=[b.extra for b in run],
        group_idx=0,
        kv_cache_spec_kind="full_attention",
    )


@dataclass(slots=True)
class LookupResult:
    """Where the leading blocks of a request were found."""

    gpu: list[BlockInfo] = field(default_factory=list)
    cpu: list[BlockInfo] = field(default_factory=list)
    disk: list[BlockInfo] = field(default_factory=list)

    @property
    def num_blocks(self) -> int:
        """Blocks found in any tier (a prefix of the request's chain)."""
        return len(self.gpu) + len(self.cpu) + len(self.disk)


class CpuTier:
    """Host-memory offload tier: LRU over a fixed number of blocks."""

    def __init__(self, capacity: int, events: list[KVEvent], block_size: int, self_describing: bool = True) -> None:
        self.capacity = capacity
        self._self_describing = self_describing
        self.blocks: OrderedDict[bytes, BlockInfo] = OrderedDict()
        self._events = events
        self._block_size = block_size
        self.evicted = 0

    def store(self, blocks: list[BlockInfo]) -> list[BlockInfo]:
        """Copy `blocks` in; returns the blocks evicted to make room (oldest first)."""
        new: list[BlockInfo] = []
        evicted: list[BlockInfo] = []
        for b in blocks:
            if b.digest in self.blocks:
                self.blocks.move_to_end(b.digest)
                continue
            while len(self.blocks) >= self.capacity:
                _, old = self.blocks.popitem(last=False)
                evicted.append(old)
            self.blocks[b.digest] = BlockInfo(b.digest, b.parent, b.tokens, b.extra, b.lora_name)
            new.append(b)
        if evicted:
            self.evicted += len(evicted)
            self._events.extend(_removed_events([b.digest for b in evicted], MEDIUM_CPU))
        self._events.extend(_stored_events(new, MEDIUM_CPU, self._block_size, self._self_describing))
        return evicted

    def touch(self, digest: bytes) -> None:
        """Mark a block as just used (LRU)."""
        self.blocks.move_to_end(digest)

    def clear(self) -> None:
        """Drop everything (no events: the caller announces AllBlocksCleared)."""
        self.blocks.clear()


class DiskTier:
    """Disk offload tier: evicts least recently accessed blocks from high to low watermark."""

    def __init__(self, config: TierConfig, events: list[KVEvent], block_size: int) -> None:
        self.capacity = config.disk_blocks
        self.high = max(1, int(config.disk_high_watermark * self.capacity))
        self.low = int(config.disk_low_watermark * self.capacity)
        self.medium = config.disk_medium
        self._self_describing = config.self_describing_events
        self.blocks: dict[bytes, BlockInfo] = {}
        self.atime: dict[bytes, int] = {}
        self._clock = 0
        self._events = events
        self._block_size = block_size
        self.evicted = 0
        self.evictions_runs = 0

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def store(self, blocks: list[BlockInfo]) -> None:
        """Write `blocks` (those not already on disk), then enforce the watermarks."""
        new = []
        for b in blocks:
            if b.digest in self.blocks:
                self.atime[b.digest] = self._tick()
                continue
            self.blocks[b.digest] = BlockInfo(b.digest, b.parent, b.tokens, b.extra, b.lora_name)
            self.atime[b.digest] = self._tick()
            new.append(b)
        self._events.extend(_stored_events(new, self.medium, self._block_size, self._self_describing))
        if len(self.blocks) > self.high:
            self._evict_to_low()

    def touch(self, digest: bytes) -> None:
        """Record an access (a lookup hit)."""
        self.atime[digest] = self._tick()

    def _evict_to_low(self) -> None:
        victims = sorted(self.atime, key=self.atime.__getitem__)[: len(self.blocks) - self.low]
        for d in victims:
            del self.blocks[d]
            del self.atime[d]
        self.evicted += len(victims)
        self.evictions_runs += 1
        self._events.extend(_removed_events(victims, self.medium))

    def clear(self) -> None:
        """Drop everything (no events: the caller announces AllBlocksCleared)."""
        self.blocks.clear()
        self.atime.clear()


class KVCache:
    """The GPU block pool plus optional tiers; all counts are in blocks."""

    def __init__(self, num_gpu_blocks: int, block_size: int, tiers: TierConfig = TierConfig()) -> None:
        self.capacity = num_gpu_blocks
        self.block_size = block_size
        self.cached: dict[bytes, BlockInfo] = {}
        self.free_lru: OrderedDict[bytes, None] = OrderedDict()
        self.private = 0
        self.promised = 0  # blocks set aside for running requests' later prefill chunks and decode tokens
        self.events: list[KVEvent] = []
        self.gpu_evicted = 0
        self.tiers = tiers
        self.cpu = (CpuTier(tiers.cpu_blocks, self.events, block_size, tiers.self_describing_events)
                    if tiers.cpu_blocks > 0 else None)
        self.disk = DiskTier(tiers, self.events, block_size) if tiers.disk_blocks > 0 else None

    # -- accounting ------------------------------------------------------------------------
    @property
    def used_blocks(self) -> int:
        """Blocks held by running requests (referenced cached blocks + private blocks)."""
        return len(self.cached) - len(self.free_lru) + self.private

    @property
    def usage(self) -> float:
        """vLLM's kv_cache_usage_perc: the fraction of blocks not free (0..1)."""
        return self.used_blocks / self.capacity if self.capacity else 0.0

    def available(self) -> int:
        """Blocks an allocation could get now (never-used + evictable cached, less those promised)."""
        return self.capacity - self.used_blocks - self.promised

    # -- lookup ----------------------------------------------------------------------------
    def lookup(self, hashes: list[bytes]) -> LookupResult:
        """The longest prefix of `hashes` held by GPU, then CPU, then disk (no side effects)."""
        result = LookupResult()
        i = 0
        n = len(hashes)
        while i < n and hashes[i] in self.cached:
            result.gpu.append(self.cached[hashes[i]])
            i += 1
        while i < n:
            d = hashes[i]
            if self.cpu is not None and d in self.cpu.blocks:
                if result.disk:
                    break  # promotion runs CPU blocks before disk blocks; keep the prefix simple
                result.cpu.append(self.cpu.blocks[d])
            elif self.disk is not None and d in self.disk.blocks:
                result.disk.append(self.disk.blocks[d])
            else:
                break
            i += 1
        return result

    def can_admit(self, hit: LookupResult, total_blocks: int) -> bool:
        """Whether a request needing `total_blocks` blocks fits, given its GPU hits."""
        revived = sum(1 for b in hit.gpu if b.ref == 0)
        return total_blocks - len(hit.gpu) <= self.available() - revived

    def admit(self, hit: LookupResult, total_blocks: int, promise: int = 0) -> list[BlockInfo]:
        """Reference the GPU hits, reserve the rest of `total_blocks`, set `promise` more aside for
        later (`allocate_promised`), promote tier hits; returns held blocks."""
        held = []
        for b in hit.gpu:
            if b.ref == 0:
                del self.free_lru[b.digest]
            b.ref += 1
            held.append(b)
        self._reserve(total_blocks - len(hit.gpu))
        self.promised += promise
        promoted = hit.cpu + hit.disk
        if promoted:
            if self.cpu is not None:
                for b in hit.cpu:
                    self.cpu.touch(b.digest)
            if self.disk is not None:
                for b in hit.disk:
                    self.disk.touch(b.digest)
            held.extend(self.commit(promoted, offload=False))
            if hit.disk and self.cpu is not None:
                self._to_cpu(hit.disk)
        return held

    def _reserve(self, n: int) -> None:
        short = n - (self.capacity - len(self.cached) - self.private)
        if short > 0:
            victims = []
            for _ in range(short):
                digest, _ = self.free_lru.popitem(last=False)
                victims.append(digest)
                del self.cached[digest]
            self.gpu_evicted += len(victims)
            self.events.extend(_removed_events(victims, MEDIUM_GPU))
        self.private += n

    def allocate_promised(self, n: int) -> None:
        """Turn `n` promised blocks into allocated private ones, evicting cached blocks if need be."""
        self.promised -= n
        self._reserve(n)

    def commit(self, blocks: list[BlockInfo], *, offload: bool = True) -> list[BlockInfo]:
        """Turn private blocks that just became full into cached ones (BlockStored GPU).

        A block whose hash is already cached (computed concurrently by another request) is
        shared instead, and its private block returned to the pool.
        """
        held: list[BlockInfo] = []
        new: list[BlockInfo] = []
        for b in blocks:
            self.private -= 1
            existing = self.cached.get(b.digest)
            if existing is not None:
                if existing.ref == 0:
                    del self.free_lru[existing.digest]
                existing.ref += 1
                held.append(existing)
                continue
            blk = BlockInfo(b.digest, b.parent, b.tokens, b.extra, b.lora_name, ref=1)
            self.cached[b.digest] = blk
            held.append(blk)
            new.append(blk)
        self.events.extend(_stored_events(new, MEDIUM_GPU, self.block_size))
        if offload and new and self.cpu is not None:
            self._to_cpu(new)
        elif offload and new and self.disk is not None:
            self.disk.store(new)
        return held

    def _to_cpu(self, blocks: list[BlockInfo]) -> None:
        assert self.cpu is not None
        evicted = self.cpu.store(blocks)
        if self.disk is not None:
            if self.tiers.disk_write_through:
                self.disk.store(blocks)
            elif evicted:
                self.disk.store(evicted)

    def release(self, held: list[BlockInfo], private: int, promised: int = 0) -> None:
        """A request is done: drop its references (tail first), its private and promised blocks."""
        self.private -= private
        self.promised -= promised
        for b in reversed(held):
            b.ref -= 1
            if b.ref == 0:
                if self.cached.get(b.digest) is b:
                    self.free_lru[b.digest] = None
                else:
                    self.private -= 1  # orphaned by clear(): its physical block is free now

    def clear(self) -> None:
        """Reset every tier (sleep / reset_prefix_cache): one AllBlocksCleared event."""
        for digest in list(self.free_lru):
            del self.cached[digest]
        self.free_lru.clear()
        # Blocks still referenced by running requests lose their hash identity, like vLLM's reset;
        # they stay allocated (as private) until their last holder releases them.
        self.private += len(self.cached)
        self.cached.clear()
        if self.cpu is not None:
            self.cpu.clear()
        if self.disk is not None:
            self.disk.clear()
        self.events.append(AllBlocksCleared())

    def take_events(self) -> list[KVEvent]:
        """The events produced since the last call."""
        if not self.events:
            return []
        out = list(self.events)
        self.events.clear()
        return out
