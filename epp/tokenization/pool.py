"""Tokenizers by model, loaded from local model directories, with vLLM's prompt semantics.

- Completions: the prompt is tokenized with special tokens added (vLLM `add_special_tokens=True`);
  token-id prompts are used as they are; a list of prompts routes by its first one.
- Chat: messages are rendered with the model's chat template (`add_generation_prompt` true by
  default) and tokenized without adding special tokens (vLLM's chat default), since the template
  writes them itself. The request's parser gives the chat body (an Anthropic Messages body mapped
  onto chat messages as vLLM does) or the text prompt: nothing here knows an API.
- Prompts longer than `offload_chars` are rendered and tokenized in a worker thread (the
  `tokenizers` batch call releases the GIL), so the event loop never stalls on a 256 KB prompt.
  Once submitted, that work is finished even when the caller stops waiting (a request whose data
  producers ran out of time): its tokens fill the cache, so the conversation's next turn reuses
  them instead of tokenizing the whole prompt again (`tokenize_then` finishes the caller's own
  work on the tokens there too).
A model directory holds `tokenizer.json` and `tokenizer_config.json` (chat template, special
tokens) or `chat_template.jinja`. A model named `*` in the configuration serves every other model.
A directory whose files are missing or unreadable does not stop the picker: that model's prompts
are not tokenized (routing goes on without prefix scores; counted as `tokenizer_unavailable`, one
ERROR line until it loads), and loading is retried at most every `retry_s` seconds, so files that
appear later (a volume mounted late) are picked up without a restart.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from array import array
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from operator import itemgetter
from pathlib import Path
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge
from tokenizers import Tokenizer

from epp.framework.metrics import once_per_registry
from epp.framework.types import InferenceRequest
from epp.tokenization.chat_template import ChatTemplate
from epp.tokenization.hub import hub_model_dir, is_hub_source
from epp.tokenization.prefix_cache import TokenizationCache
from epp.tokenization.prefix_store import PrefixStoreMetrics

log = logging.getLogger(__name__)

R = TypeVar("R")
_FIRST, _SECOND = itemgetter(0), itemgetter(1)

class TokenizationMetrics:
    """Cache outcomes, reused tokens, tokens held, and tokenizations by where they ran."""

    def __init__(self, registry: CollectorRegistry | None, prefix: str = "epp_tokenization") -> None:
        kw = {"registry": registry}
        self.outcomes = Counter(f"{prefix}_cache_lookups", "Tokenization cache lookups, by outcome",
                                ["outcome"], **kw)
        self.reused = Counter(f"{prefix}_cache_reused_tokens", "Tokens reused from the cache", **kw)
        self.cached_tokens = Gauge(f"{prefix}_cache_tokens", "Tokens held in the tokenization caches", **kw)
        self.runs = Counter(f"{prefix}_requests", "Prompts tokenized, by where (inline or thread)",
                            ["where"], **kw)
        self.failures = Counter(f"{prefix}_failures", "Prompts that could not be tokenized, by reason",
                                ["reason"], **kw)
        # The caches' storage: bytes held, evictions (the outcomes above are the tokenization's own).
        self.store = PrefixStoreMetrics(registry, f"{prefix}_cache_store")

    def outcome(self, outcome: str, reused: int) -> None:
        self.outcomes.labels(outcome).inc()
        if reused:
            self.reused.inc(reused)


def _token_text(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


class ModelTokenizer:
    """One model's tokenizer, chat template and tokenization cache (thread-safe)."""

    def __init__(self, model_dir: Path, cache: TokenizationCache) -> None:
        self.tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        config: dict[str, Any] = {}
        config_path = model_dir / "tokenizer_config.json"
        if config_path.exists():
            config = json.loads(config_path.read_text())
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: use the default one
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
            template = named.get("default") or next(iter(named.values()), None)
        jinja_path = model_dir / "chat_template.jinja"
        if not template and jinja_path.exists():
            template = jinja_path.read_text()
        specials = {name: text for name in ("bos_token", "eos_token", "unk_token", "pad_token")
                    if (text := _token_text(config.get(name))) is not None}
        self.chat_template = ChatTemplate(template, specials) if isinstance(template, str) else None
        self.cache = cache
        # Which special tokens `add_special_tokens=True` puts around a single sequence.
        probe = self.tokenizer.encode("a", add_special_tokens=True)
        mask = probe.special_tokens_mask
        first = mask.index(0) if 0 in mask else len(mask)
        last = len(mask) - mask[::-1].index(0) if 0 in mask else len(mask)
        self.special_prefix = array("I", probe.ids[:first])
        self.special_suffix = array("I", probe.ids[last:])
        self._encode_ids = getattr(self.tokenizer, "encode_batch_fast", self.tokenizer.encode_batch)

    def _raw(self, text: str):
        # encode_batch releases the GIL, so other threads (and the event loop) keep running.
        enc = self.tokenizer.encode_batch([text], add_special_tokens=False)[0]
        offsets = enc.offsets
        return enc.ids, list(map(_FIRST, offsets)), list(map(_SECOND, offsets))  # C-speed unzip

    def _ids(self, text: str):
        # Without offsets: about half the tokenizer's work for a long text (and the GIL released too).
        return self._encode_ids([text], add_special_tokens=False)[0].ids

    def encode_text(self, text: str, add_special_tokens: bool) -> array:
        """Token ids of a text as vLLM computes them, through the tokenization cache."""
        ids = self.cache.encode(text, self._raw, self._ids)
        if add_special_tokens and (self.special_prefix or self.special_suffix):
            return self.special_prefix + ids + self.special_suffix
        return ids

    def render_chat(self, body: Mapping[str, Any]) -> str:
        """The chat prompt text for an OpenAI chat body (messages, tools, template options)."""
        if self.chat_template is None:
            raise LookupError("model has no chat template")
        kwargs = body.get("chat_template_kwargs")
        return self.chat_template.render(
            body.get("messages") or [],
            add_generation_prompt=body.get("add_generation_prompt", True) is not False,
            continue_final_message=bool(body.get("continue_final_message", False)),
            tools=body.get("tools"),
            documents=body.get("documents"),
            chat_template_kwargs=kwargs if isinstance(kwargs, Mapping) else None,
        )

    def encode_chat(self, body: Mapping[str, Any]) -> array:
        """Token ids of a chat request (vLLM: `add_special_tokens` false unless the body says so)."""
        return self.encode_text(self.render_chat(body), bool(body.get("add_special_tokens", False)))


class TokenizerPool:
    """Tokenizers keyed by model name, loaded lazily off the event loop from local directories."""

    def __init__(self, model_dirs: Mapping[str, str | Path], *, cache_tokens: int = 4_000_000,
                 cache_min_chars: int = 512, offload_chars: int = 4096, workers: int = 2,
                 registry: CollectorRegistry | None = None) -> None:
        # A directory, or a Hugging Face model id (`hf://org/name`) whose files are fetched on first load.
        self.model_dirs: dict[str, str | Path] = {
            name: path if is_hub_source(path) else Path(path) for name, path in model_dirs.items()}
        self.cache_tokens = cache_tokens
        self.cache_min_chars = cache_min_chars
        self.offload_chars = offload_chars
        # The first pool on a registry exports its series; another one (a second producer) runs unexported.
        self.metrics = once_per_registry(registry, "epp_tokenization", TokenizationMetrics, shared=False)
        self._tokenizers: dict[str, ModelTokenizer] = {}
        self._failed_at: dict[str, float] = {}  # model key -> monotonic time of its last failed load
        self.retry_s = 5.0
        self._load_lock = threading.Lock()
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="epp-tokenize")
        self.metrics.cached_tokens.set_function(
            lambda: sum(t.cache.tokens for t in list(self._tokenizers.values())))
        self.metrics.store.bind(lambda: sum(t.cache.bytes for t in list(self._tokenizers.values())),
                                lambda: sum(len(t.cache) for t in list(self._tokenizers.values())))

    def _dir_for(self, model: str) -> tuple[str, str | Path] | None:
        if model in self.model_dirs:
            return model, self.model_dirs[model]
        if "*" in self.model_dirs:
            return "*", self.model_dirs["*"]
        return None

    def load(self, model: str) -> ModelTokenizer | None:
        """The tokenizer for `model` (blocking on first use; call from a thread or at start-up)."""
        found = self._dir_for(model)
        if found is None:
            return None
        key, path = found
        with self._load_lock:
            tok = self._tokenizers.get(key)
            if tok is not None:
                return tok
            failed = self._failed_at.get(key)
            if failed is not None and time.monotonic() - failed < self.retry_s:
                return None
            cache = TokenizationCache(self.cache_tokens, min_chars=self.cache_min_chars,
                                      on_outcome=self.metrics.outcome, store_metrics=self.metrics.store)
            try:
                tok = ModelTokenizer(hub_model_dir(str(path)) if is_hub_source(path) else Path(path), cache)
            except Exception as exc:  # noqa: BLE001 - missing/corrupt files: serve on without this tokenizer
                if failed is None:
                    log.error("tokenizer for model %r not loadable from %s (%s); its prompts route without "
                              "prefix scores until it loads (retried every %.0f s)", key, path, exc, self.retry_s)
                self._failed_at[key] = time.monotonic()
                return None
            if failed is not None:
                log.info("tokenizer for model %r loaded from %s", key, path)
                self._failed_at.pop(key, None)
            self._tokenizers[key] = tok
            return tok

    async def preload(self) -> None:
        """Load every configured tokenizer in a thread (so the first request does not pay for it)."""
        loop = asyncio.get_running_loop()
        for model in self.model_dirs:
            await loop.run_in_executor(self._executor, self.load, model)

    def _tokenize_sync(self, request: InferenceRequest) -> Sequence[int] | None:
        tok = self.load(request.target_model)
        if tok is None:
            unavailable = self._dir_for(request.target_model) is not None
            self.metrics.failures.labels("tokenizer_unavailable" if unavailable else "no_tokenizer").inc()
            return None
        fmt = request.format
        if fmt is None:
            return None
        text = fmt.completion_text(request)
        if text is not None:
            return tok.encode_text(*text)
        template = tok.chat_template
        # Asked only with the template's answer: whether inline system messages are merged depends on it.
        chat = fmt.chat_body(request, merge_inline_system=template is not None and not template.accepts_inline_system)
        if chat is None:
            return None
        if template is None:
            self.metrics.failures.labels("no_chat_template").inc()
            return None
        return tok.encode_chat(chat)

    async def tokenize(self, request: InferenceRequest) -> Sequence[int] | None:
        """The prompt token ids vLLM will see for `request` (an `array("I")` when tokenized here), or None."""
        direct = token_ids_of(request)
        if direct is not None:
            return direct
        done = await self.tokenize_then(request, _nothing)
        return None if done is None else done[0]

    async def tokenize_then(self, request: InferenceRequest,
                            then: Callable[[Sequence[int]], R]) -> tuple[Sequence[int], R] | None:
        """The prompt's token ids (as `tokenize`) and `then(ids)`, computed where the tokenization runs.

        A long prompt's tokenization and `then` run together in a worker thread and are finished
        even when the caller stops waiting (cancelled by a deadline): whatever they cache (these
        tokens, the keys `then` computes from them) is there for the conversation's next turn.
        """
        direct = token_ids_of(request)
        if direct is not None:
            return direct, then(direct)
        if request.format is None:
            return None
        # The parser's count (role names included) when it made one: a walk of the messages saved.
        size = request.prompt_chars if request.prompt_chars is not None else len(request.prompt_text())
        loaded = self._dir_for(request.target_model)
        cold = loaded is not None and loaded[0] not in self._tokenizers
        try:
            if size > self.offload_chars or cold:
                self.metrics.runs.labels("thread").inc()
                job = asyncio.get_running_loop().run_in_executor(self._executor, self._tokenize_then, request, then)
                return await finished_anyway(job)
            self.metrics.runs.labels("inline").inc()
            return self._tokenize_then(request, then)
        except Exception:  # noqa: BLE001 - a broken template or prompt must not fail routing
            self.metrics.failures.labels("error").inc()
            return None

    def _tokenize_then(self, request: InferenceRequest,
                       then: Callable[[Sequence[int]], R]) -> tuple[Sequence[int], R] | None:
        ids = self._tokenize_sync(request)
        return None if ids is None else (ids, then(ids))

    def close(self) -> None:
        """Stop the worker threads."""
        self._executor.shutdown(wait=False, cancel_futures=True)


def _nothing(_: Sequence[int]) -> None:
    return None


def _retrieved(job: asyncio.Future[Any]) -> None:
    """Mark a worker's outcome as seen: its caller may have stopped waiting, and its failure was counted or logged."""
    if not job.cancelled() and job.exception() is not None:
        log.debug("tokenization finished for a request no longer waiting failed", exc_info=job.exception())


async def finished_anyway(job: asyncio.Future[R]) -> R:
    """Await a worker thread's `job`; a caller cancelled meanwhile stops waiting, but the job is not cancelled.

    A job still queued in the pool would otherwise be dropped (`run_in_executor` cancels it with
    its awaiter), and the work it would have cached lost for the next request that needs it.
    """
    job.add_done_callback(_retrieved)
    return await asyncio.shield(job)


def token_ids_of(request: InferenceRequest) -> list[int] | None:
    """The prompt's token ids when the client sent them (a completions prompt of ids, a token-in API)."""
    ids = request.token_ids()
    return list(ids) if ids is not None else None
