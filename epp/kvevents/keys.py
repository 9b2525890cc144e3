"""Request block keys: our own xxhash64 chain over token ids, independent of vLLM's hash and seed.

key(block 0) = xxh64(tokens of block 0, seed = root(model, cache_salt))
key(block i) = xxh64(tokens of block i, seed = key(block i-1))
where root = xxh64("epp-kv", model or LoRA name, cache_salt). Tokens are hashed as little-endian
uint32. Only full blocks get keys (a partial tail block is never cached by the engine either).
Blocks that carry extra hash inputs we cannot reproduce from text (multimodal ids, prompt
embeds) mix a hash of those inputs into the seed, so text-only requests never match them.
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping, Sequence

import xxhash

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
