"""Immutable data the scheduler works on: endpoints with their metrics, and parsed requests with their format."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, cast

from epp.framework.errors import ErrorCode, InferenceError

_EMPTY: Mapping[str, str] = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class EndpointMetrics:
    """One scrape of a model server's `/metrics`; `update_time` is `time.monotonic()` (0 = never)."""

    waiting_queue_size: int = 0
    running_requests_size: int = 0
    kv_cache_usage: float = 0.0
    active_models: frozenset[str] = frozenset()
    waiting_models: frozenset[str] = frozenset()
    max_active_models: int = 0
    cache_block_size: int = 0
    cache_num_blocks: int = 0
    update_time: float = 0.0
    # Cumulative prompt tokens looked up in / served from vLLM's prefix cache (counters).
    prefix_cache_queries: float = 0.0
    prefix_cache_hits: float = 0.0
    # vLLM sleep mode: the engine holds requests without serving them until woken (`/wake_up`).
    sleeping: bool = False
    # KV blocks of the CPU offload tier (`cache_config_info`'s num_cpu_blocks; 0: none or not said).
    cache_num_cpu_blocks: int = 0

    def age(self, now: float | None = None) -> float:
        """Seconds since these metrics were scraped (`time.monotonic()` clock); infinite if never."""
        if self.update_time <= 0.0:
            return float("inf")
        return (time.monotonic() if now is None else now) - self.update_time

    def is_stale(self, threshold: float, now: float | None = None) -> bool:
        """True when the metrics were never scraped or are older than `threshold` seconds."""
        return self.age(now) > threshold


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One model-server endpoint (`ip:port`) of the pool, with its latest metrics snapshot."""

    address: str
    port: int
    labels: Mapping[str, str] = field(default_factory=lambda: _EMPTY)
    metrics: EndpointMetrics = field(default_factory=EndpointMetrics)
    metrics_port: int | None = None
    healthy: bool = True
    # `ip:port`, computed once: scorers read `name` for every endpoint of every request.
    _hostport: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        host = f"[{self.address}]" if ":" in self.address else self.address
        object.__setattr__(self, "_hostport", f"{host}:{self.port}")

    @property
    def hostport(self) -> str:
        """`ip:port`, with IPv6 addresses bracketed, as Envoy expects it."""
        return self._hostport

    @property
    def name(self) -> str:
        """Stable identity of the endpoint inside the picker (its `ip:port`)."""
        return self._hostport

    @property
    def metrics_hostport(self) -> str:
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"{host}:{self.metrics_port or self.port}"


@dataclass(frozen=True, slots=True)
class MediaItem:
    """One image, audio clip, video or file inside a prompt, as its parser found it.

    `digest` identifies its content (xxh3-128 of its URL, data or file id, in hex): two requests
    with the same image have the same digest. `item` is the index of the prompt item (message,
    content block) that holds it, its place in the prompt's order. `engine_hash`, `token_offset`
    and `token_length` are the model server's own identifier of the item and the placeholder
    tokens it takes in the prompt's token ids, when the client sent them (vLLM's `features` of
    `/inference/v1/generate`) or the renderer answered them. `inline` is the item's data (a `data:`
    URL or base64) when the request carries it rather than a link: what an estimate sizes an image from.
    """

    modality: str
    digest: str
    item: int = 0
    engine_hash: str | None = None
    token_offset: int | None = None
    token_length: int | None = None
    inline: str | None = None


@dataclass(frozen=True, slots=True)
class RenderRequest:
    """How vLLM's render API turns a request into token ids: the path to POST and the JSON body."""

    path: str
    body: Mapping[str, Any]
    # A chat (template, maybe media): the renderer may take longer (`vllm.mmTimeout`).
    chat: bool = False


# OpenAI's error `type` per GIE code: the default error shape, the one most client libraries read.
_OPENAI_ERROR_TYPES: dict[ErrorCode, str] = {
    ErrorCode.BAD_REQUEST: "invalid_request_error",
    ErrorCode.UNAUTHORIZED: "authentication_error",
    ErrorCode.FORBIDDEN: "permission_error",
    ErrorCode.NOT_FOUND: "not_found_error",
    ErrorCode.REQUEST_TIMEOUT: "timeout_error",
    ErrorCode.PAYLOAD_TOO_LARGE: "invalid_request_error",
    ErrorCode.HEADERS_TOO_LARGE: "invalid_request_error",
    ErrorCode.RESOURCE_EXHAUSTED: "rate_limit_error",
    ErrorCode.INTERNAL: "server_error",
    ErrorCode.SERVICE_UNAVAILABLE: "service_unavailable_error",
}


def openai_error_body(err: InferenceError) -> bytes:
    """`{"error": {"message", "type", "param", "code"}}`: GIE's text as the message, GIE's code as the code."""
    value = {"error": {"message": err.body, "type": _OPENAI_ERROR_TYPES.get(err.code, "server_error"),
                       "param": err.param, "code": err.code.label}}
    return json.dumps(value, ensure_ascii=False).encode("utf-8", "surrogatepass")


class RequestFormat:
    """What a request asks of the API format that parsed it: normalised views of its prompt, how its responses read.

    `epp.framework.Parser` (the plugin a format registers as) extends this; it lives here so that
    an `InferenceRequest` can hold its format. Plugins do not call these methods themselves: they
    ask the request (`request.prompt_text()`, `request.prompt_bytes(limit)`...), which calls its
    format once and keeps the answer. Each default says "nothing known"; a format overrides what
    its API carries.
    """

    # -- the request -----------------------------------------------------------------------------

    def prompt_items(self, request: InferenceRequest) -> Sequence[Any]:
        """The prompt's items in order (messages, content blocks, input items), as JSON values."""
        return ()

    def prompt_text(self, request: InferenceRequest) -> str:
        """The prompt as plain text (its text parts joined), for estimates; "" when it has none."""
        return ""

    def token_ids(self, request: InferenceRequest) -> Sequence[int] | None:
        """The prompt's token ids when the client sent them (the first prompt of a batch), else None."""
        return None

    def media(self, request: InferenceRequest) -> Sequence[MediaItem]:
        """The prompt's images, audio, video and files, in prompt order."""
        return ()

    def prompt_bytes(self, request: InferenceRequest, limit: int | None) -> bytes:
        """The bytes that identify the prompt for approximate prefix hashing (at most `limit` of them).

        Two prompts share a prefix of these bytes when they share a prefix of content: a media
        item is stood for by its digest at its place, so the same image gives the same bytes and
        another image other bytes from there on.
        """
        return b""

    def generates(self, request: InferenceRequest) -> bool:
        """Whether serving the request runs the model over its prompt (False: it only counts tokens, say)."""
        return True

    def previous_response(self, request: InferenceRequest) -> str | None:
        """The id of a stored response this request continues (Responses' `previous_response_id`), if any."""
        return None

    def chat_body(self, request: InferenceRequest, *, merge_inline_system: bool = False) -> Mapping[str, Any] | None:
        """The OpenAI chat body the model server renders with its chat template for this request, or None.

        `messages` and the template's options (`tools`, `documents`, `add_generation_prompt`,
        `continue_final_message`, `add_special_tokens`, `chat_template_kwargs`): what local
        tokenization and vLLM's `/tokenize` take. `merge_inline_system`: the model's template takes
        a system message only first, so later ones are merged into it (as vLLM does for Anthropic).
        """
        return None

    def completion_text(self, request: InferenceRequest) -> tuple[str, bool] | None:
        """The text prompt the model server tokenizes (a batch's first), and whether it adds special tokens."""
        return None

    def render_request(self, request: InferenceRequest, *, prefill_only: bool = False) -> RenderRequest | None:
        """The vLLM render API call that gives the request's token ids; `prefill_only`: an output budget of 1."""
        return None

    def operation(self, request: InferenceRequest) -> str | None:
        """The GenAI semantic conventions' `gen_ai.operation.name` of the request (chat, embeddings...)."""
        return None

    # -- the response ----------------------------------------------------------------------------

    def usage(self, request: InferenceRequest, body: bytes, *, streamed: bool) -> dict[str, Any] | None:
        """Token usage of a whole response (`streamed` False) or of one streamed chunk, in OpenAI's names.

        `prompt_tokens`, `completion_tokens`, `prompt_tokens_details.cached_tokens`: what the
        picker's accounting reads. Called on each streamed chunk until one answers, so it looks at
        the bytes before parsing them. May raise `epp.framework.UnreadableResponse` (the response
        is then passed on unread, and counted).
        """
        return None

    def carries_token(self, request: InferenceRequest, chunk: bytes) -> bool:
        """Whether a streamed chunk holds generated output (the first one ends the request's prefill)."""
        return bool(chunk.strip())

    def response_id(self, request: InferenceRequest, body: bytes, *, streamed: bool) -> str | None:
        """The id the model server stored the response under, when the API stores responses (Responses' `id`)."""
        return None

    def response_stored(self, request: InferenceRequest, response: ResponseInfo, endpoint: str) -> None:
        """The response to `request` ended and `endpoint` stored it under `response.response_id`.

        Called once per request, only for a response that named a stored id (so it costs other
        requests nothing): a format whose follow-ups must reach that endpoint remembers it here.
        """

    def error_body(self, err: InferenceError) -> bytes:
        """The JSON body of the picker's own error answer, in the shape this API's clients read (default OpenAI's)."""
        return openai_error_body(err)


_NO_FORMAT = RequestFormat()


@dataclass(frozen=True, slots=True)
class InferenceRequest:
    """A parsed inference request. `body` is the (possibly model-rewritten) JSON object.

    The prompt is read through the request's `format` (the parser of its API): `prompt_text()`,
    `prompt_items()`, `token_ids()`, `media()`, `prompt_bytes(limit)`, `generates`,
    `previous_response`. Each is computed on first use and kept, so plugins that need none of
    them cost nothing, and several that need one compute it once.
    """

    request_id: str
    # The API, as the request's parser names it (`chat/completions`, `messages`, `generate`...).
    api: str
    model: str
    target_model: str
    body: Mapping[str, Any]
    headers: Mapping[str, str] = field(default_factory=lambda: _EMPTY)
    stream: bool = False
    cache_salt: str | None = None
    priority: int = 0
    objective: str | None = None
    fairness_id: str = "default-flow"
    subset_hint: tuple[str, ...] | None = None
    path: str = "/v1/completions"
    # Latency objectives of this request in milliseconds (`x-llm-d-slo-ttft-ms`, `-tpot-ms`), if any.
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    # Characters of the prompt text as `epp.framework.load.prompt_characters` counts them, when the
    # parser measured them already (None: counted on demand); read by every plugin that needs them.
    prompt_chars: int | None = None
    # The conversation or agent session the body names, as its API spells it (OpenAI's
    # `prompt_cache_key`, else `user`; Anthropic's `metadata.user_id`), if any. Session headers are
    # read by the session plugins, which combine them with this.
    body_session: str | None = None
    # The API format that parsed the request (None: nothing is known of the body; every view is empty).
    format: RequestFormat | None = None
    # The endpoint holding state the request continues (the replica that stored the response a
    # Responses `previous_response_id` names): only it may serve the request.
    pinned_endpoint: str | None = None
    # The views computed so far (one dict per request; the request itself stays immutable).
    _views: dict[Any, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def _format(self) -> RequestFormat:
        return self.format if self.format is not None else _NO_FORMAT

    def prompt_items(self) -> Sequence[Any]:
        """The prompt's items in order (messages, content blocks, input items) as JSON values."""
        views = self._views
        if "items" not in views:
            views["items"] = self._format.prompt_items(self)
        return cast(Sequence[Any], views["items"])

    def prompt_text(self) -> str:
        """The prompt as plain text (its text parts joined); "" when it has none."""
        views = self._views
        if "text" not in views:
            views["text"] = self._format.prompt_text(self)
        return cast(str, views["text"])

    def token_ids(self) -> Sequence[int] | None:
        """The prompt's token ids when the client sent them, else None (they may still be tokenized)."""
        views = self._views
        if "tokens" not in views:
            views["tokens"] = self._format.token_ids(self)
        return cast("Sequence[int] | None", views["tokens"])

    def media(self) -> Sequence[MediaItem]:
        """The prompt's images, audio, video and files, in prompt order."""
        views = self._views
        if "media" not in views:
            views["media"] = tuple(self._format.media(self))
        return cast(Sequence[MediaItem], views["media"])

    @property
    def generates(self) -> bool:
        """Whether serving the request runs the model over its prompt (False: a token count, say)."""
        views = self._views
        if "generates" not in views:
            views["generates"] = self._format.generates(self)
        return cast(bool, views["generates"])

    @property
    def previous_response(self) -> str | None:
        """The stored response this request continues (Responses' `previous_response_id`), if any."""
        views = self._views
        if "previous" not in views:
            views["previous"] = self._format.previous_response(self)
        return cast("str | None", views["previous"])

    def prompt_bytes(self, limit: int | None = None) -> bytes:
        """The bytes that identify the prompt for approximate prefix hashing, at most `limit` of them."""
        views = self._views
        key = ("bytes", limit)
        found = views.get(key)
        if found is None:
            found = views[key] = self._format.prompt_bytes(self, limit)
        return cast(bytes, found)


@dataclass(slots=True)
class ResponseInfo:
    """What the picker sees of a response; hooks may add headers to `set_headers`."""

    status: str = ""
    headers: dict[str, str] = field(default_factory=dict)
    served_endpoint: str | None = None
    streaming: bool = False
    usage: dict[str, Any] | None = None
    end_of_stream: bool = False
    set_headers: dict[str, str] = field(default_factory=dict)
    # The id the model server stored the response under (Responses API), read by the request's format.
    response_id: str | None = None
