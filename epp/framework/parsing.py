"""Request parsers: the extension point for request API formats (llm-d's `*-parser` plugins).

A parser is a plugin that reads one API format: which request paths it claims, how a body of
that format becomes the picker's request (model, stream, cache salt, the session it names),
and, as the request's `RequestFormat`, the normalised views plugins ask of the request (prompt
items, text, token ids, media, the bytes prefix hashing reads, what tokenization needs) and how
the format's responses read (usage, first token, the stored response id, the error shape).

The config's `requestHandler.parsers` lists the parsers in the order they are asked: a path goes
to the first parser that claims it (`api_for`), else to the first fallback (a parser that claims
no path: `passthrough-parser`). A new API is one module with a `Parser` subclass and one
registration in an `epp.plugins` entry point.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import xxhash

from epp.framework.plugin import Plugin
from epp.framework.types import RequestFormat

# llm-d's default parser chain, in order, when a config lists none (`requestHandler.parsers`).
DEFAULT_PARSER_TYPES = ("openai-parser", "anthropic-parser", "vllmhttp-parser", "passthrough-parser")
# A session named in a body longer than this is not an identifier: it is cut (session plugins bound it too).
MAX_SESSION_CHARS = 256


@dataclass(frozen=True, slots=True)
class ParseLimits:
    """Bounds a parser applies while reading a body (from `epp serve`'s limits)."""

    max_json_depth: int
    max_prompt_chars: int


@dataclass(frozen=True, slots=True)
class ParsedBody:
    """What a parser read of a request body; the picker adds what the headers say (objective, SLOs, rewrite)."""

    model: str
    body: Mapping[str, Any]
    stream: bool = False
    cache_salt: str | None = None
    # The session the body names (OpenAI's `prompt_cache_key` or `user`, Anthropic's `metadata.user_id`).
    session: str | None = None
    # Characters of the prompt (a token id counts 4), compared with `max_prompt_chars` by the picker.
    prompt_chars: int | None = None
    # The endpoint that holds state the request continues (a stored response it names); only it may serve it.
    pinned_endpoint: str | None = None


class Parser(Plugin, RequestFormat):
    """One request API format: the paths it claims, how its bodies parse, and its normalised views.

    Subclasses set `type_name` (the `*-parser` type configs name) and `paths`, and implement
    `parse`; they override the `RequestFormat` views their API carries. `parse` runs on the
    event loop for every request it claims: bounded work, no I/O.
    """

    # (path suffix, API name) pairs in matching order: the first suffix a path ends with names its API
    # (`/chat/completions` before `/completions`). A parser with none is a fallback for unclaimed paths.
    paths: ClassVar[tuple[tuple[str, str], ...]] = ()

    @property
    def fallback(self) -> bool:
        """Whether this parser takes the paths no other parser of the chain claims (it claims none itself)."""
        return not self.paths

    def api_for(self, path: str) -> str | None:
        """The API this parser reads on `path` (no query string or trailing slash); None: it does not claim it."""
        for suffix, api in self.paths:
            if path.endswith(suffix):
                return api
        return None

    def parse(self, body: bytes, *, api: str, path: str, limits: ParseLimits) -> ParsedBody:
        """Read a request body of `api`; raise `InferenceError` (400) when it is not a valid one."""
        raise NotImplementedError

    def path_affinity(self, path: str) -> str | None:
        """The endpoint a request on `path` without a body must go to (one that names stored state in its path,
        such as `GET /v1/responses/{id}`), or None: any endpoint. May raise `InferenceError` when that state's
        endpoint has left the pool. Default: None."""
        return None

    def with_model(self, parsed: ParsedBody, model: str) -> tuple[Mapping[str, Any], bytes] | None:
        """The body (and its bytes) to forward with the model renamed to `model` (`x-llm-d-model-name-rewrite`).

        Default: the body's `model` field replaced, serialised as GIE does (`go_json`). None: the
        format forwards bodies as they came, and the request keeps its model.
        """
        body = dict(parsed.body)
        body["model"] = model
        return body, go_json(body)


# -- helpers parser authors share ---------------------------------------------------------------------

def go_json(value: Any) -> bytes:
    """Serialise like Go's json.Marshal of a map: compact, keys sorted, HTML characters escaped."""
    text = json.dumps(value, separators=(",", ":"), sort_keys=True, ensure_ascii=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026").encode()


def session_name(value: Any) -> str | None:
    """A session id a body names, bounded to `MAX_SESSION_CHARS`; None unless a non-empty string."""
    return value[:MAX_SESSION_CHARS] if isinstance(value, str) and value else None


# One encoder for every call: json.dumps with options builds a new one each time (3 µs a message).
_encode = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode


def compact_json(value: Any) -> bytes:
    """Compact JSON bytes of `value`; a lone surrogate is kept (surrogatepass), never an error."""
    return _encode(value).encode("utf-8", "surrogatepass")


def media_digest(source: Any) -> str:
    """The digest that stands for a media item's content: xxh3-128 (hex) of its URL, data or file id."""
    data = source.encode("utf-8", "surrogatepass") if isinstance(source, str) else compact_json(source)
    return xxhash.xxh3_128_hexdigest(data)


def shorten_strings(value: Any, limit: int) -> Any:
    """`value` with every string cut to `limit` characters.

    The first `limit` bytes of its JSON are unchanged: the JSON is identical up to the first cut
    string, and that string alone still serialises to at least `limit` bytes.
    """
    if isinstance(value, str):
        return value[:limit] if len(value) > limit else value
    if isinstance(value, dict):
        return {k: shorten_strings(v, limit) for k, v in value.items()}
    if isinstance(value, list):
        return [shorten_strings(v, limit) for v in value]
    return value


def json_array_prefix(items: Iterable[Any], limit: int | None) -> bytes:
    """`compact_json(list(items))`, serialising no more than its first `limit` bytes need (long chats stay cheap)."""
    if limit is None:
        return compact_json(list(items))
    parts = [b"["]
    size = 1
    for i, item in enumerate(items):
        piece = (b"," if i else b"") + compact_json(shorten_strings(item, limit))
        parts.append(piece)
        size += len(piece)
        if size >= limit:
            return b"".join(parts)[:limit]
    parts.append(b"]")
    return b"".join(parts)[:limit]
