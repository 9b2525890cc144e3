"""The agentic generator draws from its documented distributions (fixed seeds) and keeps the session shape."""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import replace

import pytest

from bench.agentic.bailian import bailian_sessions
from bench.agentic.workload import (
    PRESETS,
    AgenticParams,
    Dist,
    Segment,
    SessionPlan,
    generate,
    segment_text,
    summarize_plans,
)
from bench.routing.traces import TraceReplay
from bench.routing.workloads import tokenizer
from tests.bench.test_trace_replay import bailian_rows, write_trace


def test_a_dist_has_its_median_and_log_spread_and_stays_within_its_bounds():
    rng = random.Random(7)
    d = Dist(100.0, 0.8, 1.0, 1e9)
    values = [d.draw(rng) for _ in range(20_000)]
    assert statistics.median(values) == pytest.approx(100.0, rel=0.05)
    assert statistics.pstdev(math.log(v) for v in values) == pytest.approx(0.8, rel=0.05)
    clamped = Dist(100.0, 2.0, 50.0, 150.0)
    drawn = [clamped.draw(rng) for _ in range(2_000)]
    assert min(drawn) == 50.0 and max(drawn) == 150.0  # a wide spread piles up on the bounds
    assert Dist(10, 0, 10, 10).tokens(rng) == 10
    with pytest.raises(ValueError):
        Dist(5, 0.1, 10, 20)


def small_params(**kw) -> AgenticParams:
    return replace(PRESETS["small"], **kw)


def test_sessions_follow_the_kind_shares_turn_counts_and_arrival_rate():
    p = small_params(sessions=3000, spawn_share=0.0, session_rate=2.0, seed=11)
    plans = generate(p)
    assert len(plans) == 3000 and all(s.root for s in plans)
    shares = {k.name: sum(s.kind.name == k.name for s in plans) / len(plans) for k in p.kinds}
    for k in p.kinds:
        assert shares[k.name] == pytest.approx(k.share, abs=0.03)
    turns = [len(s.turns) - sum(t.compaction for t in s.turns) for s in plans]
    assert statistics.median(turns) == pytest.approx(p.turns.median, rel=0.1)
    assert min(turns) >= p.turns.low and max(turns) <= p.turns.high
    starts = [s.start_s for s in plans]
    assert starts == sorted(starts)
    gaps = [b - a for a, b in zip([0.0, *starts], starts)]
    assert statistics.fmean(gaps) == pytest.approx(1 / p.session_rate, rel=0.06)


def test_each_turn_resends_the_previous_prompt_plus_the_reply_and_what_came_back():
    p = small_params(sessions=200, seed=3)
    plans = generate(p)
    replies, tools, users, tool_pauses, human_pauses = [], [], [], [], []
    for s in plans:
        prefix = s.turns[0].segments[0]
        assert prefix.role == "prefix" and prefix.key == f"prefix:{s.kind.name}" and prefix.tokens == s.kind.prefix_tokens
        for a, b in zip(s.turns, s.turns[1:]):
            if a.compaction:
                # After a compaction the context restarts from the prefix and the summary the compaction wrote.
                assert b.segments[0] == prefix and b.segments[1].role == "summary"
                assert b.segments[1].tokens == a.output_tokens
                continue
            if b.compaction:
                assert b.segments[-1].role == "compact"
                grown = b.segments[len(a.segments):-1]
            else:
                grown = b.segments[len(a.segments):]
            assert b.segments[:len(a.segments)] == a.segments
            assert [g.role for g in grown] == ["reply", {"tool": "tool", "human": "user", "subagents": "report"}[
                a.pause_kind]]
            assert grown[0].tokens == a.output_tokens  # the reply appended is the turn's output
            replies.append(a.output_tokens)
            (users if a.pause_kind == "human" else tools).append(grown[1].tokens)
            if a.pause_kind == "tool":
                tool_pauses.append(a.pause_s)
            elif a.pause_kind == "human":
                human_pauses.append(a.pause_s)
        assert s.turns[-1].pause_kind == "end" and s.turns[-1].pause_s == 0
    assert statistics.median(replies) == pytest.approx(p.reply_tokens.median, rel=0.1)
    assert statistics.median(tools) == pytest.approx(p.tool_tokens.median, rel=0.15)
    assert statistics.median(users) == pytest.approx(p.user_tokens.median, rel=0.25)
    assert statistics.median(tool_pauses) == pytest.approx(p.tool_pause_s.median, rel=0.1)
    assert statistics.median(human_pauses) == pytest.approx(p.human_pause_s.median, rel=0.2)
    share = len(human_pauses) / (len(human_pauses) + len(tool_pauses))
    assert share == pytest.approx(p.human_share, abs=0.02)


def test_contexts_compact_past_the_limit_and_restart_from_the_prefix_and_a_summary():
    p = small_params(sessions=300, seed=5, turns=Dist(40, 0.3, 20, 80))
    plans = generate(p)
    summary = summarize_plans(plans)
    assert summary.compactions > 20
    biggest_growth = p.reply_tokens.high + p.tool_tokens.high + p.compact_tokens
    for s in plans:
        for t in s.turns:
            context = t.prompt_tokens - (p.compact_tokens if t.compaction else 0)
            if not t.compaction:
                assert t.prompt_tokens <= p.context_limit
            assert context <= p.context_limit + biggest_growth
    compactions = [t for s in plans for t in s.turns if t.compaction]
    assert statistics.median(t.output_tokens for t in compactions) == pytest.approx(p.summary_tokens.median, rel=0.15)


def test_sub_agents_share_the_parent_prefix_name_their_parent_and_the_parent_waits_for_them():
    p = small_params(sessions=400, seed=9, spawn_share=0.05)
    plans = generate(p)
    children = [s for s in plans if not s.root]
    spawning = [t for s in plans for t in s.turns if t.spawns]
    assert spawning and all(t.pause_kind == "subagents" and t.join for t in spawning)
    counts = [len(t.spawns) for t in spawning]
    assert min(counts) >= p.subagents[0] and max(counts) <= p.subagents[1]
    assert sum(counts) == len(children)
    share = len(spawning) / sum(len(s.turns) - 1 for s in plans if s.root)
    assert share == pytest.approx(p.spawn_share, abs=0.01)
    for c in children:
        parent = plans[c.parent]
        assert parent.root and c.index > parent.index and c.start_s is None
        assert c.kind == parent.kind and c.turns[0].segments[0] == parent.turns[0].segments[0]
        assert c.session_id.startswith(parent.session_id + ".sub")
        assert not any(t.spawns for t in c.turns)  # one level
    turns = [len(c.turns) - sum(t.compaction for t in c.turns) for c in children]
    assert statistics.median(turns) == pytest.approx(p.subagent_turns.median, rel=0.15)


def test_the_same_seed_gives_the_same_plans_and_another_seed_others():
    p = small_params(sessions=20, seed=1)
    assert generate(p) == generate(p)
    assert generate(p) != generate(replace(p, seed=2))
    # Adding sessions leaves the earlier ones as they were (each session has its own stream).
    more = generate(replace(p, sessions=25))
    roots = [s for s in more if s.root][:20]
    assert [s.session_id for s in roots] == [s.session_id for s in generate(p) if s.root]


def test_scaling_shrinks_tokens_and_keeps_turns_pauses_and_seed():
    full, small = PRESETS["full"], PRESETS["small"]
    assert small.token_scale == pytest.approx(0.075)
    assert [k.prefix_tokens for k in small.kinds] == [round(k.prefix_tokens * 0.075) for k in full.kinds]
    assert small.context_limit == round(full.context_limit * 0.075)
    assert small.tool_tokens.median == pytest.approx(full.tool_tokens.median * 0.075)
    assert small.turns == full.turns and small.tool_pause_s == full.tool_pause_s and small.seed == full.seed
    a, b = generate(replace(full, sessions=5)), generate(replace(small, sessions=5))
    assert [len(s.turns) for s in a if s.root][:1] and all(x.kind.name == y.kind.name for x, y in zip(a, b))
    assert small.record()["seed"] == 2026 and small.record()["token_scale"] == pytest.approx(0.075)
    with pytest.raises(ValueError):
        full.scaled(0)
    with pytest.raises(ValueError):
        replace(full, context_limit=10_000)  # below a prefix plus a summary


def test_segment_text_is_exactly_its_tokens_and_a_prefix_of_any_longer_run_of_its_key():
    tok = tokenizer().tokenizer
    short = segment_text(Segment("k", 50, "task"), seed=3)
    long = segment_text(Segment("k", 120, "task"), seed=3)
    assert long.startswith(short)
    assert len(tok.encode(long, add_special_tokens=False).ids) == 120
    two = segment_text(Segment("a", 30, "tool"), 3) + segment_text(Segment("b", 40, "reply"), 3)
    assert len(tok.encode(two, add_special_tokens=False).ids) == 70  # segments never merge
    assert segment_text(Segment("k", 50, "task"), seed=4) != short


def test_bailian_chains_become_sessions_with_trace_gaps_and_branches_link_their_parent(tmp_path):
    rows = bailian_rows(conversations=2, turns=3, gap_s=2.0)
    # A second child of chat 0 (conversation 0's first turn, at 2 s; its first child came at 4 s): a branch.
    rows.append({"chat_id": 50, "parent_chat_id": 0, "timestamp": 4.5, "input_length": 70, "output_length": 4,
                 "type": "text", "turn": 2, "hash_ids": [0, 1, 2, 90, 91]})
    rows.sort(key=lambda r: r["timestamp"])
    replay = TraceReplay(write_trace(tmp_path / "qwen.jsonl", rows), block_tokens=16, max_prompt_tokens=10_000,
                         speedup=2.0)
    plans = bailian_sessions(replay, seed=1)
    roots = [s for s in plans if s.root]
    assert len(roots) == 2 and [len(s.turns) for s in roots] == [3, 3]
    assert [s.start_s for s in roots] == pytest.approx([0.0, 0.05])  # trace seconds / speedup
    for s in roots:
        assert [t.pause_kind for t in s.turns] == ["trace", "trace", "end"]
        assert [t.pause_s for t in s.turns[:2]] == pytest.approx([2.0, 2.0])  # the gaps, in trace seconds
        for a, b in zip(s.turns, s.turns[1:]):
            assert b.segments[:len(a.segments) - 1] == a.segments[:-1]  # the history resent (last block partial)
    branch = next(s for s in plans if not s.root)
    assert branch.parent == roots[0].index and branch.session_id.startswith(roots[0].session_id)
    assert roots[0].turns[0].spawns == (branch.index,) and not roots[0].turns[0].join
    assert branch.start_delay_s == pytest.approx(2.5) and branch.delay_kind == "trace"
    assert {s.kind.header for s in plans} <= {"x-claude-code-session-id", "session-id", "x-session-affinity"}
    assert sum(t.prompt_tokens for t in branch.turns) == 70


def test_a_mooncake_trace_is_refused_for_session_replay(tmp_path):
    rows = [{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [1]}]
    with pytest.raises(ValueError, match="Bailian"):
        bailian_sessions(TraceReplay(write_trace(tmp_path / "m.jsonl", rows), block_tokens=16))


def test_plans_are_frozen_values():
    plan = generate(small_params(sessions=1))[0]
    assert isinstance(plan, SessionPlan)
    with pytest.raises(AttributeError):
        plan.turns = ()  # type: ignore[misc]
