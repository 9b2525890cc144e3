"""Reading JSON bodies safely, for parsers: nesting depth checked before parsing, lone UTF-16 surrogates refused.

`decode_json_object` is what every JSON request parser calls on a request body; `read_json` what
it calls on a model server's response. Neither check recurses, so hostile input cannot exhaust
the interpreter's stack here; the depth check starts with a byte-level pre-check that rules most
bodies out.
"""

from __future__ import annotations

import json
import re
from array import array
from itertools import accumulate
from typing import Any

import msgspec

from epp.framework.errors import ErrorCode, InferenceError

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


# msgspec decodes JSON to the same Python values as json.loads about twice as fast, and refuses
# more (NaN and Infinity, numbers out of a float's range, lone surrogates, UTF-16/32, a BOM):
# what it refuses is handed to json.loads, so every body gets the answer it got before.
_strict_decode = msgspec.json.Decoder().decode


def _bad(message: str) -> InferenceError:
    return InferenceError(ErrorCode.BAD_REQUEST, message)


def decode_json_object(body: bytes, max_depth: int) -> dict[str, Any]:
    """A request body as a JSON object; `InferenceError` 400 when it is not one, nests deeper than `max_depth`
    or holds a lone surrogate (the messages GIE's parser gives)."""
    if nesting_exceeds(body, max_depth):
        raise _bad(f"request body nests objects/arrays deeper than {max_depth} levels")
    try:
        parsed, strict = _strict_decode(body), True
    except msgspec.DecodeError:  # ValidationError (a number out of range) is one too
        try:
            parsed, strict = json.loads(body), False
        except (ValueError, UnicodeDecodeError) as exc:
            raise _bad(f"error unmarshaling request bodyMap: {exc}") from None
    if not isinstance(parsed, dict):
        raise _bad("error unmarshaling request bodyMap: request body must be a JSON object")
    # The strict decoder refuses lone surrogates: only what json.loads read needs the walk.
    if not strict and has_lone_surrogate(parsed):
        raise _bad("request body holds a lone UTF-16 surrogate escape (\\ud800-\\udfff without its pair), "
                   "which is not valid Unicode")
    return parsed


# How deep a model server's response JSON may nest before the picker passes it on unread (no
# response of the APIs read here comes near it).
MAX_RESPONSE_JSON_DEPTH = 64


class UnreadableResponse(ValueError):
    """A response body the picker does not read (JSON nested too deep): passed on unchanged, and counted."""


def read_json(data: bytes, max_depth: int = MAX_RESPONSE_JSON_DEPTH) -> Any:
    """A model server's JSON (a body or one SSE event); `UnreadableResponse` when it nests deeper than `max_depth`,
    `ValueError` when it is not JSON."""
    if nesting_exceeds(data, max_depth):
        raise UnreadableResponse(f"JSON nested deeper than {max_depth} levels")
    return json.loads(data)


def read_json_or_none(data: bytes, max_depth: int = MAX_RESPONSE_JSON_DEPTH) -> Any:
    """`read_json`, with None for bytes that are not JSON (`UnreadableResponse` still raised: it is counted)."""
    try:
        return read_json(data, max_depth)
    except UnreadableResponse:
        raise
    except (ValueError, UnicodeDecodeError):
        return None
