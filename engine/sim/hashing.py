"""Prefix-cache block hashes with vLLM's semantics (``vllm/v1/core/kv_cache_utils.py``).

Chosen: vLLM's default algorithm exactly, ``sha256(pickle.dumps((parent, tuple(tokens), extra),
protocol=5))`` chained from ``NONE_HASH = sha256(pickle.dumps(seed))``, over full blocks only.
The seed: ``PYTHONHASHSEED`` if set; otherwise vLLM (0.32, ``resolve_none_hash_seed``) uses the
fixed ``"vllm-none-hash"`` for the sha256 algorithms, which is what the simulator implements,
but draws a random seed per process (``os.urandom``) for the non-cryptographic ``xxhash``
algorithms, whose hashes then differ across replicas unless ``PYTHONHASHSEED`` is shared.
Extra keys follow vLLM's order: ``("lora", name, path)`` on every block of a LoRA request, then
``("cache_salt", salt)`` on the first block only. Events carry the 64-bit form (the digest's
last 8 bytes, big-endian) and the untagged extra keys, like vLLM's defaults. So a simulator
replica announces the very hashes a real vLLM would for the same token ids.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from dataclasses import dataclass
from typing import Any

DEFAULT_NONE_HASH_SEED = "vllm-none-hash"


def sha256_pickle(obj: Any) -> bytes:
    """vLLM's ``sha256`` prefix-caching hash function."""
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def none_hash(seed: str | None = None) -> bytes:
    """The parent digest of block 0 for sha256: ``PYTHONHASHSEED`` if set, else vLLM's fixed sha256 seed."""
    if seed is None:
        seed = os.environ.get("PYTHONHASHSEED") or DEFAULT_NONE_HASH_SEED
    return sha256_pickle(seed)


NONE_HASH = sha256_pickle(DEFAULT_NONE_HASH_SEED)


def external_hash(digest: bytes) -> int:
    """The event form of a block hash: the low 64 bits of the digest, unsigned big-endian."""
    return int.from_bytes(digest, "big") & 0xFFFF_FFFF_FFFF_FFFF


@dataclass(frozen=True, slots=True)
class HashContext:
    """What besides token ids enters a request's block hashes."""

    cache_salt: str | None = None
    lora_name: str | None = None
    lora_path: str | None = None

    def extra_keys(self, block_index: int) -> tuple[Any, ...] | None:
        """The tagged extra keys of block `block_index` (None when there are none)."""
        keys: list[Any] = []
        if self.lora_name is not None:
            keys.append(("lora", self.lora_name, self.lora_path))
        if self.cache_salt is not None and block_index == 0:
            keys.append(("cache_salt", self.cache_salt))
        return tuple(keys) if keys else None

    def event_extra_keys(self, block_index: int) -> tuple[Any, ...] | None:
        """The untagged form vLLM puts in BlockStored.extra_keys (LoRA path dropped)."""
        keys: list[Any] = []
        if self.lora_name is not None:
            keys.append(self.lora_name)
        if self.cache_salt is not None and block_index == 0:
            keys.append(self.cache_salt)
        return tuple(keys) if keys else None


NO_CONTEXT = HashContext()


def hash_block(parent: bytes | None, tokens: tuple[int, ...] | list[int], extra: tuple[Any, ...] | None,
               root: bytes = NONE_HASH) -> bytes:
    """One block's digest, chained from its parent's full digest (`root` for block 0)."""
    return sha256_pickle((parent or root, tuple(tokens), extra))


def block_hashes(
    token_ids: list[int],
    block_size: int,
    ctx: HashContext = NO_CONTEXT,
    *,
    start: int = 0,
    parent: bytes | None = None,
    known: list[bytes] | None = None,
    root: bytes = NONE_HASH,
) -> list[bytes]:
    """Digests of the full blocks of `token_ids`, continuing `known` (already hashed blocks)."""
    out = list(known) if known else []
    if out:
        parent = out[-1]
        start = len(out)
    n_full = len(token_ids) // block_size
    for i in range(start, n_full):
        chunk = tuple(token_ids[i * block_size:(i + 1) * block_size])
        parent = hash_block(parent, chunk, ctx.extra_keys(i), root)
        out.append(parent)
    return out
