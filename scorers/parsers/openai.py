"""`openai-parser`: OpenAI's completions, chat completions, Responses, conversations and embeddings, and vLLM's rerank.

Paths (suffixes, in this order: `/chat/completions` also ends in `/completions`):
`/conversations`, `/responses`, `/chat/completions`, `/completions`, `/embeddings`, `/rerank`.

What it reads of a body: `model` (required), the API's prompt field (checked: `prompt`,
`messages`, `input`, `items`, `query` and `documents`), `stream`, `cache_salt`, and the session
the body names (`prompt_cache_key`, else `user`). Media parts of chat messages (`image_url`,
`input_audio`, `video_url`, `audio_url`, `file`) and of Responses input items (`input_image`,
`input_audio`, `input_file`) are the request's media; in the bytes prefix hashing reads, each
stands at its place as the digest of its URL, data or file id.

Responses `previous_response_id`: vLLM keeps a response in the memory of the replica that made
it, so a follow-up must go back there. The parser learns response id -> endpoint from the
responses it reads (a JSON body's `id`, a stream's `response.created` event), in a bounded store
(`responseAffinityCapacity` ids, least recently used out; each kept `responseAffinityTTL` after
its last use), and pins a follow-up whose id it knows to that endpoint. When that endpoint has
left the pool the follow-up is answered 404 (OpenAI's error shape, `param:
previous_response_id`); an id it does not know (never seen by this picker, or expired) is routed
like any request, and the replica it reaches answers as it does for an unknown id. A request with
`store: false` stores nothing, so nothing is learned from its response.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from epp.framework import (
    ErrorCode,
    InferenceError,
    InferenceRequest,
    MediaItem,
    ParsedBody,
    ParseLimits,
    Parser,
    PluginContext,
    PluginParams,
    RenderRequest,
    ResponseInfo,
    body_prompt_characters,
    compact_json,
    decode_json_object,
    json_array_prefix,
    media_digest,
    read_json,
    read_json_or_none,
    session_name,
    shorten_strings,
)
from epp.scorers.parsers.response_store import ResponseStore

COMPLETIONS = "completions"
CHAT = "chat/completions"
RESPONSES = "responses"
CONVERSATIONS = "conversations"
EMBEDDINGS = "embeddings"
RERANK = "rerank"

# The body fields that hold prompt text, counted against `epp serve --max-prompt-chars`.
PROMPT_FIELDS = ("prompt", "messages", "input", "instructions", "items", "query", "documents")
# Content part types that are media, by the modality they carry (chat completions, Responses, vLLM's extras).
MEDIA_PARTS = {"image_url": "image", "input_image": "image", "input_audio": "audio", "audio_url": "audio",
               "video_url": "video", "file": "file", "input_file": "file"}
# The render API path of each API vLLM renders (`vllm serve`, or `vllm launch render`).
RENDER_PATHS = {COMPLETIONS: "/v1/completions/render", CHAT: "/v1/chat/completions/render",
                RESPONSES: "/v1/responses/render"}
# A stored response's own paths: retrieve, delete, cancel, its input items (requests without a body).
STORED_RESPONSE_PATH = re.compile(r"/responses/([^/]+)(?:/cancel|/input_items)?$")
# GenAI semantic conventions' operation names of the APIs that have one.
OPERATIONS = {CHAT: "chat", COMPLETIONS: "text_completion", EMBEDDINGS: "embeddings"}


def _bad(message: str) -> InferenceError:
    return InferenceError(ErrorCode.BAD_REQUEST, message)


def is_token_ids(value: Any) -> bool:
    """A non-empty list of ints (bools are not token ids)."""
    return isinstance(value, list) and bool(value) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value)


def _valid_prompt(prompt: Any) -> bool:
    if isinstance(prompt, str):
        return bool(prompt)
    if not isinstance(prompt, list) or not prompt:
        return False
    if all(isinstance(p, str) for p in prompt):
        return True
    return is_token_ids(prompt) or all(is_token_ids(p) for p in prompt)


def _valid_messages(messages: Any) -> bool:
    if not isinstance(messages, list) or not messages:
        return False
    for message in messages:
        if not isinstance(message, dict):
            return False
        content = message.get("content")
        if content is not None and not isinstance(content, (str, list)):
            return False
        if isinstance(content, list) and not all(isinstance(part, dict) for part in content):
            return False
    return True


def _validate(api: str, body: Mapping[str, Any]) -> None:
    if api == CHAT:
        if not _valid_messages(body.get("messages")):
            raise _bad("invalid chat completions request: must have valid messages field")
    elif api == COMPLETIONS:
        if not _valid_prompt(body.get("prompt")):
            raise _bad("invalid completions request: must have valid prompt field")
    elif api == RESPONSES:
        if body.get("input") in (None, "", []):
            raise _bad("invalid responses request: must have input field")
        previous = body.get("previous_response_id")
        if previous is not None and not (isinstance(previous, str) and previous):
            raise InferenceError(ErrorCode.BAD_REQUEST, "invalid responses request: previous_response_id must be a "
                                 "non-empty string", param="previous_response_id")
    elif api == CONVERSATIONS:
        items = body.get("items")
        if not isinstance(items, list) or not items:
            raise _bad("invalid conversations request: must have items field")
    elif api == EMBEDDINGS:
        if body.get("input") in (None, "", []):
            raise _bad("invalid embeddings request: must have input field")
    elif api == RERANK:
        if body.get("query") in (None, "", []) or body.get("documents") in (None, "", []):
            raise _bad("invalid rerank request: must have query and documents fields")


def prompt_text_of(prompt: Any) -> str:
    """A completions prompt as plain text: strings joined by a space, token ids as decimal numbers."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        return " ".join(prompt_text_of(p) if isinstance(p, (str, list)) else str(p) for p in prompt)
    return "" if prompt is None else str(prompt)


def _text_parts(content: Any) -> Iterator[str]:
    """The text of a message's content: the string itself, or each part's `text`."""
    if isinstance(content, str):
        yield content
    elif isinstance(content, list):
        for part in content:
            if isinstance(part, Mapping) and isinstance(part.get("text"), str):
                yield part["text"]


def media_part(part: Any, item: int = 0) -> MediaItem | None:
    """The media item a content part is (`item`: the index of the prompt item holding it), None for any other part.

    The digest is of the part's payload (its URL, data or file id and their options), not of its
    `type`, so the same image sent as `image_url` and as `input_image` is the same item.
    """
    if part.__class__ is not dict:
        return None
    modality = MEDIA_PARTS.get(part.get("type"))  # type: ignore[arg-type]
    if modality is None:
        return None
    ref = part.get("image_url")
    url = ref.get("url") if isinstance(ref, Mapping) else ref
    inline = url if isinstance(url, str) and url.startswith("data:") else None
    return MediaItem(modality, media_digest({k: v for k, v in part.items() if k != "type"}), item, inline=inline)


def _identity_part(part: Any) -> Any:
    """A content part as prefix hashing reads it: a media part's payload replaced by its digest."""
    found = media_part(part)
    return part if found is None else {"type": part["type"], "digest": found.digest}


def _identity_content(holder: Any) -> Any:
    """A message or input item whose media parts stand as their digests (unchanged when it has none)."""
    if holder.__class__ is not dict:
        return holder
    content = holder.get("content")
    if content.__class__ is not list or not any(
            part.__class__ is dict and part.get("type") in MEDIA_PARTS for part in content):
        return holder
    return {**holder, "content": [_identity_part(part) for part in content]}


def _media_of(items: Sequence[Any]) -> list[MediaItem]:
    """The media parts of messages or input items (each holding `content` parts), in order."""
    out: list[MediaItem] = []
    for i, holder in enumerate(items):
        content = holder.get("content") if isinstance(holder, Mapping) else None
        if isinstance(content, list):
            out.extend(found for found in (media_part(part, i) for part in content) if found is not None)
        elif isinstance(holder, Mapping):  # a Responses input item may be a bare content part
            found = media_part(holder, i)
            if found is not None:
                out.append(found)
    return out


def responses_input(body: Mapping[str, Any]) -> list[Any]:
    """A Responses body's input as a list of items (a string input is one user message)."""
    value = body.get("input")
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    return value if isinstance(value, list) else []


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def sse_events(chunk: bytes, needle: bytes = b"") -> Iterator[Any]:
    """The JSON payloads of a chunk's SSE `data:` lines that hold `needle` (`[DONE]` and non-JSON lines skipped).

    A payload nested too deep raises `UnreadableResponse` (the picker passes the response on unread).
    """
    for line in chunk.split(b"\n"):
        line = line.strip()
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if not payload or payload == b"[DONE]" or needle not in payload:
            continue
        event = read_json_or_none(payload)
        if event is not None:
            yield event


def json_usage(body: bytes) -> tuple[Any, dict[str, Any] | None]:
    """A whole JSON response and its `usage` object (None when it has none or is not JSON)."""
    parsed = read_json_or_none(body)
    usage = parsed.get("usage") if isinstance(parsed, dict) else None
    return parsed, usage if isinstance(usage, dict) else None


def openai_usage_names(usage: dict[str, Any]) -> dict[str, Any]:
    """A Responses API usage with chat's names added (`RequestFormat.usage` answers in those): `prompt_tokens`,
    `completion_tokens`, `prompt_tokens_details` from `input_tokens`, `output_tokens`, `input_tokens_details`."""
    out = dict(usage)
    for ours, theirs in (("prompt_tokens", "input_tokens"), ("completion_tokens", "output_tokens"),
                         ("prompt_tokens_details", "input_tokens_details")):
        if theirs in usage and ours not in usage:
            out[ours] = usage[theirs]
    return out


class OpenAIParser(Parser):
    """OpenAI completions, chat, Responses (previous_response_id affinity), conversations, embeddings; vLLM rerank."""

    type_name = "openai-parser"
    paths = (("/conversations", CONVERSATIONS), ("/responses", RESPONSES), ("/chat/completions", CHAT),
             ("/completions", COMPLETIONS), ("/embeddings", EMBEDDINGS), ("/rerank", RERANK))

    def __init__(self, name: str | None = None, params: PluginParams | None = None,
                 context: PluginContext | None = None) -> None:
        super().__init__(name)
        params = params or PluginParams(self.name, None)
        context = context or PluginContext()
        capacity = params.int("responseAffinityCapacity", 100_000, minimum=0)
        ttl_s = params.duration("responseAffinityTTL", 3600.0, minimum=1.0)
        self._endpoints = context.endpoints
        self.responses = ResponseStore(capacity, ttl_s, name=self.name, registry=context.metrics_registry)

    def describe(self) -> str:
        return (f"responseAffinityCapacity={self.responses.capacity} "
                f"responseAffinityTTL={self.responses.ttl_s:g}s")

    def debug_state(self) -> Mapping[str, Any]:
        return {"response_affinity_entries": len(self.responses)}

    # -- parsing --------------------------------------------------------------------------------

    def parse(self, body: bytes, *, api: str, path: str, limits: ParseLimits) -> ParsedBody:
        parsed = decode_json_object(body, limits.max_json_depth)
        _validate(api, parsed)
        return self.parsed_body(parsed, api, limits)

    def parsed_body(self, parsed: dict[str, Any], api: str, limits: ParseLimits) -> ParsedBody:
        """The fields every OpenAI-shaped body shares: model (required), stream, salt, session, prompt size."""
        model = parsed.get("model")
        if not isinstance(model, str) or not model:
            raise _bad("model not found in request body")
        salt = parsed.get("cache_salt")
        pinned = self._pinned(parsed.get("previous_response_id")) if api == RESPONSES else None
        return ParsedBody(
            model=model, body=parsed, stream=parsed.get("stream") is True,
            cache_salt=salt if isinstance(salt, str) and salt else None,
            session=session_name(parsed.get("prompt_cache_key") or parsed.get("user")),
            prompt_chars=body_prompt_characters(parsed, limits.max_prompt_chars + 1, PROMPT_FIELDS),
            pinned_endpoint=pinned)

    def _pinned(self, previous: Any, param: str = "previous_response_id") -> str | None:
        """The endpoint a follow-up must go to; 404 when the one that stored its previous response left the pool."""
        if not isinstance(previous, str):
            return None
        endpoint: str | None = self.responses.endpoint_of(previous)
        if endpoint is None:
            self.responses.counted("unknown")
            return None
        if self._endpoints is not None and self._endpoints.get(endpoint) is None:
            self.responses.counted("gone")
            raise InferenceError(
                ErrorCode.NOT_FOUND,
                f"previous response {previous[:64]!r} was stored by replica {endpoint}, which has left the pool: "
                "it cannot be continued (send the conversation as input instead)", param=param)
        self.responses.counted("pinned")
        return endpoint

    def path_affinity(self, path: str) -> str | None:
        """`GET`/`DELETE /v1/responses/{id}` (and its `/cancel`, `/input_items`) go where that response is stored."""
        found = STORED_RESPONSE_PATH.search(path)
        return self._pinned(found.group(1), param="response_id") if found else None

    # -- normalised views -----------------------------------------------------------------------

    def prompt_items(self, request: InferenceRequest) -> Sequence[Any]:
        body, api = request.body, request.api
        if api == CHAT:
            return body.get("messages") or ()
        if api == COMPLETIONS:
            prompt = body.get("prompt")
            return [prompt] if isinstance(prompt, str) or is_token_ids(prompt) else prompt or ()
        if api == RESPONSES:
            instructions = body.get("instructions")
            items = responses_input(body)
            return [{"role": "system", "content": instructions}, *items] if isinstance(instructions, str) else items
        if api == CONVERSATIONS:
            return body.get("items") or ()
        if api == RERANK:
            return [body.get("query"), *(body.get("documents") or ())]
        value = body.get("input")
        return [value] if isinstance(value, str) or is_token_ids(value) else value or ()

    def prompt_text(self, request: InferenceRequest) -> str:
        body, api = request.body, request.api
        if api == COMPLETIONS:
            return prompt_text_of(body.get("prompt"))
        if api in (CHAT, RESPONSES, CONVERSATIONS):
            items = self.prompt_items(request)
            return "\n".join(text for item in items if isinstance(item, Mapping)
                             for text in _text_parts(item.get("content")))
        if api == RERANK:
            return "\n".join(x for x in self.prompt_items(request) if isinstance(x, str))
        return prompt_text_of(body.get("input"))

    def token_ids(self, request: InferenceRequest) -> Sequence[int] | None:
        if request.api != COMPLETIONS:
            return None
        prompt = request.body.get("prompt")
        if isinstance(prompt, list) and prompt and is_token_ids(prompt[0]):
            prompt = prompt[0]  # a batch of prompts routes by its first
        return list(prompt) if isinstance(prompt, list) and is_token_ids(prompt) else None

    def media(self, request: InferenceRequest) -> Sequence[MediaItem]:
        if request.api in (CHAT, RESPONSES):
            return _media_of(self.prompt_items(request))
        return ()

    def prompt_bytes(self, request: InferenceRequest, limit: int | None) -> bytes:
        body, api = request.body, request.api
        if api == COMPLETIONS:
            text = prompt_text_of(body.get("prompt"))
            # A character is at least one UTF-8 byte, so slicing characters first keeps enough bytes.
            data = (text if limit is None else text[:limit]).encode("utf-8", "surrogatepass")
        elif api == CHAT:
            messages = body.get("messages")
            data = json_array_prefix(map(_identity_content, messages if isinstance(messages, list) else ()), limit)
        elif api == RESPONSES:
            value = body.get("input")
            if isinstance(value, list):
                value = [_identity_content(item) for item in value]
            data = json_array_prefix([{"instructions": body.get("instructions")}, {"tools": body.get("tools")},
                                      {"input": value}], limit)
        elif api == CONVERSATIONS:
            items = body.get("items")
            data = json_array_prefix(items if isinstance(items, list) else [], limit)
        elif api == RERANK:
            data = json_array_prefix([{"query": body.get("query")}, {"documents": body.get("documents")}], limit)
        else:
            value = body.get("input")
            data = compact_json(value if limit is None else shorten_strings(value, limit))
        return data if limit is None else data[:limit]

    def previous_response(self, request: InferenceRequest) -> str | None:
        value = request.body.get("previous_response_id") if request.api == RESPONSES else None
        return value if isinstance(value, str) else None

    def chat_body(self, request: InferenceRequest, *, merge_inline_system: bool = False) -> Mapping[str, Any] | None:
        return request.body if request.api == CHAT else None

    def completion_text(self, request: InferenceRequest) -> tuple[str, bool] | None:
        if request.api != COMPLETIONS:
            return None
        prompt = request.body.get("prompt")
        if isinstance(prompt, list) and prompt:
            prompt = prompt[0]
        if not isinstance(prompt, str):
            return None
        return prompt, request.body.get("add_special_tokens", True) is not False

    def render_request(self, request: InferenceRequest, *, prefill_only: bool = False) -> RenderRequest | None:
        path = RENDER_PATHS.get(request.api)
        if path is None:
            return None
        body = dict(request.body)
        if prefill_only:
            body["max_tokens"] = 1  # a render-only output budget (llm-d's prefillOnly)
            if "max_completion_tokens" in body:
                body["max_completion_tokens"] = 1
        return RenderRequest(path, body, chat=request.api != COMPLETIONS)

    def operation(self, request: InferenceRequest) -> str | None:
        return OPERATIONS.get(request.api)

    # -- responses ------------------------------------------------------------------------------

    def usage(self, request: InferenceRequest, body: bytes, *, streamed: bool) -> dict[str, Any] | None:
        found = self._usage(body, streamed=streamed)
        return openai_usage_names(found) if found is not None and request.api == RESPONSES else found

    @staticmethod
    def _usage(body: bytes, *, streamed: bool) -> dict[str, Any] | None:
        if not streamed:
            return json_usage(body)[1]
        if b"usage" not in body:
            return None
        for event in sse_events(body, b"usage"):
            if not isinstance(event, dict):
                continue
            if event.get("type") == "response.completed":
                inner = event.get("response")
                usage = inner.get("usage") if isinstance(inner, dict) else None
            else:
                usage = event.get("usage")
            if isinstance(usage, dict):
                return usage
        return None

    def carries_token(self, request: InferenceRequest, chunk: bytes) -> bool:
        # vLLM's first chat chunk carries `"role":"assistant","content":""`: sent with the first token,
        # but a server may send it earlier, so the first token is timed from the next chunk.
        if not chunk.strip():
            return False
        return not (b'"role"' in chunk and b'"content":""' in chunk and chunk.count(b"data:") <= 1)

    def response_id(self, request: InferenceRequest, body: bytes, *, streamed: bool) -> str | None:
        if request.api != RESPONSES:
            return None
        if not streamed:
            try:
                parsed = read_json(body)
            except (ValueError, UnicodeDecodeError):
                return None
            ok = isinstance(parsed, dict) and parsed.get("object") == "response"
            return _response_id(parsed.get("id")) if ok else None
        if b"response.created" not in body and b"response.completed" not in body:
            return None
        for event in sse_events(body, b'"response.'):
            if isinstance(event, dict) and event.get("type") in ("response.created", "response.completed"):
                inner = event.get("response")
                found = _response_id(inner.get("id")) if isinstance(inner, dict) else None
                if found is not None:
                    return found
        return None

    def response_stored(self, request: InferenceRequest, response: ResponseInfo, endpoint: str) -> None:
        """Learn which endpoint stored a Responses response: a follow-up naming it must go there."""
        if response.response_id is None or response.status != "200" or request.body.get("store") is False:
            return
        self.responses.learn(response.response_id, endpoint)


def _response_id(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None
