"""Reading a simulated replica's requests as vLLM does: the JSON body, the LoRA model, the cache salt,
the prompt's tokens; and vLLM's JSON error shape for what it refuses."""

from __future__ import annotations

from typing import Any

import msgspec
from aiohttp import web

from epp.engine.sim.hashing import HashContext
from epp.engine.sim.replica_config import ReplicaConfig
from epp.engine.sim.tokenizer import ChatTemplateError, SimTokenizer

_json_encode = msgspec.json.Encoder().encode
_json_decode = msgspec.json.Decoder().decode


class RequestError(Exception):
    """A request that vLLM would answer with an error status."""

    def __init__(self, message: str, status: int = 400, err_type: str = "BadRequestError",
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.err_type, self.param = status, err_type, param


def error_response(message: str, status: int = 400, err_type: str = "BadRequestError",
                   param: str | None = None) -> web.Response:
    """A vLLM-style JSON error."""
    body = {"error": {"message": message, "type": err_type, "param": param, "code": status}}
    return web.Response(status=status, body=_json_encode(body), content_type="application/json")


def validate_salt(salt: Any) -> str | None:
    """The request's `cache_salt` if vLLM accepts it (None when absent)."""
    if salt is None:
        return None
    if not isinstance(salt, str) or not salt:
        raise RequestError("Parameter 'cache_salt' must be a non-empty string if provided.", param="cache_salt")
    if len(salt) > 128 or any(c in salt for c in "@/\\\x00"):
        raise RequestError("Parameter 'cache_salt' must be at most 128 characters and must not contain "
                           "'@', '/', '\\' or NUL.", param="cache_salt")
    return salt


class RequestReader:
    """Parses and checks request bodies for one replica (its served model, LoRA adapters and tokenizer)."""

    def __init__(self, config: ReplicaConfig, tokenizer: SimTokenizer) -> None:
        self.config = config
        self.tokenizer = tokenizer

    async def body(self, request: web.Request) -> dict[str, Any]:
        """The request's JSON object."""
        raw = await request.read()
        try:
            body = _json_decode(raw)
        except msgspec.DecodeError as exc:
            raise RequestError(f"Invalid JSON body: {exc}") from None
        if not isinstance(body, dict):
            raise RequestError("The request body must be a JSON object.")
        return body

    def lora_for(self, body: dict[str, Any]) -> tuple[str | None, str | None]:
        """(adapter name, path) of the LoRA the body's `model` names; (None, None) for the base model."""
        model = body.get("model")
        if model is None or model == self.config.model:
            return None, None
        if model in self.config.lora_modules:
            return model, self.config.lora_modules[model]
        raise RequestError(f"The model `{model}` does not exist.", status=404, err_type="NotFoundError",
                           param="model")

    def common(self, body: dict[str, Any]) -> tuple[HashContext, bool, bool]:
        """The fields every generation request shares: (hash context, stream, include_usage)."""
        lora_name, lora_path = self.lora_for(body)
        salt = validate_salt(body.get("cache_salt"))
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise RequestError("'stream' must be a boolean.", param="stream")
        opts = body.get("stream_options") or {}
        if not isinstance(opts, dict):
            raise RequestError("'stream_options' must be an object.", param="stream_options")
        if opts and not stream:
            raise RequestError("Stream options can only be defined when `stream=True`.", param="stream_options")
        n = body.get("n", 1)
        if n != 1:
            raise RequestError("The simulator serves n=1 only.", param="n")
        return HashContext(cache_salt=salt, lora_name=lora_name, lora_path=lora_path), stream, bool(
            opts.get("include_usage", False))

    @staticmethod
    def int_field(body: dict[str, Any], *names: str) -> int | None:
        """The first of `names` the body sets, checked to be an integer."""
        for name in names:
            v = body.get(name)
            if v is None:
                continue
            if not isinstance(v, int) or isinstance(v, bool):
                raise RequestError(f"'{name}' must be an integer.", param=name)
            return v
        return None

    def completion_prompt(self, body: dict[str, Any]) -> list[int]:
        """Token ids of a completion's `prompt` (text or token ids)."""
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        add_special = body.get("add_special_tokens", True)
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=bool(add_special))
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return list(prompt)
        if prompt is None:
            raise RequestError("Field 'prompt' is required.", param="prompt")
        raise RequestError("'prompt' must be a string, a list of token ids, or a one-element list of those.",
                           param="prompt")

    def chat_prompt(self, body: dict[str, Any]) -> list[int]:
        """Token ids of a chat's `messages` rendered by the chat template."""
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError("Field 'messages' is required and must be a non-empty list.", param="messages")
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise RequestError("Each message must be an object with a 'role'.", param="messages")
        kwargs = body.get("chat_template_kwargs") or {}
        try:
            return self.tokenizer.encode_chat(
                messages,
                add_special_tokens=bool(body.get("add_special_tokens", False)),
                add_generation_prompt=bool(body.get("add_generation_prompt", True)),
                continue_final_message=bool(body.get("continue_final_message", False)),
                tools=body.get("tools"),
                chat_template_kwargs=kwargs if isinstance(kwargs, dict) else {},
            )
        except ChatTemplateError as exc:
            raise RequestError(f"Chat template error: {exc}", param="messages") from None
