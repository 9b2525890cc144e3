"""Map a block file of vLLM's fs tier to the block hash the picker indexes.

Naming convention assumed (vLLM 0.32/0.33 `vllm/v1/kv_offload/file_mapper.py`, `tiering/fs/`):

    <root_dir>/<model>_<12-hex digest>_r<rank>/<hhh>/<hh>_g<group_idx>/<hash_hex>.bin

`hash_hex` is the full block-hash digest in hex (32 bytes for sha256); the hash of the chunk's
last block when several blocks share a file. Files are written to `<final>_<random>.tmp` and
then atomically renamed, so a file under its final name is complete, and a `.tmp` name is a
file being written. Other files (`config.json`, `.o_direct_probe*`) are not blocks.

KV events carry a block hash as the low 64 bits of the digest (big-endian) unless vLLM runs with
VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0, which sends the raw digest bytes: `BlockFileKey.event_hash`.
The mapping is a plain function so another layout can be plugged in (`BlockNamer`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

_BLOCK_NAME = re.compile(r"^(?P<hex>(?:[0-9a-f]{2})+)\.bin$")
_GROUP_DIR = re.compile(r"_g(?P<group>\d+)$")


@dataclass(frozen=True, slots=True)
class BlockFileKey:
    """Identity of one block file: the digest of its (last) block and its KV-cache group."""

    digest: bytes
    group_idx: int | None

    def event_hash(self, int_hashes: bool = True) -> int | bytes:
        """The hash as vLLM's KV events carry it (uint64 of the last 8 bytes, or the raw digest)."""
        if int_hashes:
            return int.from_bytes(self.digest[-8:], "big")
        return self.digest


BlockNamer = Callable[[str], "BlockFileKey | None"]
"""Maps a path relative to the tier root ('/'-separated) to a key, or None if it is no block file."""


def is_temp_name(name: str) -> bool:
    """Names vLLM uses for files still being written (or probes): never deleted while young."""
    return name.endswith(".tmp") or name.startswith(".o_direct_probe")


def vllm_fs_block_key(relpath: str) -> BlockFileKey | None:
    """vLLM fs tier: `.../<hh>_g<group>/<hash_hex>.bin` → (digest, group); None for other files."""
    parts = relpath.rsplit("/", 2)
    match = _BLOCK_NAME.match(parts[-1])
    if match is None:
        return None
    group = None
    if len(parts) >= 2:
        gmatch = _GROUP_DIR.search(parts[-2])
        if gmatch is not None:
            group = int(gmatch.group("group"))
    return BlockFileKey(bytes.fromhex(match.group("hex")), group)


def vllm_fs_relpath(digest: bytes, group_idx: int = 0, base: str = "model_000000000000_r0") -> str:
    """The relative path vLLM's fs tier gives a block (used by tests and tools that fill a tier)."""
    hex_ = digest.hex()
    return f"{base}/{hex_[:3]}/{hex_[3:5]}_g{group_idx}/{hex_}.bin"
