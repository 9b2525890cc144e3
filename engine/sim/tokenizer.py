"""The model's own tokenizer and chat template, applied the way vLLM does.

Completions tokenize the prompt with ``add_special_tokens=True`` (so the tokenizer adds BOS);
chat renders the messages with the Jinja chat template like HF ``apply_chat_template``
(``add_generation_prompt`` default True, special-token strings in the context) and then
tokenizes the text with ``add_special_tokens=False`` (the template writes BOS itself).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer


class ChatTemplateError(ValueError):
    """The chat template rejected the messages (raise_exception) or failed to render."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # tokenizer_config may store AddedToken dicts
        return value.get("content")
    return value


class SimTokenizer:
    """Encode/decode with a local ``tokenizer.json`` and render chats with its chat template."""

    def __init__(self, model_dir: str | Path) -> None:
        model_dir = Path(model_dir)
        self.tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        config_path = model_dir / "tokenizer_config.json"
        config: dict[str, Any] = json.loads(config_path.read_text()) if config_path.exists() else {}
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.eos_token_id = self.tokenizer.token_to_id(self.eos_token) if self.eos_token else None
        self.model_max_length = int(config.get("model_max_length", 4096))
        # Like transformers (and so vLLM): a chat_template.jinja file next to the tokenizer is the
        # model's template; tokenizer_config.json's "chat_template" is the older place for it.
        template_file = model_dir / "chat_template.jinja"
        template = template_file.read_text(encoding="utf-8") if template_file.is_file() else config.get("chat_template")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.globals["raise_exception"] = _raise_exception
        env.filters["tojson"] = lambda x, indent=None: json.dumps(x, indent=indent, ensure_ascii=False)
        self._template = env.from_string(template) if template else None
        self._special_ids = {i for i, tok in self.tokenizer.get_added_tokens_decoder().items() if tok.special}
        self.output_token_pool = self._plain_word_tokens()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text` (BOS added when `add_special_tokens`, as for vLLM completions)."""
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int]) -> str:
        """Text of `ids`, special tokens skipped (vLLM's default detokenization)."""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[Any] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """The prompt text of a chat, rendered like HF ``apply_chat_template(tokenize=False)``."""
        if self._template is None:
            raise ChatTemplateError("this model has no chat template")
        context: dict[str, Any] = dict(chat_template_kwargs or {})
        context.update(
            messages=messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt and not continue_final_message,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )
        try:
            text = self._template.render(**context)
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(str(exc)) from exc
        if continue_final_message and messages:
            final = messages[-1].get("content")
            if isinstance(final, str) and final.strip() and final.strip() in text:
                text = text[: text.rindex(final.strip()) + len(final.strip())]
        return text

    def encode_chat(self, messages: list[dict[str, Any]], *, add_special_tokens: bool = False, **kw: Any) -> list[int]:
        """Token ids of a rendered chat (vLLM chat default: no extra special tokens)."""
        return self.encode(self.render_chat(messages, **kw), add_special_tokens=add_special_tokens)

    def _plain_word_tokens(self) -> list[int]:
        """Ids that decode to a space-prefixed alphabetic word: readable pseudo output."""
        pool = []
        for _token, idx in sorted(self.tokenizer.get_vocab().items(), key=lambda kv: kv[1]):
            if idx in self._special_ids:
                continue
            text = self.tokenizer.decode([idx])
            if len(text) >= 3 and text[0] == " " and text[1:].isalpha():
                pool.append(idx)
        if not pool:
            pool = [i for i in range(self.tokenizer.get_vocab_size()) if i not in self._special_ids]
        return pool
