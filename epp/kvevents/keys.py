"""Request block keys: our own xxhash64 chain over token ids, independent of vLLM's hash and seed.

key(block 0) = xxh64(tokens of block 0, seed = root(model, cache_salt))
key(block i) = xxh64(tokens of block i, seed = key(block i-1))
where root = xxh64("epp-kv", model or LoRA name, cache_salt). Tokens are hashed as little-endian
uint32. Only full blocks get keys (a partial tail block is never cached by the engine either).
Multimodal items: each item's identifier (vLLM's mm hash, what its events carry in `extra_keys`
as `(identifier, offset)`) is mixed into the seed of the block its first placeholder token falls
in, with that token's place in the block (`media_extras`); the chain carries it to every later
block. Events and requests compute it alike: events from the offsets vLLM tags each engine block
with, requests from the placeholder ranges vLLM's renderer (or a token-in client) gives. So the
same image at the same place matches, another image or none does not. Other extra inputs we
cannot reproduce (prompt embeds) mix a hash of themselves into the seed of the blocks they
overlap, so no request matches them.

`BlockKeyCache` keeps the keys of recent prompts: a prompt that repeats the head of one (the next
turn of a conversation) is keyed from where the shared blocks end, so a 50,000-token turn costs
the hashing of its new blocks, not of all 3,000.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import xxhash

from epp.tokenization.prefix_store import PrefixStore, PrefixStoreMetrics, Stored

_xxh64 = xxhash.xxh64_intdigest


class BlockKeyer:
    """Computes request keys for full blocks of `block_size` tokens."""

    __slots__ = ("block_size",)

    def __init__(self, block_size: int) -> None:
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        self.block_size = block_size

    @staticmethod
    def root(model: str | None, cache_salt: str | None = None) -> int:
        """The chain's seed for a model (or LoRA adapter name) and an optional cache salt."""
        return _xxh64(b"epp-kv\x00" + (model or "").encode() + b"\x00" + (cache_salt or "").encode())

    def chain(self, parent: int, tokens: Sequence[int],
              extras: Mapping[int, int] | None = None) -> list[int]:
        """Keys of the full blocks of `tokens`, chained from `parent`; `extras[i]` salts block i."""
        bs = self.block_size
        n = len(tokens) // bs
        if n == 0:
            return []
        # One conversion to uint32s, then each block's slice of the array is hashed (buffer protocol).
        words = array("I", tokens if len(tokens) == n * bs else tokens[: n * bs])
        keys = [0] * n
        key = parent
        xxh64 = _xxh64
        if extras:
            for i in range(n):
                extra = extras.get(i)
                seed = key if extra is None else xxh64(extra.to_bytes(8, "little"), key)
                key = xxh64(words[i * bs:(i + 1) * bs], seed)
                keys[i] = key
        else:
            for i in range(n):
                key = xxh64(words[i * bs:(i + 1) * bs], key)
                keys[i] = key
        return keys

    def request_keys(self, tokens: Sequence[int], model: str | None,
                     cache_salt: str | None = None) -> list[int]:
        """Keys of a prompt's full blocks, from the start of the prompt."""
        return self.chain(self.root(model, cache_salt), tokens)


def media_extra(identifier: str, place: int) -> int:
    """The salt one media item adds to the block its first placeholder token is in, at `place` in that block."""
    return _xxh64(b"epp-mm\x00" + identifier.encode("utf-8", "surrogatepass") + b"\x00" + str(place).encode())


def media_extras(items: Iterable[tuple[str, int]], block_size: int) -> dict[int, int]:
    """Block index -> salt for media items given as (identifier, offset of the first placeholder token)."""
    extras: dict[int, int] = {}
    for identifier, offset in items:
        block, place = divmod(offset, block_size)
        extras[block] = extras.get(block, 0) ^ media_extra(identifier, place)
    return extras


# 4.5 bytes a token (its id, and a key per 16): the prompts of about as many tokens as the
# tokenization cache holds by default (4M), e.g. 80 conversations of 200 KB.
DEFAULT_KEY_CACHE_BYTES = 32 * 1024 * 1024


class BlockKeyCache:
    """A `BlockKeyer` that remembers recent prompts' keys and keys a prompt from the blocks it shares with one.

    Entries are a prompt's token ids (its full blocks, after the chain's root) with their keys, in
    a `PrefixStore` of `capacity_bytes`: the next turn of a conversation finds its previous turn,
    takes the keys of the blocks both hold word for word and hashes only the rest. The keys are
    exactly `keyer.request_keys`'s (tests compare them), for any prompt.
    """

    def __init__(self, keyer: BlockKeyer, capacity_bytes: int = DEFAULT_KEY_CACHE_BYTES, *,
                 min_tokens: int = 256, metrics: PrefixStoreMetrics | None = None) -> None:
        self.keyer = keyer
        self.store: PrefixStore[array] = PrefixStore(capacity_bytes, min_bytes=8 + 4 * min_tokens, metrics=metrics)
        if metrics is not None:
            metrics.bind(lambda: self.store.bytes, lambda: len(self.store))

    def start(self, tokens: Sequence[int], model: str | None, cache_salt: str | None = None) -> KeyWork:
        """Find the keys a prompt shares with a cached one; `finish` hashes the rest (`to_hash` blocks)."""
        bs = self.keyer.block_size
        full = len(tokens) // bs * bs
        words = tokens[:full] if isinstance(tokens, array) and tokens.typecode == "I" else array("I", tokens[:full])
        root = self.keyer.root(model, cache_salt)
        data = root.to_bytes(8, "little") + words.tobytes()  # the root first: models and salts never share keys
        found = self.store.find(data)
        if found is None:
            return KeyWork(words, bs, root, data, array("Q"), None)
        entry, shared = found
        reused = min(len(entry.value), max(0, shared - 8) // (4 * bs))
        return KeyWork(words, bs, root, data, entry.value[:reused], entry)

    def finish(self, work: KeyWork) -> array:
        """The prompt's keys (uint64s, exactly `keyer.request_keys`'s), stored for the prompts that extend it."""
        keys = work.keys
        done = len(keys)
        keys.extend(self.keyer.chain(keys[-1] if done else work.root, work.words[done * work.block_size:]))
        self.store.put(work.data, keys, 8 * len(keys), supersedes=work.found)
        return keys[:]  # a copy: the stored keys are never handed out

    def request_keys(self, tokens: Sequence[int], model: str | None, cache_salt: str | None = None) -> array:
        """Keys of a prompt's full blocks, from the start of the prompt (`start` and `finish` in one)."""
        return self.finish(self.start(tokens, model, cache_salt))


@dataclass(slots=True)
class KeyWork:
    """A prompt being keyed: its full blocks' token ids, the keys found so far, the entry they came from."""

    words: array
    block_size: int
    root: int
    data: bytes
    keys: array
    found: Stored[array] | None

    @property
    def to_hash(self) -> int:
        """Blocks `finish` still hashes."""
        return len(self.words) // self.block_size - len(self.keys)
