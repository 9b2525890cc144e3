"""The HTTP API of a simulated replica, over real loopback HTTP."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from epp.engine.sim import FleetConfig, SimFleet

PROMPT = "System: you answer questions about the customer table. " * 6


@pytest.fixture
async def fleet(tokenizer_dir):
    async with SimFleet(FleetConfig(replicas=2, tokenizer_dir=tokenizer_dir, kv_events=False,
                                    lora_modules={"sql-lora": "/adapters/sql"},
                                    enable_prompt_tokens_details=True)) as f:
        yield f


@pytest.fixture
async def http():
    async with aiohttp.ClientSession() as s:
        yield s


def url(fleet, path, i=0):
    return f"http://{fleet.endpoints[i]}{path}"


def sse_events(text: str) -> list:
    out = []
    for block in text.strip().split("\n\n"):
        assert block.startswith("data: "), block
        data = block[len("data: "):]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


async def test_completion_json_usage_and_cached_tokens_grow_on_a_repeated_prefix(fleet, http):
    cached = []
    for _ in range(2):
        async with http.post(url(fleet, "/v1/completions"), json={"prompt": PROMPT, "max_tokens": 5}) as r:
            assert r.status == 200
            assert r.headers["x-sim-replica"] == "sim-0"
            body = await r.json()
        assert body["object"] == "text_completion"
        choice = body["choices"][0]
        assert choice["finish_reason"] == "length" and choice["text"].strip()
        usage = body["usage"]
        assert usage["completion_tokens"] == 5
        assert usage["total_tokens"] == usage["prompt_tokens"] + 5
        cached.append(usage["prompt_tokens_details"]["cached_tokens"])
    assert cached[0] == 0
    assert cached[1] > 0 and cached[1] % 16 == 0
    # Another replica has its own cache.
    async with http.post(url(fleet, "/v1/completions", 1), json={"prompt": PROMPT, "max_tokens": 5}) as r:
        assert r.headers["x-sim-replica"] == "sim-1"
        assert (await r.json())["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


async def test_chat_json_and_tokenize_agree_on_the_prompt(fleet, http):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Which invoices?"}]
    async with http.post(url(fleet, "/tokenize"), json={"messages": messages}) as r:
        tok = await r.json()
    async with http.post(url(fleet, "/v1/chat/completions"), json={"messages": messages, "max_tokens": 7}) as r:
        body = await r.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert body["usage"]["prompt_tokens"] == tok["count"] == len(tok["tokens"])
    assert body["usage"]["completion_tokens"] == 7
    async with http.post(url(fleet, "/tokenize"), json={"prompt": "hello world"}) as r:
        plain = await r.json()
    assert plain["tokens"][0] == 0  # BOS added for completions-style prompts


async def test_chat_without_max_tokens_stops_naturally(fleet, http):
    async with http.post(url(fleet, "/v1/chat/completions"),
                         json={"messages": [{"role": "user", "content": "hi"}]}) as r:
        body = await r.json()
    assert body["choices"][0]["finish_reason"] == "stop"
    assert 16 <= body["usage"]["completion_tokens"] <= 128


async def test_chat_sse_stream_with_usage(fleet, http):
    req = {"messages": [{"role": "user", "content": "stream please"}], "max_tokens": 6, "stream": True,
           "stream_options": {"include_usage": True}}
    async with http.post(url(fleet, "/v1/chat/completions"), json=req) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/event-stream")
        assert r.headers["x-sim-replica"] == "sim-0"
        events = sse_events(await r.text())
    assert events[-1] == "[DONE]"
    chunks, usage = events[:-2], events[-2]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[1:])
    assert text.strip()
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 6


async def test_completion_sse_without_usage(fleet, http):
    async with http.post(url(fleet, "/v1/completions"), json={"prompt": "abc", "max_tokens": 3, "stream": True}) as r:
        events = sse_events(await r.text())
    assert events[-1] == "[DONE]"
    assert len(events) == 4 and all("usage" not in e for e in events[:-1])
    assert events[-2]["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("path,body,status,fragment", [
    ("/v1/completions", b"{not json", 400, "Invalid JSON"),
    ("/v1/completions", {"max_tokens": 3}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 100000}, 400, "maximum context length"),
    ("/v1/completions", {"prompt": "x", "cache_salt": "a/b"}, 400, "cache_salt"),
    ("/v1/completions", {"prompt": "x", "model": "nope"}, 404, "does not exist"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"content": "no role"}]}, 400, "role"),
])
async def test_malformed_requests_get_vllm_style_errors(fleet, http, path, body, status, fragment):
    kw = {"data": body} if isinstance(body, bytes) else {"json": body}
    async with http.post(url(fleet, path), **kw) as r:
        assert r.status == status
        assert r.headers["x-sim-replica"] == "sim-0"
        err = (await r.json())["error"]
    assert fragment in err["message"] and err["code"] == status and "type" in err


async def test_models_health_and_lora(fleet, http):
    async with http.get(url(fleet, "/v1/models")) as r:
        cards = (await r.json())["data"]
    assert [c["id"] for c in cards] == ["sim-model", "sql-lora"]
    assert cards[1]["parent"] == "sim-model" and cards[1]["root"] == "/adapters/sql"
    async with http.get(url(fleet, "/health")) as r:
        assert r.status == 200 and await r.read() == b""
    async with http.post(url(fleet, "/v1/completions"), json={"prompt": PROMPT, "model": "sql-lora",
                                                              "max_tokens": 2}) as r:
        assert (await r.json())["model"] == "sql-lora"


def metric_families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


async def test_metrics_have_vllm_names_and_labels(fleet, http):
    async with http.post(url(fleet, "/v1/completions"), json={"prompt": PROMPT, "max_tokens": 2}) as r:
        await r.read()
    async with http.post(url(fleet, "/v1/completions"), json={"prompt": PROMPT, "max_tokens": 2}) as r:
        await r.read()
    async with http.get(url(fleet, "/metrics")) as r:
        text = await r.text()
    fams = metric_families(text)
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:cache_config_info",
                 "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                 "vllm:engine_sleep_state", "vllm:lora_requests_info", "vllm:e2e_request_latency_seconds"):
        assert name in fams, name
    assert "vllm:prefix_cache_queries_total{" in text and "vllm:prefix_cache_hits_total{" in text
    running = fams["vllm:num_requests_running"].samples[0]
    assert running.labels == {"model_name": "sim-model", "engine": "0"}
    info = fams["vllm:cache_config_info"].samples[0].labels
    assert info["block_size"] == "16" and info["num_gpu_blocks"] == "4096" and info["engine"] == "0"
    lora = fams["vllm:lora_requests_info"].samples[0].labels
    assert set(lora) == {"max_lora", "running_lora_adapters", "waiting_lora_adapters"}
    hits = fams["vllm:prefix_cache_hits"].samples[0].value
    queries = fams["vllm:prefix_cache_queries"].samples[0].value
    assert 0 < hits < queries
    ttft_count = [s for s in fams["vllm:time_to_first_token_seconds"].samples if s.name.endswith("_count")]
    assert ttft_count[0].value == 2
    awake = {s.labels["sleep_state"]: s.value for s in fams["vllm:engine_sleep_state"].samples}
    assert awake == {"awake": 1.0, "weights_offloaded": 0.0, "discard_all": 0.0}


async def test_sleep_and_wake_up(fleet, http):
    async with http.post(url(fleet, "/sleep?level=1")) as r:
        assert await r.json() == {"status": "sleeping", "level": 1}
    async with http.get(url(fleet, "/is_sleeping")) as r:
        assert await r.json() == {"is_sleeping": True}
    async with http.get(url(fleet, "/health")) as r:
        assert r.status == 200  # a sleeping engine is still healthy
    async with http.get(url(fleet, "/metrics")) as r:
        fams = metric_families(await r.text())
    state = {s.labels["sleep_state"]: s.value for s in fams["vllm:engine_sleep_state"].samples}
    assert state["awake"] == 0 and state["weights_offloaded"] == 1
    pending = asyncio.ensure_future(http.post(url(fleet, "/v1/completions"), json={"prompt": "x", "max_tokens": 2}))
    await asyncio.sleep(0.05)
    assert not pending.done()
    async with http.post(url(fleet, "/wake_up")) as r:
        assert (await r.json())["status"] == "awake"
    resp = await asyncio.wait_for(pending, 5)
    assert resp.status == 200
    resp.release()


async def test_client_disconnect_mid_stream_frees_the_sequence(fleet, http):
    engine = fleet.replicas[0].engine
    req = {"prompt": PROMPT, "max_tokens": 2000, "stream": True}
    async with http.post(url(fleet, "/v1/completions"), json=req) as r:
        await r.content.readline()
        assert len(engine.running) == 1
        assert engine.cache.used_blocks > 0
        r.close()
    for _ in range(100):
        if not engine.running and engine.cache.used_blocks == 0:
            break
        await asyncio.sleep(0.02)
    assert not engine.running
    assert engine.cache.used_blocks == 0
    assert engine.metrics.request_success.get("abort") == 1


async def test_sim_speed_route_slows_a_replica_down(fleet, http):
    async with http.post(url(fleet, "/sim/speed?slowdown=3")) as resp:
        assert resp.status == 200
        assert (await resp.json())["slowdown"] == 3
    async with http.get(url(fleet, "/sim/state")) as resp:
        state = await resp.json()
    async with http.get(url(fleet, "/sim/state", 1)) as resp:
        other = await resp.json()
    assert state["slowdown"] == 3 and other["slowdown"] == 1
    assert state["prefill_per_token"] == pytest.approx(3 * other["prefill_per_token"])
    async with http.post(url(fleet, "/sim/speed?slowdown=zero")) as resp:
        assert resp.status == 400
