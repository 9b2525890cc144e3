"""Incremental tokenization: reuse the tokens of a cached prompt that the new prompt extends.

A multi-turn conversation re-sends the whole history each turn; tokenizing only the new suffix
makes that cheap. BPE merges and pre-tokenizer rules may cross the join, so the reuse stops a
few tokens before the end of the cached text (`drop_tokens`), the text from a further
`overlap_tokens` back is re-tokenized, and the result is accepted only when the window's
tokens agree with the cached ones on the overlap and both put a token boundary at the cut;
otherwise the whole prompt is tokenized. Property tests check equality with full tokenization.

Entries are found by a hash of their first `anchor_chars` characters; the cache is an LRU
bounded by the total number of tokens held, and is thread-safe (tokenization runs in threads).
"""

from __future__ import annotations

import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import xxhash

# raw encoder: text -> (ids, char starts, char ends), without special tokens added
RawEncoder = Callable[[str], tuple[Sequence[int], Sequence[int], Sequence[int]]]


@dataclass(slots=True)
class _Entry:
    text: str
    ids: array
    starts: array
    ends: array
    anchor: int


@dataclass
class CacheStats:
    """Outcome counts (also exported as metrics by the tokenizer pool)."""

    full_hits: int = 0
    prefix_hits: int = 0
    misses: int = 0
    fallbacks: int = 0
    reused_tokens: int = 0


class TokenizationCache:
    """LRU of past tokenizations, bounded by `capacity_tokens`; reuses them for extensions."""

    def __init__(self, capacity_tokens: int = 4_000_000, *, min_chars: int = 512, anchor_chars: int = 256,
                 drop_tokens: int = 8, overlap_tokens: int = 16, min_agree: int = 4, bucket_size: int = 32,
                 on_outcome: Callable[[str, int], None] | None = None) -> None:
        self.capacity_tokens = capacity_tokens
        self.min_chars = max(min_chars, anchor_chars)
        self.anchor_chars = anchor_chars
        self.drop_tokens = drop_tokens
        self.overlap_tokens = overlap_tokens
        self.min_agree = min_agree
        self.bucket_size = bucket_size
        self.stats = CacheStats()
        self._on_outcome = on_outcome or (lambda outcome, reused: None)
        self._lock = threading.Lock()
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # id(entry) -> entry, LRU order
        self._by_anchor: dict[int, list[_Entry]] = {}
        self._tokens = 0

    @property
    def tokens(self) -> int:
        """Tokens held now."""
        return self._tokens

    def __len__(self) -> int:
        return len(self._entries)

    def encode(self, text: str, raw: RawEncoder) -> list[int]:
        """Token ids of `text` (as `raw` would give them), reusing a cached prefix when possible."""
        if len(text) < self.min_chars:
            return list(raw(text)[0])
        anchor = xxhash.xxh64_intdigest(text[: self.anchor_chars].encode())
        base = self._find(text, anchor)
        if base is not None and len(base.text) == len(text):
            self._outcome("full_hit", len(base.ids))
            return base.ids.tolist()
        result = self._extend(text, base, raw) if base is not None else None
        if result is None:
            ids, starts, ends = raw(text)
            ids, starts, ends = array("I", ids), array("I", starts), array("I", ends)
            self._outcome("miss" if base is None else "fallback", 0)
        else:
            ids, starts, ends, reused = result
            self._outcome("prefix_hit", reused)
        self._store(_Entry(text, ids, starts, ends, anchor))
        return ids.tolist()

    def _outcome(self, outcome: str, reused: int) -> None:
        if outcome == "full_hit":
            self.stats.full_hits += 1
        elif outcome == "prefix_hit":
            self.stats.prefix_hits += 1
        elif outcome == "miss":
            self.stats.misses += 1
        else:
            self.stats.fallbacks += 1
        self.stats.reused_tokens += reused
        self._on_outcome(outcome, reused)

    def _find(self, text: str, anchor: int) -> _Entry | None:
        with self._lock:
            best = None
            for entry in self._by_anchor.get(anchor, ()):
                if len(entry.text) <= len(text) and (best is None or len(entry.text) > len(best.text)) \
                        and text.startswith(entry.text):
                    best = entry
            if best is not None:
                self._entries.move_to_end(id(best))
            return best

    def _extend(self, text: str, base: _Entry, raw: RawEncoder):
        n = len(base.ids)
        starts, ends = base.starts, base.ends
        ip = n - self.drop_tokens
        while ip > 0 and ends[ip - 1] > starts[ip]:  # never cut inside a character
            ip -= 1
        iq = ip - self.overlap_tokens
        while iq > 0 and ends[iq - 1] > starts[iq]:
            iq -= 1
        if iq <= 0:
            return None
        p, q = starts[ip], starts[iq]
        w_ids, w_starts, w_ends = raw(text[q:])
        # the window token that starts exactly at the cut
        j = next((k for k, s in enumerate(w_starts) if s + q >= p), None)
        if j is None or w_starts[j] + q != p or (j > 0 and w_ends[j - 1] + q > p):
            return None
        agree = min(j, ip - iq) - 1  # the window's first token may differ (no left context)
        if agree < self.min_agree:
            return None
        for k in range(1, agree + 1):
            if (w_ids[j - k] != base.ids[ip - k] or w_starts[j - k] + q != starts[ip - k]
                    or w_ends[j - k] + q != ends[ip - k]):
                return None
        ids = base.ids[:ip]
        ids.extend(w_ids[j:])
        new_starts = base.starts[:ip]
        new_starts.extend(s + q for s in w_starts[j:])
        new_ends = base.ends[:ip]
        new_ends.extend(e + q for e in w_ends[j:])
        return ids, new_starts, new_ends, ip

    def _store(self, entry: _Entry) -> None:
        size = len(entry.ids)
        if size > self.capacity_tokens:
            return
        with self._lock:
            # Older turns stay: other conversations may extend the same shared prefix.
            bucket = self._by_anchor.setdefault(entry.anchor, [])
            bucket.append(entry)
            self._entries[id(entry)] = entry
            self._tokens += size
            if len(bucket) > self.bucket_size:  # bounds the cost of a lookup
                self._remove(bucket[0])
            while self._tokens > self.capacity_tokens:
                self._remove(next(iter(self._entries.values())))

    def _remove(self, entry: _Entry) -> None:
        self._entries.pop(id(entry), None)
        bucket = self._by_anchor.get(entry.anchor)
        if bucket is not None:
            bucket.remove(entry)
            if not bucket:
                del self._by_anchor[entry.anchor]
        self._tokens -= len(entry.ids)
