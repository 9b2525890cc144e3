"""Writes to the Redis KV index: holder changes queued as bit operations, and the script that applies them.

An operation is `set | clear << 3` on one (endpoint, key) tier mask and applies as
`(mask & ~clear) | set`; operations queued for the same pair compose in order (set then clear =
clear), so a queue holds at most one per pair. The script takes a chunk of them with the block
keys packed (8 bytes each, big-endian) in one argument per endpoint and names the Redis keys
(prefix + 8 bytes) itself: encoding one argument instead of one per key is most of the client's
cost saved. Applying a chunk twice leaves the same masks (idempotent), so a failed chunk is queued
again under what came since.
"""

from __future__ import annotations

import itertools
import struct
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

# ARGV[1]: key prefix; then per endpoint: name, packed keys, ops (one byte a key).
WRITE_LUA = """
local prefix = ARGV[1]
local written = 0
for g = 2, #ARGV, 3 do
  local ep, keys, ops = ARGV[g], ARGV[g + 1], ARGV[g + 2]
  for i = 1, #ops do
    local k = prefix .. string.sub(keys, 8 * i - 7, 8 * i)
    local op = string.byte(ops, i)
    local old = tonumber(redis.call('HGET', k, ep) or '0')
    local new = bit.bor(bit.band(old, bit.bnot(bit.rshift(op, 3))), bit.band(op, 7))
    if new ~= old then
      if new == 0 then redis.call('HDEL', k, ep) else redis.call('HSET', k, ep, new) end
    end
    written = written + 1
  end
end
return written
"""


class PendingWrites:
    """Bit operations queued for Redis, one per (endpoint, key), composed in order: an op is
    `set | clear << 3` and applies as `(mask & ~clear) | set` (set then clear = clear)."""

    __slots__ = ("by_endpoint", "size")

    def __init__(self) -> None:
        self.by_endpoint: dict[str, dict[int, int]] = {}
        self.size = 0

    def __len__(self) -> int:
        return self.size

    def add(self, endpoint: str, keys: Iterable[int], set_bits: int, clear_bits: int) -> None:
        """Queue `(mask & ~clear_bits) | set_bits` after what is queued for (endpoint, key), per key."""
        ops = self.by_endpoint.get(endpoint)
        if ops is None:
            ops = self.by_endpoint[endpoint] = {}
        new_op = set_bits | clear_bits << 3
        for key in keys:
            op = ops.get(key)
            if op is None:
                self.size += 1
                ops[key] = new_op
            else:
                s = set_bits | (op & 7 & ~clear_bits)
                ops[key] = s | (clear_bits | ((op >> 3) & ~s)) << 3

    def items(self) -> Iterator[tuple[str, int, int]]:
        """(endpoint, key, op) in queue order per endpoint."""
        for endpoint, ops in self.by_endpoint.items():
            for key, op in ops.items():
                yield endpoint, key, op




def write_args(prefix: bytes, chunk: Sequence[tuple[str, int, int]]) -> list[Any]:
    """The write script's arguments for `chunk` ((endpoint, key, op) in queue order)."""
    args: list[Any] = [prefix]
    for endpoint, group in itertools.groupby(chunk, key=lambda item: item[0]):
        ops = list(group)
        args += (endpoint, struct.pack(f">{len(ops)}Q", *(key for _, key, _ in ops)), bytes(op for _, _, op in ops))
    return args
