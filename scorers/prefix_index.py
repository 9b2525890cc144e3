"""The approximate prefix index: which endpoint was sent which block hash, LRU-bounded per endpoint."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

# Who holds a hash: one endpoint's name, or a tuple of names when several do. Neither is a
# container the garbage collector keeps tracking (a tuple of strings is untracked at its first
# collection); a set per hash was, and every full collection walked all of them
# (bench/gc_pauses.py; bench/notes/2026-12-pickers-and-cost-issue14-round2-s7-s13.md, "Garbage-collector pauses").
Holders = str | tuple[str, ...]


def _with_holder(holders: Holders | None, endpoint: str) -> Holders:
    if holders is None:
        return endpoint
    if type(holders) is str:
        return holders if holders == endpoint else (holders, endpoint)
    return holders if endpoint in holders else (*holders, endpoint)


def _without_holder(holders: Holders, endpoint: str) -> Holders | None:
    if type(holders) is str:
        return None if holders == endpoint else holders
    rest = tuple(ep for ep in holders if ep != endpoint)
    return rest[0] if len(rest) == 1 else rest


class PrefixIndex:
    """`hash → endpoints` plus one LRU of hashes per endpoint; LRU eviction drops the endpoint from the hash.

    `chain_aware=False` is GIE's index: a request's hashes are added head first (so its head is
    evicted first) and a match counts every block an endpoint holds until a block nobody holds.
    `chain_aware=True` models a prefix cache as vLLM keeps it: a finished request frees its blocks
    tail first, so the head of a chain stays longest (`add` touches the tail first), and an
    endpoint matches only the blocks it holds contiguously from the start (a prefix cache cannot
    use block 3 without blocks 1 and 2).
    """

    def __init__(self, chain_aware: bool = False) -> None:
        self.chain_aware = chain_aware
        self._hash_to_endpoints: dict[int, Holders] = {}
        self._lrus: dict[str, OrderedDict[int, None]] = {}
        self._capacity: dict[str, int] = {}
        self._size = 0

    @property
    def size(self) -> int:
        """Entries over all endpoints' LRUs."""
        return self._size

    def endpoints(self) -> list[str]:
        return list(self._lrus)

    def capacity(self, endpoint: str) -> int | None:
        return self._capacity.get(endpoint)

    def held(self, endpoint: str) -> int:
        """Hashes in the endpoint's LRU."""
        lru = self._lrus.get(endpoint)
        return 0 if lru is None else len(lru)

    def entries(self) -> list[tuple[str, list[int], int]]:
        """Per endpoint: its hashes in the order `add` rebuilds its LRU from, and its capacity (a peer's snapshot).

        That is least to most recently used; a chain-aware index lists them the other way round
        because its `add` touches the last hash first.
        """
        return [(ep, list(reversed(lru)) if self.chain_aware else list(lru), self._capacity.get(ep, len(lru)))
                for ep, lru in self._lrus.items()]

    def match_longest_prefix(self, hashes: Sequence[int]) -> dict[str, int]:
        """Blocks matched per endpoint, walking the chain until a hash no endpoint holds."""
        if self.chain_aware:
            return self._match_contiguous(hashes)
        matched: dict[str, int] = {}
        lookup = self._hash_to_endpoints
        for h in hashes:
            holders = lookup.get(h)
            if holders is None:
                break
            if type(holders) is str:
                matched[holders] = matched.get(holders, 0) + 1
                continue
            for ep in holders:
                matched[ep] = matched.get(ep, 0) + 1
        return matched

    def _match_contiguous(self, hashes: Sequence[int]) -> dict[str, int]:
        """Per endpoint, the length of the run of blocks it holds from the chain's first block."""
        lookup = self._hash_to_endpoints
        first = lookup.get(hashes[0]) if hashes else None
        if first is None:
            return {}
        alive = [first] if type(first) is str else list(first)  # holding every block so far
        matched: dict[str, int] = {}
        depth = 1
        for h in hashes[1:]:
            holders = lookup.get(h)
            if holders is None:
                break
            if type(holders) is str:
                if len(alive) == 1 and alive[0] == holders:  # the common case: one holder all along
                    depth += 1
                    continue
                still = [holders] if holders in alive else []
            else:
                still = [ep for ep in alive if ep in holders]
                if len(still) == len(alive):
                    depth += 1
                    continue
            for ep in alive:
                if ep not in still:
                    matched[ep] = depth
            alive = still
            if not alive:
                return matched
            depth += 1
        for ep in alive:
            matched[ep] = depth
        return matched

    def add(self, hashes: Iterable[int], endpoint: str, capacity: int) -> None:
        """Record that `endpoint` now holds these blocks, evicting its least recently used ones."""
        lru = self._lrus.get(endpoint)
        if lru is None:
            lru = self._lrus[endpoint] = OrderedDict()
        self._capacity[endpoint] = capacity
        lookup = self._hash_to_endpoints
        # Chain-aware: the tail first, so the head is the most recently used and is evicted last.
        for h in (reversed(list(hashes)) if self.chain_aware else hashes):
            if h in lru:
                lru.move_to_end(h)
                continue
            lru[h] = None
            lookup[h] = _with_holder(lookup.get(h), endpoint)
            self._size += 1
        while len(lru) > capacity:
            old, _ = lru.popitem(last=False)
            self._drop(old, endpoint)

    def remove_endpoint(self, endpoint: str) -> None:
        """Forget every block of an endpoint (it left the pool)."""
        lru = self._lrus.pop(endpoint, None)
        self._capacity.pop(endpoint, None)
        if lru is None:
            return
        for h in lru:
            self._drop(h, endpoint)

    def _drop(self, h: int, endpoint: str) -> None:
        self._size -= 1
        holders = self._hash_to_endpoints.get(h)
        if holders is not None:
            rest = _without_holder(holders, endpoint)
            if rest is None:
                del self._hash_to_endpoints[h]
            else:
                self._hash_to_endpoints[h] = rest
