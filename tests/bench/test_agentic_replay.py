"""Session replay: closed within a session (a turn never goes before its predecessor's answer plus the
pause), open across sessions (roots start on their own schedule), sub-agents joined, headers and
prompts as planned, a deadline that cancels what still runs."""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import replace

import aiohttp
import pytest
from aiohttp import web

from bench.agentic.replay import PauseScale, PromptBuilder, replay, session_headers
from bench.agentic.workload import PRESETS, Dist, generate
from bench.routing.workloads import tokenizer
from tests.support.backends import completions_backend

EPS = 0.002  # perf_counter readings of the client and the sleep's own wake-up


def streaming_backend(delay, seen: list[dict]):
    """A /v1/completions server that answers after `delay(body)` seconds, streaming max_tokens chunks."""

    async def handler(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        seen.append({"headers": dict(request.headers), "body": body, "at": time.perf_counter()})
        await asyncio.sleep(delay(body))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for _ in range(body["max_tokens"]):
            await resp.write(b'data: ' + json.dumps({"choices": [{"index": 0, "text": " x"}]}).encode() + b"\n\n")
        usage = {"prompt_tokens": 1, "completion_tokens": body["max_tokens"], "total_tokens": 2}
        await resp.write(b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    return handler


def tiny_plans(sessions: int = 6, seed: int = 4, **kw):
    p = replace(PRESETS["tiny"], sessions=sessions, session_rate=20.0, seed=seed, turns=Dist(4, 0.3, 3, 6), **kw)
    return generate(p), p


PAUSES = PauseScale(tool=0.01, human=0.002, trace=0.01)


async def run(plans, delay, *, pauses=PAUSES, deadline=60.0, **kw):
    seen: list[dict] = []
    async with completions_backend(streaming_backend(delay, seen)) as url, aiohttp.ClientSession() as http:
        result = await replay(http, url, plans, seed=7, pauses=pauses, deadline_s=deadline, **kw)
    return result, seen


async def test_a_turn_never_goes_before_its_predecessor_answer_plus_the_pause():
    plans, _ = tiny_plans(sessions=8, spawn_share=0.0)
    rng = random.Random(3)
    result, _ = await run(plans, lambda body: rng.uniform(0.01, 0.08))
    pauses = PAUSES
    checked = 0
    for s, plan in zip(result.sessions, plans):
        assert s.complete and len(s.turns) == len(plan.turns)
        for (a, b), turn in zip(zip(s.turns, s.turns[1:]), plan.turns):
            end = a.record.sent + a.record.e2e
            wait = pauses.wall(turn.pause_kind, turn.pause_s)
            assert b.ready == pytest.approx(end + wait, abs=1e-9)
            assert b.record.sent >= end + wait - EPS
            checked += 1
        assert s.finished == pytest.approx(s.turns[-1].record.sent + s.turns[-1].record.e2e)
    assert checked >= 8


async def test_sessions_start_on_their_own_schedule_however_slow_the_answers():
    plans, _ = tiny_plans(sessions=5, spawn_share=0.0)
    result, _ = await run(plans, lambda body: 0.5, deadline=0.8)  # every answer takes longer than the spacing
    for s, plan in zip(result.sessions, plans):
        assert s.turns[0].ready == pytest.approx(result.started + plan.start_s, abs=1e-9)
        assert s.turns[0].record.sent - result.started == pytest.approx(plan.start_s, abs=0.05)


async def test_sub_agents_start_after_their_spawning_turn_and_the_parent_waits_for_all_of_them():
    plans, p = tiny_plans(sessions=12, seed=21, spawn_share=0.6, subagents=(2, 3))
    assert any(not s.root for s in plans)
    result, seen = await run(plans, lambda body: 0.01 + 0.001 * body["max_tokens"])
    pauses = PAUSES
    for plan in plans:
        s = result.sessions[plan.index]
        assert s.complete
        for k, turn in enumerate(plan.turns):
            if not turn.spawns:
                continue
            end = s.turns[k].record.sent + s.turns[k].record.e2e
            last_child = max(result.sessions[c].finished for c in turn.spawns)
            for c in turn.spawns:
                child = result.sessions[c]
                assert child.turns[0].record.sent >= end + pauses.wall("tool", plans[c].start_delay_s) - EPS
            nxt = s.turns[k + 1]
            assert nxt.record.sent >= last_child + pauses.wall(turn.pause_kind, turn.pause_s) - EPS
    programs = result.roots()
    assert sorted(programs) == [s.index for s in plans if s.root]
    assert sum(len(v) for v in programs.values()) == len(plans)
    # Every child's turns name their parent; the parent's do not.
    parents = {s.session_id: plans[s.parent].session_id for s in plans if s.parent is not None}
    for req in seen:
        h = {k.lower(): v for k, v in req["headers"].items()}
        ids = [h[name] for name in ("x-claude-code-session-id", "session-id", "x-session-affinity") if name in h]
        assert len(ids) == 1
        assert h.get("x-parent-session-id") == parents.get(ids[0])


async def test_each_turn_carries_its_kind_header_and_aliases_and_its_planned_prompt():
    plans, _ = tiny_plans(sessions=6, spawn_share=0.0)
    result, seen = await run(plans, lambda body: 0.0, aliases=("x-session-id",))
    tok = tokenizer().tokenizer
    by_session: dict[str, list[dict]] = {}
    for req in seen:
        h = {k.lower(): v for k, v in req["headers"].items()}
        by_session.setdefault(h["x-session-id"], []).append(req)
    for plan in plans:
        reqs = by_session[plan.session_id]
        assert len(reqs) == len(plan.turns)
        for req, turn in zip(reqs, plan.turns):
            h = {k.lower(): v for k, v in req["headers"].items()}
            assert h[plan.kind.header] == plan.session_id
            assert req["body"]["max_tokens"] == turn.output_tokens and req["body"]["ignore_eos"] is True
            assert len(tok.encode(req["body"]["prompt"], add_special_tokens=False).ids) == turn.prompt_tokens
        prompts = [r["body"]["prompt"] for r in reqs]
        assert all(b.startswith(a) for a, b in zip(prompts, prompts[1:]) if len(b) > len(a))
    # The same kind's sessions start with the same prefix text.
    first = {}
    for plan in plans:
        text = by_session[plan.session_id][0]["body"]["prompt"]
        prefix_words = plan.kind.prefix_tokens
        first.setdefault(plan.kind.name, text[: len(text)])
        other = first[plan.kind.name]
        assert tok.encode(text, add_special_tokens=False).ids[:prefix_words] == \
            tok.encode(other, add_special_tokens=False).ids[:prefix_words]


async def test_the_deadline_cancels_what_still_runs_and_says_so():
    plans, _ = tiny_plans(sessions=3, spawn_share=0.0)
    result, _ = await run(plans, lambda body: 3.0, deadline=0.5)
    assert result.finished - result.started < 1.5
    assert not any(s.complete for s in result.sessions)
    assert all(t.record.error == "cancelled at the deadline" for s in result.sessions for t in s.turns)


def test_headers_and_pause_scales():
    plans, _ = tiny_plans(sessions=30, spawn_share=0.5)
    child = next(s for s in plans if s.parent is not None)
    h = session_headers(child, plans, aliases=("x-smg-routing-key",))
    assert h == {child.kind.header: child.session_id, "x-smg-routing-key": child.session_id,
                 "x-parent-session-id": plans[child.parent].session_id}
    scale = PauseScale(tool=2.0, human=0.5, trace=0.1)
    assert [scale.wall(k, 10) for k in ("tool", "subagents", "human", "trace", "end")] == [20, 20, 5, 1, 0]
    with pytest.raises(ValueError):
        scale.wall("coffee", 1)
    with pytest.raises(ValueError):
        PauseScale(tool=-1)


def test_the_prompt_builder_extends_a_session_and_bounds_its_shared_texts():
    plans, _ = tiny_plans(sessions=4, spawn_share=0.0)
    b = PromptBuilder(seed=1, capacity=2)
    s = plans[0]
    texts = [b.prompt(0, t.segments) for t in s.turns]
    fresh = PromptBuilder(seed=1)
    assert texts == [fresh.prompt(9, t.segments) for t in s.turns[::-1]][::-1]  # the same text built either way
    for plan in plans:
        b.prompt(plan.index, plan.turns[0].segments)
    assert len(b._shared) <= 2
