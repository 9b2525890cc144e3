"""token-producer: the prompt's token ids for the plugins that need them (llm-d's `token-producer`).

Backends, as llm-d selects them:
- `vllm` (a `vllm` section, or `modelName`): the model server renders the prompt over HTTP, as it
  will when serving it: `POST /v1/completions/render`, `/v1/chat/completions/render`,
  `/v1/responses/render` or `/v1/messages/render` with the request's JSON body. A vLLM that does
  not serve those (they need `--enable-scale-out`) is asked `POST /tokenize` instead (a Messages
  body mapped onto chat messages as vLLM does): at start-up `modelName` is rendered once,
  and a 403, 404 or 405 answer switches to `/tokenize`. Each call is bounded (`maxConcurrency` at
  once, a timeout: `vllm.timeout`, `vllm.mmTimeout` for chat) and answers are cached by body
  (`cacheTokens` tokens, least recently used out). A failure or timeout leaves the request
  without tokens: consumers score it without them.
- `local` (our `tokenizers: {model: directory}`): the model's own tokenizer files, in process.
- `estimate` (neither): 4 bytes of prompt text per token id, for token counts only (the ids are
  not the engine's, so the precise producer does not key blocks with them).
The result is `PROMPT_TOKENS` in the request's `CycleState`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import aiohttp
import xxhash
from prometheus_client import CollectorRegistry, Counter, Gauge

from epp.framework import (
    ConfigError,
    CycleState,
    DataProducer,
    Endpoint,
    InferenceRequest,
    MediaItem,
    PluginContext,
    PluginParams,
    PluginRegistry,
    once_per_registry,
)
from epp.framework.datakeys import PROMPT_TOKENS, PromptTokens
from epp.tokenization.estimate import EstimateSettings, describe_estimate
from epp.tokenization.pool import TokenizerPool

log = logging.getLogger(__name__)

# What the start-up probe renders (any vLLM that serves the render API serves this one).
PROBE_RENDER_PATH = "/v1/completions/render"
TOKENIZE_PATH = "/tokenize"
# The chat fields vLLM's /tokenize takes besides the messages.
_TOKENIZE_CHAT_FIELDS = ("add_generation_prompt", "continue_final_message", "add_special_tokens", "chat_template",
                         "chat_template_kwargs", "tools")
VLLM_FIELDS = ("url", "timeout", "mmTimeout", "insecureSkipVerify", "caCertPath", "clientCertPath", "clientKeyPath",
               "messagesRenderMode", "prefillOnly", "endpointDiscovery")
ESTIMATE_BYTES_PER_TOKEN = 4


class _Metrics:
    def __init__(self, registry: CollectorRegistry | None) -> None:
        self.outcomes = Counter("epp_token_producer_requests", "Prompts a token-producer was asked for, by "
                                "backend and outcome (cached, rendered, tokenized, estimated, failed, timeout, "
                                "unsupported)", ["plugin", "backend", "outcome"], registry=registry)
        self.cache_tokens = Gauge("epp_token_producer_cache_tokens", "Tokens held in a token-producer's cache "
                                  "of rendered prompts", ["plugin"], registry=registry)


# A rendered prompt: its token ids and its media items (with their placeholder ranges).
_Rendered = tuple[tuple[int, ...], tuple[MediaItem, ...]]


class _TokenCache:
    """Rendered prompts by body digest, bounded by the tokens held; least recently used out."""

    def __init__(self, capacity_tokens: int, gauge: Gauge) -> None:
        self.capacity = capacity_tokens
        self.tokens = 0
        self._entries: OrderedDict[bytes, _Rendered] = OrderedDict()
        self._gauge = gauge

    def get(self, key: bytes) -> _Rendered | None:
        found = self._entries.get(key)
        if found is not None:
            self._entries.move_to_end(key)
        return found

    def put(self, key: bytes, rendered: _Rendered) -> None:
        if len(rendered[0]) > self.capacity or key in self._entries:
            return
        self._entries[key] = rendered
        self.tokens += len(rendered[0])
        while self.tokens > self.capacity:
            _, dropped = self._entries.popitem(last=False)
            self.tokens -= len(dropped[0])
        self._gauge.set(self.tokens)


class TokenProducer(DataProducer):
    """The prompt's token ids (PROMPT_TOKENS) from the model server's renderer, local tokenizer files, or an
    estimate."""

    type_name = "token-producer"

    def __init__(self, name: str, params: PluginParams, context: PluginContext) -> None:
        super().__init__(name)
        self.model_name = params.str("modelName", None)
        vllm = params.mapping("vllm", None)
        tokenizers = params.mapping("tokenizers", None)
        estimate = params.mapping("estimate", None)
        if estimate is not None and (tokenizers or vllm is not None or self.model_name):
            raise ConfigError(f"plugin {name!r}: 'estimate' selects the estimate backend; it goes with neither "
                              "'vllm'/'modelName' nor 'tokenizers'")
        # Images and videos of a request counted as llm-d's estimate backend counts them.
        self.estimate = EstimateSettings.parse(name, estimate)
        if tokenizers and (vllm is not None or self.model_name):
            raise ConfigError(f"plugin {name!r}: set either 'tokenizers' (local tokenizer files) or "
                              "'vllm'/'modelName' (the model server's renderer), not both")
        self.backend = "vllm" if vllm is not None or self.model_name else "local" if tokenizers else "estimate"
        self.max_concurrency = params.int("maxConcurrency", 32, minimum=1)
        cache_tokens = params.int("cacheTokens", 1_000_000, minimum=0)
        registry = context.metrics_registry
        self._metrics = once_per_registry(registry, "epp_token_producer", _Metrics)
        self._cache = _TokenCache(cache_tokens, self._metrics.cache_tokens.labels(plugin=name))
        self._session: aiohttp.ClientSession | None = None
        self._use_tokenize = False
        self._semaphore = asyncio.Semaphore(self.max_concurrency)
        self._pool: TokenizerPool | None = None
        if self.backend == "vllm":
            self._vllm_settings(name, dict(vllm or {}))
        elif self.backend == "local":
            for model, path in (tokenizers or {}).items():
                if not isinstance(path, str):
                    raise ConfigError(f"plugin {name!r}: tokenizers[{model!r}] must be a directory path")
            self._pool = TokenizerPool(dict(tokenizers or {}), registry=registry)

    def _vllm_settings(self, name: str, vllm: dict[str, Any]) -> None:
        unknown = sorted(set(vllm) - set(VLLM_FIELDS))
        if unknown:
            raise ConfigError(f"plugin {name!r}: parameter 'vllm': unknown field(s) {unknown}; allowed: "
                              f"{', '.join(VLLM_FIELDS)}")
        if not self.model_name:
            raise ConfigError(f"plugin {name!r}: parameter 'modelName' is required with the vllm backend")
        if vllm.get("endpointDiscovery") is not None:
            raise ConfigError(f"plugin {name!r}: parameter 'vllm.endpointDiscovery' is not supported: give the "
                              "renderer's 'vllm.url'")
        mode = vllm.get("messagesRenderMode", "auto")
        if mode != "auto":
            raise ConfigError(f"plugin {name!r}: parameter 'vllm.messagesRenderMode' {mode!r} is not supported; "
                              "allowed: auto (Anthropic Messages requests are not rendered here)")
        sub = PluginParams(f"{name}.vllm", {k: v for k, v in vllm.items() if k != "messagesRenderMode"})
        url = sub.str("url", "http://localhost:8000") or ""
        if not url.startswith(("http://", "https://")):
            raise ConfigError(f"plugin {name!r}: parameter 'vllm.url' must be an http:// or https:// URL, got {url!r}")
        self.url = url.rstrip("/")
        self.timeout_s = sub.duration("timeout", 5.0, minimum=0.001)
        self.chat_timeout_s = max(self.timeout_s, sub.duration("mmTimeout", 30.0, minimum=0.001))
        self.prefill_only = sub.bool("prefillOnly", False)
        insecure = sub.bool("insecureSkipVerify", False)
        ca, cert, key = sub.str("caCertPath", None), sub.str("clientCertPath", None), sub.str("clientKeyPath", None)
        sub.finish()
        if (cert is None) != (key is None):
            raise ConfigError(f"plugin {name!r}: 'vllm.clientCertPath' and 'vllm.clientKeyPath' go together")
        self._ssl: ssl.SSLContext | None = None
        if self.url.startswith("https://"):
            try:
                self._ssl = ssl.create_default_context(cafile=None if insecure else ca)
                if insecure:
                    self._ssl.check_hostname = False
                    self._ssl.verify_mode = ssl.CERT_NONE
                if cert is not None:
                    self._ssl.load_cert_chain(cert, key)
            except (OSError, ssl.SSLError) as exc:
                raise ConfigError(f"plugin {name!r}: vllm TLS files: {exc}") from None

    def describe(self) -> str:
        if self.backend == "vllm":
            return (f"backend=vllm url={self.url} modelName={self.model_name} timeout={self.timeout_s:g}s "
                    f"maxConcurrency={self.max_concurrency} cacheTokens={self._cache.capacity}")
        if self.backend == "estimate":
            return f"backend=estimate ({describe_estimate(self.estimate)})"
        return f"backend={self.backend}"

    def produces(self) -> frozenset[str]:
        return frozenset({PROMPT_TOKENS})

    # ---- lifecycle -------------------------------------------------------------------------------
    async def start(self) -> None:
        if self._pool is not None:
            await self._pool.preload()
        if self.backend == "vllm":
            self._session = aiohttp.ClientSession(headers={"Content-Type": "application/json"})
            await self._probe()

    async def stop(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
        if self._pool is not None:
            self._pool.close()

    async def _probe(self) -> None:
        """Render `modelName` once: a renderer that refuses the render API (403/404/405) means /tokenize."""
        body = {"model": self.model_name, "prompt": "probe", "max_tokens": 1}
        try:
            status, _ = await self._post(PROBE_RENDER_PATH, body, self.timeout_s)
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            log.warning("token-producer %s: %s does not answer (%r); rendering is tried per request", self.name,
                        self.url, exc)
            return
        if status in (403, 404, 405):
            self._use_tokenize = True
            log.info("token-producer %s: %s answers %d to the render API; using /tokenize", self.name, self.url,
                     status)

    # ---- producing -------------------------------------------------------------------------------
    async def prepare(self, state: CycleState, request: InferenceRequest, endpoints: Sequence[Endpoint]) -> None:
        tokens = await self.tokens(request)
        if tokens is not None:
            state.put(PROMPT_TOKENS, tokens)

    async def tokens(self, request: InferenceRequest) -> PromptTokens | None:
        """The request's prompt tokens from this backend, or None when it cannot give them."""
        outcomes = self._metrics.outcomes
        if self.backend == "estimate":
            outcomes.labels(self.name, self.backend, "estimated").inc()
            media = self.estimate.media_token_ids(request)
            return PromptTokens(estimate_token_ids(request) + media, exact=False)
        if self.backend == "local":
            assert self._pool is not None
            ids = await self._pool.tokenize(request)
            outcomes.labels(self.name, self.backend, "tokenized" if ids is not None else "failed").inc()
            return PromptTokens(tuple(ids), exact=True) if ids is not None else None
        return await self._render(request)

    async def _render(self, request: InferenceRequest) -> PromptTokens | None:
        outcomes = self._metrics.outcomes.labels
        path, body, chat = self._request_for(request)
        if path is None:
            outcomes(self.name, self.backend, "unsupported").inc()
            return None
        data = json.dumps(body, separators=(",", ":")).encode()
        key = xxhash.xxh64_digest(path.encode() + b"\0" + data)
        cached = self._cache.get(key)
        if cached is not None:
            outcomes(self.name, self.backend, "cached").inc()
            return PromptTokens(cached[0], exact=True, media=cached[1])
        timeout = self.chat_timeout_s if chat else self.timeout_s
        try:
            async with self._semaphore:
                status, answer = await self._post(path, data, timeout)
        except TimeoutError:
            outcomes(self.name, self.backend, "timeout").inc()
            return None
        except (aiohttp.ClientError, OSError, ValueError) as exc:
            log.debug("token-producer %s: POST %s failed: %r", self.name, path, exc)
            outcomes(self.name, self.backend, "failed").inc()
            return None
        ids = _token_ids(answer) if status == 200 else None
        if ids is None:
            outcomes(self.name, self.backend, "failed").inc()
            return None
        media = _rendered_media(answer, len(ids))
        outcomes(self.name, self.backend, "tokenized" if path == TOKENIZE_PATH else "rendered").inc()
        self._cache.put(key, (ids, media))
        return PromptTokens(ids, exact=True, media=media)

    def _request_for(self, request: InferenceRequest) -> tuple[str | None, dict[str, Any], bool]:
        """The renderer path and JSON body for this request, and whether it is a chat (None: the API has no rendering).

        What to send is the request's parser's to say (`RequestFormat`): its render API call, or
        for `/tokenize` its text prompt or chat body.
        """
        fmt = request.format
        if fmt is None:
            return None, {}, False
        if self._use_tokenize:
            text = fmt.completion_text(request)
            if text is not None:
                return TOKENIZE_PATH, {"model": request.target_model, "prompt": text[0],
                                       "add_special_tokens": text[1]}, False
            # The model's template is not known here: inline system messages are sent as they are.
            chat = fmt.chat_body(request)
            if chat is None:
                return None, {}, False
            out: dict[str, Any] = {"model": request.target_model, "messages": chat.get("messages")}
            out.update({k: chat[k] for k in _TOKENIZE_CHAT_FIELDS if k in chat})
            return TOKENIZE_PATH, out, True
        render = fmt.render_request(request, prefill_only=self.prefill_only)
        if render is None:
            return None, {}, False
        return render.path, dict(render.body), render.chat

    async def _post(self, path: str, body: dict[str, Any] | bytes, timeout: float) -> tuple[int, Any]:
        if self._session is None:
            raise aiohttp.ClientError("token-producer is not started")
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        async with asyncio.timeout(timeout):
            async with self._session.post(self.url + path, data=data, ssl=self._ssl or True) as response:
                if response.status != 200:
                    return response.status, None
                return 200, await response.json(content_type=None)


def _token_ids(answer: Any) -> tuple[int, ...] | None:
    """Token ids from a render answer (one GenerateRequest, or a list of them) or a /tokenize answer."""
    if isinstance(answer, list):
        answer = answer[0] if len(answer) == 1 else None
    if not isinstance(answer, dict):
        return None
    ids = answer.get("token_ids", answer.get("tokens"))
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        return None
    return tuple(ids)


def _rendered_media(answer: Any, token_count: int) -> tuple[MediaItem, ...]:
    """The media items of a render answer (`features`: hashes and placeholder ranges by modality), in prompt order.

    A `/tokenize` answer, or features that do not fit the token ids, give none: the ids are still exact.
    """
    if isinstance(answer, list):
        answer = answer[0] if len(answer) == 1 else None
    features = answer.get("features") if isinstance(answer, dict) else None
    if not isinstance(features, dict):
        return ()
    hashes, places = features.get("mm_hashes"), features.get("mm_placeholders")
    if not isinstance(hashes, dict) or not isinstance(places, dict):
        return ()
    out = []
    for modality, idents in hashes.items():
        spans = places.get(modality)
        if not isinstance(idents, list) or not isinstance(spans, list) or len(idents) != len(spans):
            return ()
        for ident, span in zip(idents, spans):
            offset = span.get("offset") if isinstance(span, dict) else None
            length = span.get("length") if isinstance(span, dict) else None
            if not isinstance(ident, str) or not isinstance(offset, int) or not isinstance(length, int) \
                    or offset < 0 or length < 1 or offset + length > token_count:
                return ()
            out.append(MediaItem(str(modality), ident, 0, engine_hash=ident, token_offset=offset,
                                 token_length=length))
    return tuple(sorted(out, key=lambda m: m.token_offset or 0))


def estimate_token_ids(request: InferenceRequest) -> tuple[int, ...]:
    """llm-d's `estimate` backend: every 4 bytes of prompt text packed into one id (a count, not the engine's ids)."""
    data = request.prompt_text().encode("utf-8", "surrogatepass")
    step = ESTIMATE_BYTES_PER_TOKEN
    return tuple(int.from_bytes(data[i:i + step], "little") for i in range(0, len(data), step))


def register(registry: PluginRegistry) -> None:
    """Entry point of the `epp.plugins` group: registers `token-producer`."""
    registry.register_class(TokenProducer)
