"""Tokenizer files of a model named by its Hugging Face id (`hf://org/name`), fetched into the local cache.

llm-d's tokenizer sidecar (`udsTokenizerConfig`, `tokenizersPoolConfig`) loads a model's tokenizer
by its id from the Hugging Face hub; the picker does the same in process: only the tokenizer's
files are fetched (`HF_TOKEN` for gated models), into `HF_HOME`'s cache (or `cache_dir`), and a
model already there is not fetched again. With `HF_HUB_OFFLINE=1` only the cache is used.
"""

from __future__ import annotations

from pathlib import Path

HUB_PREFIX = "hf://"
# What a tokenizer needs (the chat template may sit in tokenizer_config.json or its own file).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def hub_source(model_id: str) -> str:
    """The `tokenizers` value that names `model_id` on the hub."""
    return HUB_PREFIX + model_id


def is_hub_source(source: str | Path) -> bool:
    """Whether a `tokenizers` value names a hub model rather than a directory."""
    return isinstance(source, str) and source.startswith(HUB_PREFIX)


def hub_model_dir(source: str, cache_dir: str | None = None) -> Path:
    """The local directory holding the tokenizer files of `hf://org/name` (blocking: fetches them when absent).

    Raises what the hub client raises (no network, an unknown or gated model): the caller retries.
    """
    from huggingface_hub import snapshot_download

    model_id = source[len(HUB_PREFIX):]
    return Path(snapshot_download(model_id, allow_patterns=list(TOKENIZER_FILES), cache_dir=cache_dir))
