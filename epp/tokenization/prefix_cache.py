"""Incremental tokenization: reuse the tokens of a cached prompt that the new prompt extends.

A multi-turn conversation re-sends the whole history each turn: tokenizing only the new suffix
makes that cheap (and a turn that changes the end of the last one, a regenerated answer, reuses
what comes before). BPE merges and pre-tokenizer rules may cross the join, so the reuse stops a
few tokens before the end of the cached text (`drop_tokens`), the text from a further
`overlap_tokens` back is re-tokenized, and the result is accepted only when the window's
tokens agree with the cached ones on the overlap and both put a token boundary at the cut;
otherwise the whole prompt is tokenized. Property tests check equality with full tokenization.

Character offsets cost a tokenizer about as much again as the ids, and a cut only ever falls near
the end of a cached text (a conversation grows at its end), so the bulk is tokenized without them
(`ids_only`) and offsets are kept for the last `tail_chars` characters only, from a second, short
tokenization of the end whose ids agree with the whole one's. A new prompt that departs from a
cached one before that tail is tokenized whole (a fallback, counted).

Entries live in a `PrefixStore` keyed by the text's UTF-8 bytes (found for any text that starts
with one, however many conversations share a head), charged what they hold (the text's bytes,
4 bytes a token and 8 more a tail token) against `capacity_tokens` x `BYTES_PER_TOKEN` bytes; a
turn's entry replaces the previous turn's, so a conversation holds one. Thread-safe (tokenization
runs in threads). Token ids come back as `array("I")`: a 50,000-token prompt is never turned into
Python ints.
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
# ids-only encoder: text -> ids, without special tokens added (the same ids as RawEncoder's)
IdsEncoder = Callable[[str], Sequence[int]]
# The byte budget per token of `capacity_tokens`: its id (uint32) and ~4 bytes of text.
BYTES_PER_TOKEN = 8
_ID_BYTES = 4
_TAIL_BYTES = 8  # a tail token's start and end (uint32 each)
# Tokens of a short re-tokenization that agree with the whole one's but are not trusted for their
# offsets: the first tokens after the cut of that text may still differ in span however their ids agree.
_UNTRUSTED = 2


@dataclass(slots=True)
class _Tokens:
    ids: array
    tail_from: int  # the index of the first token whose offsets are kept
    starts: array  # character starts of ids[tail_from:]
    ends: array  # character ends of ids[tail_from:]
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
                 tail_chars: int = 1024, head_chars: int = 256,
                 on_outcome: Callable[[str, int], None] | None = None,
                 store_metrics: PrefixStoreMetrics | None = None) -> None:
        self.capacity_tokens = capacity_tokens
        self.min_chars = max(min_chars, anchor_chars)
        self.drop_tokens = drop_tokens
        self.overlap_tokens = overlap_tokens
        self.min_agree = min_agree
        self.tail_chars = tail_chars  # the end of a cached text whose offsets are kept
        self.head_chars = head_chars  # text past a cut tokenized with offsets to check the cut
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

    def encode(self, text: str, raw: RawEncoder, ids_only: IdsEncoder | None = None) -> array:
        """Token ids of `text` (as `raw` would give them), reusing a cached prefix when possible.

        `ids_only` gives the same ids as `raw` without offsets (cheaper); without it `raw` does all.
        """
        fast: IdsEncoder = ids_only or (lambda t: raw(t)[0])
        if len(text) < self.min_chars:
            return array("I", fast(text))
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
            result = self._extend(text, entry.value, chars, raw, fast)
        if result is None:
            tokens = self._tokenized(text, raw, fast)
            self._outcome("miss" if base is None else "fallback", 0)
        else:
            tokens, reused = result
            self._outcome("prefix_hit", reused)
        size = len(tokens.ids) * _ID_BYTES + len(tokens.starts) * _TAIL_BYTES
        if self._store.put(data, tokens, size, supersedes=base) is not None:
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

    def _tokenized(self, text: str, raw: RawEncoder, fast: IdsEncoder) -> _Tokens:
        """All of `text` tokenized, with the offsets of its end."""
        if len(text) <= self.tail_chars:
            ids, starts, ends = raw(text)
            return _Tokens(array("I", ids), 0, array("I", starts), array("I", ends), len(text))
        return self._with_tail(text, array("I", fast(text)), raw)

    def _with_tail(self, text: str, ids: array, raw: RawEncoder) -> _Tokens:
        """`ids` (all of `text`'s, longer than `tail_chars`) with their last tokens' offsets, from the end alone."""
        cut = len(text) - self.tail_chars
        t_ids, t_starts, t_ends = raw(text[cut:])
        n, m = len(ids), len(t_ids)
        # The end tokenized alone re-joins the whole tokenization after a few tokens: from there on the ids
        # agree, and tokens that cover the same text up to its end cover the same characters.
        agree = 0
        while agree < m and agree < n and t_ids[m - 1 - agree] == ids[n - 1 - agree]:
            agree += 1
        agree = max(0, agree - _UNTRUSTED)
        first = m - agree
        return _Tokens(ids, n - agree, array("I", [s + cut for s in t_starts[first:]]),
                       array("I", [e + cut for e in t_ends[first:]]), len(text))

    def _extend(self, text: str, base: _Tokens, shared_chars: int, raw: RawEncoder,
                fast: IdsEncoder) -> tuple[_Tokens, int] | None:
        """The tokens of `text` from those of `base`, whose first `shared_chars` characters it repeats, or None."""
        t0, starts, ends = base.tail_from, base.starts, base.ends
        # The base's tokens that end inside the shared head, less the last few (merges may cross the join);
        # token i's offsets are starts[i - t0], ends[i - t0].
        ip = t0 + bisect_right(ends, shared_chars) - self.drop_tokens
        while ip > t0 and ends[ip - 1 - t0] > starts[ip - t0]:  # never cut inside a character
            ip -= 1
        iq = ip - self.overlap_tokens
        while iq > t0 and ends[iq - 1 - t0] > starts[iq - t0]:
            iq -= 1
        if iq <= t0:  # the cut falls before the kept offsets (or the text's start): tokenize it all
            return None
        p, q = starts[ip - t0], starts[iq - t0]
        window = text[q:]
        small = len(window) <= self.tail_chars
        if small:  # one tokenization with offsets checks the cut and gives the new tail
            w_ids, w_starts, w_ends = h_ids, h_starts, h_ends = raw(window)
        else:  # the bulk without offsets, and the text around the cut with them
            w_ids = fast(window)
            h_ids, h_starts, h_ends = raw(text[q:p + self.head_chars])
        # the window token that starts exactly at the cut
        j = next((k for k, s in enumerate(h_starts) if s + q >= p), None)
        if j is None or h_starts[j] + q != p or (j > 0 and h_ends[j - 1] + q > p):
            return None
        if not small:
            # The short tokenization vouches for the whole window's offsets up to a little past the cut,
            # where their ids agree and the short one's own end (cut mid-word) is still far.
            check = j + 1 + _UNTRUSTED
            if check > len(h_ids) - 2 * _UNTRUSTED or list(h_ids[:check]) != list(w_ids[:check]):
                return None
        agree = min(j, ip - iq) - 1  # the window's first token may differ (no left context)
        if agree < self.min_agree:
            return None
        base_ids = base.ids
        for k in range(1, agree + 1):
            if (h_ids[j - k] != base_ids[ip - k] or h_starts[j - k] + q != starts[ip - k - t0]
                    or h_ends[j - k] + q != ends[ip - k - t0]):
                return None
        ids = base_ids[:ip]
        ids.extend(w_ids[j:])
        if not small:
            return self._with_tail(text, ids, raw), ip
        # The new tail: the base's kept offsets up to the cut, then the window's, trimmed to `tail_chars`.
        new_starts = starts[:ip - t0]
        new_starts.extend([s + q for s in w_starts[j:]])
        new_ends = ends[:ip - t0]
        new_ends.extend([e + q for e in w_ends[j:]])
        keep = bisect_right(new_starts, len(text) - self.tail_chars)
        return _Tokens(ids, t0 + keep, new_starts[keep:], new_ends[keep:], len(text)), ip
