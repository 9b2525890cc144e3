"""What the token-in parsers share: token ids checked and packed into prefix bytes, media placed among them."""

from __future__ import annotations

from array import array
from collections.abc import Mapping, Sequence
from typing import Any

from epp.framework import ErrorCode, InferenceError, MediaItem, media_digest

# The largest token id (ids are uint32 on every engine's wire).
MAX_TOKEN_ID = 2**32 - 1
# Stands in the prefix bytes before a media item's identifier: no run of token ids packs to it
# except the id 2**32-1, which no vocabulary has.
MEDIA_MARK = b"\xff\xff\xff\xff"


def bad(message: str, param: str | None = None) -> InferenceError:
    """A 400 naming the body field at fault."""
    return InferenceError(ErrorCode.BAD_REQUEST, message, param=param)


def check_token_ids(value: Any, field: str, what: str) -> list[int]:
    """`value` as token ids: a non-empty list of ints in [0, 2**32); 400 naming `field` otherwise."""
    if not isinstance(value, list) or not value:
        raise bad(f"invalid {what} request: {field} must be a non-empty list of token ids", field)
    for t in value:
        if t.__class__ is not int or not 0 <= t <= MAX_TOKEN_ID:
            raise bad(f"invalid {what} request: {field} must hold token ids (integers 0 to {MAX_TOKEN_ID}), "
                      f"got {t!r}", field)
    return value


def token_prefix_bytes(ids: Sequence[int], media: Sequence[MediaItem], limit: int | None) -> bytes:
    """Token ids packed as little-endian uint32 (4 bytes a token, so a hash block of 4n bytes is n tokens), with
    each media item's identifier put in at its first placeholder token.

    The same ids with the same images give the same bytes; another image gives other bytes from
    its place on, though its placeholder tokens are the same ids.
    """
    stop = len(ids) if limit is None else min(len(ids), limit // 4 + 1)
    placed = sorted((m.token_offset, m.engine_hash or m.digest) for m in media
                    if m.token_offset is not None and m.token_offset < stop)
    if not placed:
        data = array("I", ids[:stop]).tobytes()
    else:
        parts = []
        start = 0
        for offset, ident in placed:
            parts.append(array("I", ids[start:offset]).tobytes())
            parts.append(MEDIA_MARK + ident.encode("utf-8", "surrogatepass") + MEDIA_MARK)
            start = offset
        parts.append(array("I", ids[start:stop]).tobytes())
        data = b"".join(parts)
    return data if limit is None else data[:limit]


def engine_features(features: Any, token_count: int, what: str) -> list[MediaItem]:
    """vLLM's `features` of a token-in request: per modality the items' hashes and placeholder ranges, in
    prompt order; 400 when they do not fit together or fall outside the prompt."""
    if features is None:
        return []
    if not isinstance(features, Mapping):
        raise bad(f"invalid {what} request: features must be an object", "features")
    hashes = features.get("mm_hashes") or {}
    places = features.get("mm_placeholders") or {}
    if not isinstance(hashes, Mapping) or not isinstance(places, Mapping):
        raise bad(f"invalid {what} request: features.mm_hashes and features.mm_placeholders must be objects "
                  "by modality", "features")
    out = []
    for modality, ids in hashes.items():
        spans = places.get(modality)
        if not isinstance(ids, list) or not isinstance(spans, list) or len(ids) != len(spans):
            raise bad(f"invalid {what} request: features.mm_hashes[{modality!r}] and "
                      f"features.mm_placeholders[{modality!r}] must be lists of one entry per item", "features")
        for ident, span in zip(ids, spans):
            offset = span.get("offset") if isinstance(span, Mapping) else None
            length = span.get("length") if isinstance(span, Mapping) else None
            if not isinstance(ident, str) or not ident or offset.__class__ is not int \
                    or length.__class__ is not int or offset < 0 or length < 1 or offset + length > token_count:
                raise bad(f"invalid {what} request: features of {modality!r} must be hash strings and placeholder "
                          f"ranges {{offset, length}} inside the {token_count} token ids", "features")
            out.append(MediaItem(str(modality), media_digest(ident), 0, engine_hash=ident, token_offset=offset,
                                 token_length=length))
    out.sort(key=lambda m: m.token_offset or 0)
    return out
