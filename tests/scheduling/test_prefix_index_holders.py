"""The approximate prefix index answers as a plain set-per-hash model does, and keeps no object per hash the GC walks."""

from __future__ import annotations

import gc
import random
from collections import OrderedDict

import pytest

from epp.scorers.prefix_index import PrefixIndex


class SetModel:
    """The index's definition, written the plain way: a set of holders per hash, one LRU per endpoint."""

    def __init__(self, chain_aware: bool) -> None:
        self.chain_aware = chain_aware
        self.holders: dict[int, set[str]] = {}
        self.lrus: dict[str, OrderedDict[int, None]] = {}

    def add(self, hashes: list[int], endpoint: str, capacity: int) -> None:
        lru = self.lrus.setdefault(endpoint, OrderedDict())
        for h in reversed(hashes) if self.chain_aware else hashes:
            lru[h] = None
            lru.move_to_end(h)
            self.holders.setdefault(h, set()).add(endpoint)
        while len(lru) > capacity:
            old, _ = lru.popitem(last=False)
            self.holders[old].discard(endpoint)

    def remove_endpoint(self, endpoint: str) -> None:
        for h in self.lrus.pop(endpoint, {}):
            self.holders[h].discard(endpoint)

    def match(self, hashes: list[int]) -> dict[str, int]:
        matched: dict[str, int] = {}
        if self.chain_aware:  # blocks held contiguously from the first
            for ep in {ep for h in hashes[:1] for ep in self.holders.get(h, ())}:
                depth = 0
                while depth < len(hashes) and ep in self.holders.get(hashes[depth], ()):
                    depth += 1
                matched[ep] = depth
            return matched
        for h in hashes:  # GIE: every block held, until a block nobody holds
            if not self.holders.get(h):
                break
            for ep in self.holders[h]:
                matched[ep] = matched.get(ep, 0) + 1
        return matched


@pytest.mark.parametrize("chain_aware", [True, False])
def test_random_adds_evictions_and_departures_match_as_the_set_model_does(chain_aware):
    rng = random.Random(3)
    index, model = PrefixIndex(chain_aware=chain_aware), SetModel(chain_aware)
    endpoints = ["a", "b", "c", "d"]
    # Chains that share heads, so several endpoints hold the same blocks and runs end at different depths.
    chains = [[root * 100 + i for i in range(rng.randint(1, 12))] for root in range(6)]
    chains += [chain[:cut] + [9000 + n] for n, chain in enumerate(chains) for cut in (1, 3)]
    for step in range(3000):
        chain = rng.choice(chains)
        if step % 500 == 499:
            gone = rng.choice(endpoints)
            index.remove_endpoint(gone)
            model.remove_endpoint(gone)
        else:
            ep = rng.choice(endpoints)
            index.add(chain, ep, capacity=20)
            model.add(chain, ep, capacity=20)
        probe = rng.choice(chains)
        assert index.match_longest_prefix(probe) == model.match(probe), (step, probe)
    assert index.size == sum(len(lru) for lru in model.lrus.values())


def test_the_index_keeps_no_object_per_hash_that_a_full_collection_walks():
    index = PrefixIndex(chain_aware=True)
    for n in range(200):
        chain = [n * 10 + i for i in range(8)]
        index.add(chain, "a", capacity=10_000)
        if n % 2:
            index.add(chain, "b", capacity=10_000)  # held twice: more than one holder
    assert index.match_longest_prefix([11, 12]) == {"a": 2, "b": 2}  # hashes with one and with two holders
    assert index.match_longest_prefix([20, 21]) == {"a": 2}
    gc.collect()
    holders = list(index._hash_to_endpoints.values())
    # A set per hash stayed tracked forever: a picker holding 10^5-10^6 hashes paid for each in every
    # full collection, a pause of the event loop (bench/gc_pauses.py).
    assert not any(gc.is_tracked(h) for h in holders)
