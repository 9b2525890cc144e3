"""Incremental tokenization: reuse the tokens of a cached prompt that the new prompt extends.

A multi-turn conversation re-sends the whole history each turn; tokenizing only the new suffix
makes that cheap (and a turn that changes the end of the last one, a regenerated answer, reuses
what comes before). BPE merges and pre-tokenizer rules may cross the join, so the reuse stops a
few tokens before the end of the cached text (`drop_tokens`), the text from a further
`overlap_tokens` back is re-tokenized, and the result is accepted only when the window's
tokens agree with the cached ones on the overlap and both put a token boundary at the cut;
otherwise the whole prompt is tokenized. Property tests check equality with full tokenization.

Entries live in a `PrefixStore` keyed by the text's UTF-8 bytes (found for any text that starts
with one, however many conversations share a head), charged what they hold (the text's bytes
and 12 bytes a token) against `capacity_tokens` x `BYTES_PER_TOKEN` bytes; a turn's entry
replaces the previous turn's, so a conversation holds one. Thread-safe (tokenization runs in threads).
Token ids come back as `array("I")`: a 50,000-token prompt is never turned into Python ints.
"""

from __future__ import annotations

import threading
from array import array
from bisect import bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from epp.tokenization.prefix_store import PrefixStore, PrefixStoreMetrics, Stored

# raw encoder: text -> (ids, char starts, char ends), without special tokens added
RawEncoder = Callable[[str], tuple[Sequence[int], Sequence[int], Sequence[int]]]
# The byte budget per token of `capacity_tokens`: its id, start and end (uint32 each) and ~4 bytes of text.
BYTES_PER_TOKEN = 16
_ARRAY_BYTES_PER_TOKEN = 12


@dataclass(slots=True)
class _Tokens:
    ids: array
    starts: array
    ends: array
    chars: int  # of the text they tokenize


@dataclass
class CacheStats:
    """Outcome counts (also exported as metrics by the tokenizer pool)."""

    full_hits: int = 0
    prefix_hits: int = 0
    misses: int = 0
    fallbacks: int = 0
    reused_tokens: int = 0


class TokenizationCache:
    """Past tokenizations, bounded by `capacity_tokens`; reuses them for texts that extend them."""

    def __init__(self, capacity_tokens: int = 4_000_000, *, min_chars: int = 512, anchor_chars: int = 256,
                 drop_tokens: int = 8, overlap_tokens: int = 16, min_agree: int = 4, bucket_size: int = 32,
                 on_outcome: Callable[[str, int], None] | None = None,
                 store_metrics: PrefixStoreMetrics | None = None) -> None:
        self.capacity_tokens = capacity_tokens
        self.min_chars = max(min_chars, anchor_chars)
        self.drop_tokens = drop_tokens
        self.overlap_tokens = overlap_tokens
        self.min_agree = min_agree
        self.stats = CacheStats()
        self._on_outcome = on_outcome or (lambda outcome, reused: None)
        self._store: PrefixStore[_Tokens] = PrefixStore(
            capacity_tokens * BYTES_PER_TOKEN, min_bytes=anchor_chars, bucket_size=bucket_size,
            metrics=store_metrics, on_evict=self._evicted)
        self._tokens = 0
        self._count_lock = threading.Lock()

    @property
    def tokens(self) -> int:
        """Tokens held now."""
        return self._tokens

    @property
    def bytes(self) -> int:
        """Bytes charged for what is held now."""
        return self._store.bytes

    def __len__(self) -> int:
        return len(self._store)

    def _evicted(self, entry: Stored[_Tokens]) -> None:
        with self._count_lock:
            self._tokens -= len(entry.value.ids)

    def encode(self, text: str, raw: RawEncoder) -> array:
        """Token ids of `text` (as `raw` would give them), reusing a cached prefix when possible."""
        if len(text) < self.min_chars:
            return array("I", raw(text)[0])
        data = text.encode("utf-8", "surrogatepass")
        found = self._store.find(data)
        base = None if found is None else found[0]
        result = None
        if found is not None:
            entry, shared = found
            if shared == len(data) == len(entry.data):
                self._outcome("full_hit", len(entry.value.ids))
                return entry.value.ids[:]  # a copy: the cached ids are never handed out
            # Characters of the shared head (a character cut at its end is not shared).
            chars = entry.value.chars if shared == len(entry.data) else len(data[:shared].decode("utf-8", "ignore"))
            result = self._extend(text, entry.value, chars, raw)
        if result is None:
            ids, starts, ends = raw(text)
            tokens = _Tokens(array("I", ids), array("I", starts), array("I", ends), len(text))
            self._outcome("miss" if base is None else "fallback", 0)
        else:
            tokens, reused = result
            self._outcome("prefix_hit", reused)
        if self._store.put(data, tokens, len(tokens.ids) * _ARRAY_BYTES_PER_TOKEN, supersedes=base) is not None:
            with self._count_lock:
                self._tokens += len(tokens.ids)
        return tokens.ids[:]

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

    def _extend(self, text: str, base: _Tokens, shared_chars: int, raw: RawEncoder) -> tuple[_Tokens, int] | None:
        """The tokens of `text` from those of `base`, whose first `shared_chars` characters it repeats, or None."""
        starts, ends = base.starts, base.ends
        # The base's tokens that end inside the shared head, less the last few (merges may cross the join).
        ip = bisect_right(ends, shared_chars) - self.drop_tokens
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
        return _Tokens(ids, new_starts, new_ends, len(text)), ip
