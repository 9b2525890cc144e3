"""OpenAI's embeddings API on a simulated replica: `POST /v1/embeddings`.

`input` is a string, a list of strings, a list of token ids or a list of those lists (or, as vLLM
also takes, chat `messages`); each input is one prefill on the engine (so it queues, fills and
finds blocks in the prefix cache like any prompt) and gets one vector. The vector is a unit-length
feature hash of the input's tokens, as long as the model's hidden size (its `config.json`; 128
without one): equal inputs get equal vectors, inputs sharing many tokens close ones. Nothing
is learned; it is the shape and the load that are simulated. `encoding_format` `float` or
`base64` (little-endian float32, as OpenAI sends it); `dimensions` is refused as vLLM refuses it
for a model without Matryoshka embeddings.
"""

from __future__ import annotations

import asyncio
import base64
import json
import math
import struct
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
from aiohttp import web

from epp.engine.sim.engine import EngineError
from epp.engine.sim.hashing import HashContext
from epp.engine.sim.request_parsing import RequestError, error_response, validate_salt

if TYPE_CHECKING:
    from epp.engine.sim.replica_api import Replica

_json_encode = msgspec.json.Encoder().encode
DEFAULT_EMBEDDING_SIZE = 128
# More inputs than this in one request are refused (each is an engine request).
MAX_INPUTS = 2048


def embedding_size(model_dir: str | None) -> int:
    """The model's hidden size from its `config.json`, else `DEFAULT_EMBEDDING_SIZE`."""
    if model_dir is None:
        return DEFAULT_EMBEDDING_SIZE
    try:
        size = json.loads((Path(model_dir) / "config.json").read_text()).get("hidden_size")
    except (OSError, ValueError):
        return DEFAULT_EMBEDDING_SIZE
    return size if isinstance(size, int) and size > 0 else DEFAULT_EMBEDDING_SIZE


def embed(token_ids: list[int], size: int) -> list[float]:
    """A unit vector from the tokens (signed feature hashing): deterministic, similar for similar inputs."""
    vector = [0.0] * size
    for t in token_ids:
        mixed = (t * 0x9E3779B1) & 0xFFFF_FFFF
        vector[mixed % size] += 1.0 if (mixed >> 16) & 1 else -1.0
    norm = math.sqrt(sum(v * v for v in vector)) or 1.0
    return [v / norm for v in vector]


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value)


class EmbeddingRoutes:
    """`POST /v1/embeddings` of one replica."""

    def __init__(self, replica: Replica) -> None:
        self.replica = replica
        self.size = embedding_size(replica.config.tokenizer_dir)

    def attach(self, app: web.Application) -> None:
        """Add the route to the replica's application."""
        app.router.add_post("/v1/embeddings", self.embeddings)

    def _inputs(self, body: dict[str, Any]) -> list[list[int]]:
        """Token ids of each input."""
        reader, tokenizer = self.replica.requests, self.replica.tokenizer
        if "messages" in body and "input" not in body:
            return [reader.chat_prompt(body)]
        value = body.get("input")
        add_special = bool(body.get("add_special_tokens", True))
        if isinstance(value, str):
            values: list[Any] = [value]
        elif _is_ids(value):
            values = [value]
        elif isinstance(value, list) and value and all(isinstance(v, str) or _is_ids(v) for v in value):
            values = value
        else:
            raise RequestError("'input' must be a string, a list of strings, a list of token ids or a list of "
                               "those lists.", param="input")
        if len(values) > MAX_INPUTS:
            raise RequestError(f"'input' has {len(values)} items; at most {MAX_INPUTS} are served.", param="input")
        out = []
        for v in values:
            ids = tokenizer.encode(v, add_special_tokens=add_special) if isinstance(v, str) else list(v)
            if not ids:
                raise RequestError("'input' must not be empty.", param="input")
            out.append(ids)
        return out

    async def embeddings(self, request: web.Request) -> web.Response:
        """POST /v1/embeddings."""
        replica = self.replica
        try:
            body = await replica.requests.body(request)
            lora_name, lora_path = replica.requests.lora_for(body)
            ctx = HashContext(cache_salt=validate_salt(body.get("cache_salt")), lora_name=lora_name,
                              lora_path=lora_path)
            encoding = body.get("encoding_format", "float")
            if encoding not in ("float", "base64"):
                raise RequestError("'encoding_format' must be 'float' or 'base64'.", param="encoding_format")
            if body.get("dimensions") is not None:
                raise RequestError("Model does not support matryoshka representation, changing output "
                                   "dimensions will lead to poor results.", param="dimensions")
            inputs = self._inputs(body)
            # One prefill each: a pooling request computes its prompt and produces no text.
            requests = [replica.engine.new_request(ids, 1, ctx=ctx, request_id=f"embd-{uuid.uuid4().hex}")
                        for ids in inputs]
        except RequestError as exc:
            return error_response(str(exc), exc.status, exc.err_type, exc.param)
        except EngineError as exc:
            return error_response(str(exc))
        await asyncio.gather(*(self._prefill(r) for r in requests))
        if any(r.finish_reason == "abort" for r in requests):
            return error_response("The request was aborted by the engine.", 503, "ServiceUnavailableError")
        data = []
        for i, ids in enumerate(inputs):
            vector = embed(ids, self.size)
            encoded: Any = vector if encoding == "float" else base64.b64encode(
                struct.pack(f"<{len(vector)}f", *vector)).decode()
            data.append({"index": i, "object": "embedding", "embedding": encoded})
        prompt = sum(len(ids) for ids in inputs)
        answer = {"id": f"embd-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                  "model": body.get("model") or replica.config.model, "data": data,
                  "usage": {"prompt_tokens": prompt, "total_tokens": prompt, "completion_tokens": 0,
                            "prompt_tokens_details": None}}
        return web.Response(body=_json_encode(answer), content_type="application/json")

    async def _prefill(self, r: Any) -> None:
        async for _ in self.replica.generate(r):
            pass
