"""Mooncake trace replay: parsing, conversations, prompt construction, timed arrivals, a smoke run.

Every trace here is written by `write_trace` from rows built in the test (the real traces are
read from a path the user gives and never needed by the tests).
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from bench.routing.__main__ import main as bench_main
from bench.routing.loadgen import Stage, run_stage
from bench.routing.oracle import prompt_token_ids
from bench.routing.runner import run_scenario
from bench.routing.scenarios import get_scenario
from bench.routing.traces import TraceFormatError, TraceReplay, conversations, load_trace
from tests.support.backends import completions_backend


def write_trace(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def chat_rows(conversations: int = 4, turns: int = 3, gap_ms: int = 400) -> list[dict]:
    """Conversations that resend their history: turn t holds every block of turn t-1 plus two new ones."""
    rows = []
    next_id = 1
    for c in range(conversations):
        ids = [0]  # a system prompt every request starts with
        for t in range(turns):
            ids = ids + [next_id, next_id + 1]
            next_id += 2
            rows.append({"timestamp": c * 150 + t * gap_ms, "input_length": 512 * len(ids) - 100,
                         "output_length": 40, "hash_ids": list(ids)})
    rows.sort(key=lambda r: r["timestamp"])
    return rows


def test_a_bad_trace_line_is_named_with_file_and_line(tmp_path):
    good = {"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}
    cases = [("{not json", "not JSON"), (json.dumps({"timestamp": 0, "hash_ids": [1]}), "missing input_length"),
             (json.dumps({**good, "hash_ids": []}), "non-empty list"),
             (json.dumps({**good, "timestamp": -1}), "timestamp"),
             (json.dumps({**good, "output_length": "7"}), "output_length")]
    for line, message in cases:
        path = tmp_path / "bad.jsonl"
        path.write_text(json.dumps(good) + "\n" + line + "\n")
        with pytest.raises(TraceFormatError, match=f"bad.jsonl:2: .*{message}"):
            load_trace(path)
    with pytest.raises(TraceFormatError, match="cannot read trace"):
        load_trace(tmp_path / "missing.jsonl")


def test_conversations_follow_shared_prefixes_beyond_the_common_system_prompt(tmp_path):
    rows = chat_rows(conversations=8, turns=3)
    records = load_trace(write_trace(tmp_path / "t.jsonl", rows))
    conv = conversations(records, common_share=0.5)
    by_first_new_block = {}
    for r, c in zip(records, conv):
        by_first_new_block.setdefault(r.hash_ids[1], set()).add(c)
    # Each conversation's turns share their second block; block 0 (in every request) links nothing.
    assert len(set(conv)) == 8
    assert all(len(cs) == 1 for cs in by_first_new_block.values())


def test_prompts_repeat_the_tokens_of_equal_hash_ids_and_follow_the_timestamps(tmp_path):
    rows = chat_rows(conversations=2, turns=3, gap_ms=1000)
    path = write_trace(tmp_path / "t.jsonl", rows)
    replay = TraceReplay(path, block_tokens=16, max_prompt_tokens=10_000, max_output_tokens=8, speedup=4.0,
                         common_share=0.9)
    reqs = list(replay.requests())
    assert len(reqs) == 6
    ids = [prompt_token_ids(r) for r in reqs]
    for req, tokens, rec in zip(reqs, ids, replay.selected()):
        # BOS + the scaled length: full blocks of 16 and the partial last block scaled the same way.
        assert len(tokens) == 1 + replay.prompt_tokens(rec)
        assert replay.prompt_tokens(rec) == 16 * (len(rec.hash_ids) - 1) + 13  # (512 - 100) * 16 / 512 -> 13
        assert req.max_tokens == 2  # 40 * 16 / 512, rounded up
        assert req.at == pytest.approx(rec.timestamp_ms / 1000 / 4.0)
    # Turn 2 of a conversation starts with every full block of turn 1; two conversations share block 0 only.
    first, second = [r for r in reqs if r.group == reqs[0].group][:2]
    a, b = prompt_token_ids(first), prompt_token_ids(second)
    assert b[:1 + 16 * 2] == a[:1 + 16 * 2]
    other = next(prompt_token_ids(r) for r in reqs if r.group != reqs[0].group)
    assert other[:17] == a[:17] and other[17:33] != a[17:33]


def test_caps_sampling_and_start_offset(tmp_path):
    rows = chat_rows(conversations=10, turns=3, gap_ms=100)
    path = write_trace(tmp_path / "t.jsonl", rows)
    capped = TraceReplay(path, block_tokens=16, max_prompt_tokens=40, max_output_tokens=1)
    assert all(len(prompt_token_ids(r)) == 41 and r.max_tokens == 1 for r in capped.requests())
    # Sampling keeps whole conversations: every kept conversation keeps its three turns.
    half = TraceReplay(path, block_tokens=16, fraction=0.5, seed=3, common_share=0.5)
    groups = [r.group for r in half.requests()]
    assert 0 < len(set(groups)) < 10
    assert all(groups.count(g) == 3 for g in set(groups))
    # A start offset drops the conversations that began earlier; times count from the first kept one.
    late = TraceReplay(path, block_tokens=16, start_s=0.9, common_share=0.5)
    kept = list(late.requests())
    assert len(kept) == 12 and min(r.timestamp_ms for r in late.selected()) == 900
    assert kept[0].at == 0.0
    with pytest.raises(ValueError, match="no conversation"):
        TraceReplay(path, start_s=100.0, common_share=0.5).selected()


def bailian_rows(conversations: int = 3, turns: int = 3, gap_s: float = 0.5) -> list[dict]:
    """Bailian lines: each turn names its previous turn and resends its blocks plus two new 16-token ones."""
    rows = []
    next_block, next_chat = 1, 0
    for c in range(conversations):
        ids, parent = [0], -1
        for t in range(1, turns + 1):
            ids = ids + [next_block, next_block + 1]
            next_block += 2
            rows.append({"chat_id": next_chat, "parent_chat_id": parent, "timestamp": round(c * 0.1 + t * gap_s, 3),
                         "input_length": 16 * len(ids) - 5, "output_length": 7, "type": "text", "turn": t,
                         "hash_ids": list(ids)})
            parent, next_chat = next_chat, next_chat + 1
    rows.sort(key=lambda r: r["timestamp"])
    return rows


def test_bailian_trace_conversations_are_its_parent_chains_and_timestamps_are_seconds(tmp_path):
    rows = bailian_rows(conversations=3, turns=3)
    # A turn whose parent is outside the file starts a conversation of its own.
    rows.append({"chat_id": 99, "parent_chat_id": 42, "timestamp": 5.0, "input_length": 20, "output_length": 3,
                 "type": "search", "turn": 4, "hash_ids": [50, 51]})
    records = load_trace(write_trace(tmp_path / "qwen.jsonl", rows))
    assert [r.format for r in records] == ["bailian"] * 10
    assert records[0].timestamp_ms == pytest.approx(500.0) and records[0].block_tokens == 16
    assert records[-1].kind == "search" and records[-1].turn == 4
    conv = conversations(records)
    chains: dict[int, set[int]] = {}
    by_chat = {r.chat_id: c for r, c in zip(records, conv)}
    for r in records:
        if r.parent_chat_id in by_chat:
            assert by_chat[r.chat_id] == by_chat[r.parent_chat_id]
        chains.setdefault(by_chat[r.chat_id], set()).add(r.chat_id)
    assert sorted(len(c) for c in chains.values()) == [1, 3, 3, 3]
    # The common first block (0, in every request) links nothing: conversations follow the parents only.
    assert len(set(conv)) == 4


def test_bailian_prompts_keep_their_16_token_blocks_and_share_each_chain_s_history(tmp_path):
    replay = TraceReplay(write_trace(tmp_path / "qwen.jsonl", bailian_rows(conversations=2, turns=3)),
                         block_tokens=16, max_prompt_tokens=10_000, max_output_tokens=64)
    reqs = list(replay.requests())
    assert "bailian trace qwen.jsonl" in replay.describe() and "(16 in the trace)" in replay.describe()
    for req, rec in zip(reqs, replay.selected()):
        assert len(prompt_token_ids(req)) == 1 + rec.input_length  # BOS + exactly the trace's tokens
        assert req.max_tokens == 7
        assert req.at == pytest.approx((rec.timestamp_ms - replay.selected()[0].timestamp_ms) / 1000)
    turns = [prompt_token_ids(r) for r in reqs if r.group == reqs[0].group]
    # Each turn starts with the whole previous turn (its partial last block is the start of the same block).
    assert len(turns) == 3 and all(b[:len(a)] == a for a, b in zip(turns, turns[1:]))
    # Scaled replay: 4 tokens per 16-token block shrinks prompts and outputs by the same factor.
    small = TraceReplay(replay.path, block_tokens=4, max_prompt_tokens=10_000)
    assert [small.prompt_tokens(r) for r in small.selected()] == [4 * (len(r.hash_ids) - 1) + 3
                                                                   for r in small.selected()]
    assert all(r.max_tokens == 2 for r in small.requests())


def test_a_bad_bailian_line_is_named_and_formats_do_not_mix(tmp_path):
    good = bailian_rows(conversations=1, turns=1)[0]
    cases = [({k: v for k, v in good.items() if k != "turn"}, "missing turn .*Bailian format"),
             ({**good, "parent_chat_id": -2}, "'parent_chat_id' must be a chat_id or -1"),
             ({**good, "type": 3}, "'type' must be a string"),
             ({**good, "timestamp": "soon"}, "'timestamp' must be a non-negative number of seconds"),
             ({**good, "chat_id": -1}, "'chat_id' must be a non-negative integer")]
    for row, message in cases:
        path = tmp_path / "bad.jsonl"
        path.write_text(json.dumps({**good, "chat_id": 7}) + "\n" + json.dumps(row) + "\n")
        with pytest.raises(TraceFormatError, match=f"bad.jsonl:2: {message}"):
            load_trace(path)
    with pytest.raises(TraceFormatError, match="repeats chat_id 0"):
        load_trace(write_trace(tmp_path / "dup.jsonl", [good, {**good, "timestamp": 9.0}]))
    mooncake = {"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}
    with pytest.raises(TraceFormatError, match="mixes the Mooncake and Bailian formats"):
        load_trace(write_trace(tmp_path / "mixed.jsonl", [good, mooncake]))


async def test_trace_arrivals_send_each_request_at_its_own_offset(tmp_path):
    sent_at: list[float] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        sent_at.append(asyncio.get_running_loop().time())
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices":[{"index":0,"text":"a"}]}\n\ndata: [DONE]\n\n')
        return resp

    rows = [{"timestamp": ms, "input_length": 100, "output_length": 5, "hash_ids": [i]}
            for i, ms in enumerate((0, 0, 300, 900))]
    replay = TraceReplay(write_trace(tmp_path / "t.jsonl", rows), block_tokens=16, speedup=1.5)
    async with completions_backend(handler) as url, aiohttp.ClientSession() as session:
        res = await run_stage(session, url, replay.requests(), Stage(replay.duration_s() + 1e-3, 4 / 0.6, "trace"), 0,
                              drain=5.0, progress=False)
    assert [r.ok for r in res.records] == [True] * 4
    offsets = [r.sent - res.started for r in res.records]
    for got, want in zip(offsets, (0.0, 0.0, 0.2, 0.6)):
        assert want - 0.005 <= got <= want + 0.15


def test_cli_rejects_a_missing_trace_and_rates_for_a_trace(tmp_path, capsys):
    with pytest.raises(SystemExit):
        bench_main(["run", "trace", "--scale", "tiny", "--out", str(tmp_path)])
    assert "needs --trace PATH" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text("[]\n")
    with pytest.raises(SystemExit):
        bench_main(["run", "trace", "--trace", str(bad), "--out", str(tmp_path)])
    assert "bad.jsonl:1: a trace line must be a JSON object" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_main(["run", "trace", "--trace", str(bad), "--rates", "2", "--out", str(tmp_path)])
    assert "replays the trace's own timestamps" in capsys.readouterr().err


@pytest.mark.envoy
@pytest.mark.slow
def test_trace_smoke_run_replays_every_request_through_the_routers(tmp_path):
    logging.getLogger("aiohttp.server").setLevel(logging.CRITICAL)
    path = write_trace(tmp_path / "chat.jsonl", chat_rows(conversations=6, turns=3, gap_ms=600))
    scenario = get_scenario("trace", "tiny", path)
    assert scenario.stages[0].arrivals == "trace"
    results = asyncio.run(run_scenario(scenario, ["round-robin", "epp-precise"], tmp_path / "out",
                                       progress=False, keep_raw=False))
    by_name = {r.name: r for r in results}
    for r in results:
        assert r.status == "ok", r.status
        assert r.overall is not None and r.overall.requests == 18 and r.overall.errors == 0
        assert r.overall.hit_rate is not None and r.overall.hit_rate <= r.overall.oracle_hit_rate + 1e-9
    # Conversations resend their history: routing by prefix reuses more of it than rotation does.
    assert by_name["epp-precise"].overall.hit_rate > by_name["round-robin"].overall.hit_rate
