"""Checks on JSON that json.loads does not make: nesting depth (before parsing) and lone UTF-16 surrogates.

Neither recurses, so hostile input cannot exhaust the interpreter's stack here; the depth check
starts with a byte-level pre-check that rules most bodies out.
"""

from __future__ import annotations

import json
import re
from array import array
from itertools import accumulate
from typing import Any

_NOT_BRACKET = bytes(sorted(set(range(256)) - set(b"[]{}")))
_NOT_QUOTE_OR_BRACKET = bytes(sorted(set(range(256)) - set(b'"[]{}')))
# An opening bracket steps one level in, a closing one (read as a signed byte, -1) one level out.
_DEPTH_STEP = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")
# A backslash and the byte it escapes (in valid JSON only inside strings).
_ESCAPE = re.compile(rb"\\.", re.DOTALL)


def _brackets_outside_strings(body: bytes) -> bytes:
    """The brackets of the UTF-8 JSON text `body` that are not inside strings (an unterminated one runs to the end)."""
    # Escapes first, so that every quote left opens or closes a string (in `\\"` the quote still
    # ends its string). No byte of a multi-byte UTF-8 character is a quote or a backslash. Every
    # step is a C-speed scan, and only the first copies the whole body (when it holds a backslash):
    # 200 KB in about 0.1 ms.
    if b"\\" in body:
        body = _ESCAPE.sub(b"", body)
    kept = body.translate(None, _NOT_QUOTE_OR_BRACKET)
    return b"".join(kept.split(b'"')[::2])


def nesting_exceeds(body: bytes, limit: int) -> bool:
    """True when the JSON text `body` nests objects/arrays more than `limit` levels deep.

    Read from the bytes before parsing, so that the parser never recurses deeper than `limit`: a
    parser near the interpreter's recursion limit leaves no stack for what runs inside it (garbage
    collector callbacks, finalizers), which then fail with RecursionError. For text that is not
    valid JSON the answer is an upper bound of how deep the parser gets before its error.
    """
    # Strings are skipped in UTF-8 only: in UTF-16 or -32 (json.loads takes those too) a quote's byte
    # can be part of another character, so every bracket is counted there.
    if json.detect_encoding(body).startswith("utf-8"):
        brackets = _brackets_outside_strings(body)
    else:
        brackets = body.translate(None, _NOT_BRACKET)
    # Depth cannot exceed the number of opening brackets: most bodies are ruled out here.
    if brackets.count(b"[") + brackets.count(b"{") <= limit:
        return False
    structure = brackets.translate(_DEPTH_STEP)
    return max(accumulate(array("b", structure))) > limit


_SURROGATE = re.compile("[\ud800-\udfff]")


def _has_surrogate(text: str) -> bool:
    return not text.isascii() and _SURROGATE.search(text) is not None


def has_lone_surrogate(value: Any) -> bool:
    """True when a string (or key) of `value` holds a lone UTF-16 surrogate, which is not Unicode."""
    # json.loads lets them in two ways: `\\uD800`-style escapes and raw surrogate bytes (it decodes
    # with surrogatepass, UTF-8 and UTF-16/32 alike), so no look at the bytes can rule them out; the
    # walk is cheap (isascii skips ASCII) and runs only on bodies the strict decoder refused.
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
