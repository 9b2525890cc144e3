"""The user-input bytes of a request, per API, as the approximate prefix cache hashes them (GIE §4.2)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import xxhash

from epp.framework import ApiKind, InferenceRequest

# Claude Code's first system block carries a per-request hash; vLLM drops it from the prompt (so
# the rest stays cacheable), and so does the prefix text here.
ANTHROPIC_BILLING_HEADER = "x-anthropic-billing-header"
# Anthropic content blocks whose `source` (base64 data, a URL, a file id) stands for the content.
_SOURCE_BLOCKS = frozenset({"image", "document"})
# One encoder for every call: json.dumps with options builds a new one each time (3 µs a message).
_encode = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode


def _compact(value: Any) -> bytes:
    # surrogatepass: a lone surrogate must not make hashing fail (the parser rejects such bodies anyway).
    return _encode(value).encode("utf-8", "surrogatepass")


def _prompt_text(prompt: Any) -> str:
    """Completions prompt as plain text: strings joined by a space, token ids as decimal numbers."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        return " ".join(_prompt_text(p) if isinstance(p, (str, list)) else str(p) for p in prompt)
    return "" if prompt is None else str(prompt)


def _shorten_strings(value: Any, limit: int) -> Any:
    """`value` with every string cut to `limit` characters.

    The first `limit` bytes of its JSON are unchanged: JSON is identical up to the first cut
    string, and that string alone still serialises to at least `limit` bytes.
    """
    if isinstance(value, str):
        return value[:limit] if len(value) > limit else value
    if isinstance(value, dict):
        return {k: _shorten_strings(v, limit) for k, v in value.items()}
    if isinstance(value, list):
        return [_shorten_strings(v, limit) for v in value]
    return value


def _json_array_prefix(items: Iterable[Any], limit: int | None) -> bytes:
    """`json(items)` compact, but serialise no more than the first `limit` bytes need (long chats are cheap)."""
    if limit is None:
        return _compact(list(items))
    parts = [b"["]
    size = 1
    for i, item in enumerate(items):
        piece = (b"," if i else b"") + _compact(_shorten_strings(item, limit))
        parts.append(piece)
        size += len(piece)
        if size >= limit:
            return b"".join(parts)[:limit]
    parts.append(b"]")
    return b"".join(parts)[:limit]


def user_input_bytes(request: InferenceRequest, limit: int | None = None) -> bytes:
    """The bytes that identify a request's prompt; at most `limit` bytes when a limit is given."""
    body = request.body
    api = request.api
    if api is ApiKind.COMPLETIONS:
        text = _prompt_text(body.get("prompt"))
        # A character is at least one UTF-8 byte, so slicing characters first keeps enough bytes.
        data = (text if limit is None else text[:limit]).encode("utf-8", "surrogatepass")
    elif api is ApiKind.CHAT_COMPLETIONS:
        messages = body.get("messages")
        data = _json_array_prefix(messages if isinstance(messages, list) else [], limit)
    elif api is ApiKind.RESPONSES:
        data = _json_array_prefix([{"instructions": body.get("instructions")}, {"tools": body.get("tools")},
                                   {"input": body.get("input")}], limit)
    elif api is ApiKind.CONVERSATIONS:
        items = body.get("items")
        data = _json_array_prefix(items if isinstance(items, list) else [], limit)
    elif api is ApiKind.MESSAGES:
        data = _json_array_prefix(_anthropic_items(body), limit)
    elif api is ApiKind.RERANK:
        data = _json_array_prefix([{"query": body.get("query")}, {"documents": body.get("documents")}], limit)
    elif api is ApiKind.PASSTHROUGH:
        data = b""  # the body is not read: no prompt
    else:
        value = body.get("input")
        data = _compact(value if limit is None else _shorten_strings(value, limit))
    return data if limit is None else data[:limit]


def _anthropic_block(block: Any) -> Any:
    """A content block as it identifies the prompt: its source digested, prompt-caching marks left out.

    A base64 image or document is megabytes that would use up the prefix budget and say no more
    than its digest does; `cache_control` marks move from turn to turn without changing the prompt.
    """
    if not isinstance(block, Mapping):
        return block
    out = {key: value for key, value in block.items() if key != "cache_control"}
    if block.get("type") in _SOURCE_BLOCKS and "source" in out:
        out["source"] = {"digest": xxhash.xxh3_128_hexdigest(_compact(out["source"]))}
    content = out.get("content")
    if isinstance(content, list):  # a tool_result's blocks
        out["content"] = [_anthropic_block(b) for b in content]
    return out


def _anthropic_system(system: Any) -> Any:
    if isinstance(system, str) and system.startswith(ANTHROPIC_BILLING_HEADER):
        return system.partition("\n")[2]
    if not isinstance(system, list):
        return system
    return [_anthropic_block(b) for b in system
            if not (isinstance(b, Mapping) and isinstance(b.get("text"), str)
                    and b["text"].startswith(ANTHROPIC_BILLING_HEADER))]


def _anthropic_items(body: Mapping[str, Any]) -> Iterator[Any]:
    """A Messages body in prompt order: system, tools, then each message; made lazily (long chats stay cheap)."""
    yield {"system": _anthropic_system(body.get("system"))}
    tools = body.get("tools")
    yield {"tools": [_anthropic_block(t) for t in tools] if isinstance(tools, list) else tools}
    messages = body.get("messages")
    for message in messages if isinstance(messages, list) else ():
        if not isinstance(message, Mapping):
            yield message
            continue
        content = message.get("content")
        yield {"role": message.get("role"),
               "content": [_anthropic_block(b) for b in content] if isinstance(content, list) else content}


def user_input_length(request: InferenceRequest) -> int:
    """Length in bytes of the user input (for token estimates)."""
    return len(user_input_bytes(request))
