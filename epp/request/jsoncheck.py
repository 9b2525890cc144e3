"""Checks on parsed JSON that json.loads does not make: nesting depth and lone UTF-16 surrogates.

Both walk the value with an explicit stack (no recursion), so hostile input cannot exhaust the
interpreter's stack here, and both start with a byte-level pre-check that rules most bodies out.
"""

from __future__ import annotations

import re
from typing import Any


def exceeds_depth(body: bytes, value: Any, limit: int) -> bool:
    """True when `value` (parsed from `body`) nests objects/arrays more than `limit` levels deep."""
    # Depth cannot exceed the number of opening brackets: most bodies are ruled out in C.
    if not isinstance(value, (dict, list)) or body.count(b"[") + body.count(b"{") <= limit:
        return False
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return True
        children = item.values() if isinstance(item, dict) else item
        for child in children:
            if isinstance(child, (dict, list)):
                stack.append((child, depth + 1))
    return False


_SURROGATE = re.compile("[\ud800-\udfff]")


def _has_surrogate(text: str) -> bool:
    return not text.isascii() and _SURROGATE.search(text) is not None


def has_lone_surrogate(body: bytes, value: Any) -> bool:
    """True when a string (or key) of `value` holds a lone UTF-16 surrogate, which is not Unicode."""
    # Raw UTF-8 cannot carry surrogates (decoding fails first); only `\\uD800`-style escapes can
    # (a valid escaped pair is joined into one code point by the parser). No backslash, no escape:
    # a single memchr rules out most bodies, and the walk costs little more (isascii skips ASCII).
    if b"\\" not in body:
        return False
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if _has_surrogate(item):
                return True
        elif isinstance(item, dict):
            for key, child in item.items():
                if _has_surrogate(key):
                    return True
                stack.append(child)
        elif isinstance(item, list):
            stack.extend(item)
    return False
