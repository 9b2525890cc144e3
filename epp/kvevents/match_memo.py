"""The KV-index match of a prompt's previous turn, so that the next turn walks only its new blocks.

A lookup walks every block of a prompt (~3,000 for a 200 KB conversation) to find, per endpoint,
the run of blocks it holds from the start. The next turn of the conversation repeats those
blocks: its runs are the previous runs, cut to the blocks both turns share, then continued by a
walk of the new blocks only. Holders change with KV events, so a remembered run is used only
  - while the endpoint still holds its first and its last block (two one-block lookups: vLLM
    frees a finished request's blocks tail first, so a run that lost a block has lost its tail),
  - for at most `max_age_s` after the full walk it came from (then the next turn walks in full,
    which also refreshes every block's recency in the index),
and an endpoint that holds the first block now but was not in the remembered runs is walked in
full. What it cannot see: a block inside a run that the index dropped or moved to another tier
while the run's ends stayed (both rare; bounded by `max_age_s`).

Entries are keyed by the prompt's last block key (a chain key: it names the whole prompt), hold
one byte per block and endpoint (the best tier), and are bounded by `capacity_bytes`, least
recently used first; a turn's entry replaces its previous turn's.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge

from epp.kvevents.decoding import Tier

# lookup(keys, endpoints) -> per endpoint, the best tier of each block of its run from keys[0]
Lookup = Callable[[Sequence[int], Sequence[str]], Awaitable[Mapping[str, Sequence[Tier]]]]
_ENTRY_OVERHEAD = 200  # bytes of an entry beside its runs (dict slots, the key, the timestamp)


class MatchMemoMetrics:
    """Lookups by how they were answered, entries dropped, bytes held."""

    def __init__(self, registry: CollectorRegistry | None, prefix: str = "epp_kv_match_memo") -> None:
        kw = {"registry": registry}
        self.lookups = Counter(f"{prefix}_lookups", "Prompt lookups, by walk (full, incremental)", ["walk"], **kw)
        self.evictions = Counter(f"{prefix}_evictions", "Remembered matches dropped to stay within the budget", **kw)
        self.bytes = Gauge(f"{prefix}_bytes", "Bytes held by remembered matches", **kw)
        self._full, self._incremental = self.lookups.labels("full"), self.lookups.labels("incremental")


@dataclass(slots=True)
class _Match:
    walked_at: float  # monotonic time of the full walk these runs come from
    runs: dict[str, bytes]  # endpoint -> best tier of each block of its run
    size: int


class MatchMemo:
    """Per-endpoint runs of recent prompts, continued for prompts that extend them (see the module)."""

    def __init__(self, capacity_bytes: int, max_age_s: float, *, metrics: MatchMemoMetrics | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.capacity_bytes = capacity_bytes
        self.max_age_s = max_age_s
        self.metrics = metrics or MatchMemoMetrics(None)
        self._clock = clock
        self._entries: OrderedDict[int, _Match] = OrderedDict()
        self._bytes = 0
        self.metrics.bytes.set_function(lambda: self._bytes)

    @property
    def bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    async def match(self, lookup: Lookup, keys: Sequence[int], endpoints: Sequence[str],
                    previous_last_key: int | None, shared_blocks: int) -> dict[str, bytes]:
        """Per endpoint, the best tier (a byte) of each block of its run from the start of `keys`.

        `previous_last_key`: the last key of the prompt this one repeats `shared_blocks` blocks of (None: none).
        """
        now = self._clock()
        known = self._take(previous_last_key) if previous_last_key is not None and shared_blocks else None
        if known is None or now - known.walked_at > self.max_age_s:
            self.metrics._full.inc()
            found = await lookup(keys, endpoints)
            runs = {ep: bytes(tiers) for ep, tiers in found.items()}
            walked_at = now
        else:
            self.metrics._incremental.inc()
            runs = await self._continue(lookup, keys, endpoints, known.runs, shared_blocks)
            walked_at = known.walked_at
        if keys:
            self._put(keys[-1], _Match(walked_at, runs, _ENTRY_OVERHEAD + sum(map(len, runs.values()))))
        return runs

    async def _continue(self, lookup: Lookup, keys: Sequence[int], endpoints: Sequence[str],
                        known: dict[str, bytes], shared: int) -> dict[str, bytes]:
        runs: dict[str, bytes] = {}
        walk_in_full: list[str] = []
        for ep in await lookup(keys[:1], endpoints):  # who holds the first block now
            run = known.get(ep, b"")[:shared]
            if not run:
                walk_in_full.append(ep)
                continue
            last = len(run)
            if len(run) > 1 and ep not in await lookup(keys[last - 1:last], (ep,)):
                walk_in_full.append(ep)  # lost the end of its run: where it ends now takes a walk
                continue
            more = (await lookup(keys[last:], (ep,))).get(ep, ()) if last < len(keys) else ()
            runs[ep] = run + bytes(more)
        if walk_in_full:
            runs.update((ep, bytes(tiers)) for ep, tiers in (await lookup(keys, walk_in_full)).items())
        return runs

    def _take(self, key: int) -> _Match | None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._bytes -= entry.size
        return entry

    def _put(self, key: int, entry: _Match) -> None:
        if entry.size > self.capacity_bytes:
            return
        old = self._entries.pop(key, None)
        if old is not None:
            self._bytes -= old.size
        self._entries[key] = entry
        self._bytes += entry.size
        while self._bytes > self.capacity_bytes:
            _, gone = self._entries.popitem(last=False)
            self._bytes -= gone.size
            self.metrics.evictions.inc()
