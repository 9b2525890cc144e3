"""Sessions from an Alibaba Bailian / Qwen trace (`chat_id` / `parent_chat_id` chains) as replay plans.

bench/routing/traces.py reads the format (and samples whole conversations: `TraceReplay`'s window,
fraction and scaling knobs apply unchanged); this module turns the sampled requests into sessions:

- a request whose `parent_chat_id` is not in the sample starts a session (a root), at its own
  timestamp (divided by `speedup`);
- a request continues its parent's session when it is the parent's first child in time;
- a later child of the same parent (the trace branches: a regenerated answer, a parallel call) starts
  a session of its own, linked to the parent's session by the parent header and started when the
  parent's turn has been answered plus the recorded gap, without the parent waiting for it;
- each turn's prompt is its `hash_ids` (each id the same text wherever it appears, 16 tokens in the
  trace, `block_tokens` here; the last block partial as the trace says), its output the trace's
  `output_length`, both scaled and capped as `TraceReplay` does;
- the pause after a turn is the gap to the session's next request in the trace. The trace records
  arrivals, not completions, so that gap also holds the original answer's own time: replayed
  closed-loop, a session takes at least its trace span plus its answers here (`pause_kind` "trace",
  scaled by the replay's trace scale, 1 / `speedup` by default).

The trace names no agent: each session gets an agent kind's session header by a seeded draw over
`kinds` (their shares), so the replay sends Claude Code's, Codex's and opencode's headers mixed.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from bench.agentic.workload import AGENT_KINDS, AgentKind, Segment, SessionPlan, TurnPlan
from bench.routing.traces import TraceRecord, TraceReplay


@dataclass
class _Open:
    index: int
    session_id: str
    kind: AgentKind
    start_s: float | None
    parent: int | None
    delay_s: float
    turns: list[TurnPlan]
    times: list[float]  # trace seconds of each turn
    chat_ids: list[int]


def _segments(replay: TraceReplay, r: TraceRecord) -> tuple[Segment, ...]:
    n = replay.prompt_tokens(r)
    out = []
    for h in r.hash_ids:
        if n <= 0:
            break
        out.append(Segment(f"h{h}", min(replay.block_tokens, n), "block"))
        n -= replay.block_tokens
    return tuple(out)


def bailian_sessions(replay: TraceReplay, kinds: Sequence[AgentKind] = AGENT_KINDS, seed: int = 2026) -> list[SessionPlan]:
    """The sessions of the requests `replay` selects (a Bailian trace); index = position."""
    records = replay.selected()
    if not records or records[0].chat_id is None:
        raise ValueError(f"{replay.path}: session replay needs a Bailian trace (chat_id / parent_chat_id chains)")
    rng = random.Random(f"{seed}:bailian-kinds")
    t0 = records[0].timestamp_ms / 1000
    sessions: list[_Open] = []
    where: dict[int, tuple[int, int]] = {}  # chat_id -> (session, turn)
    children: dict[int, int] = {}  # chat_id -> children seen so far
    for r in records:
        ts = r.timestamp_ms / 1000
        turn = TurnPlan(_segments(replay, r), replay.output_tokens(r), 0.0, "end")
        assert r.chat_id is not None and r.parent_chat_id is not None  # a Bailian record has both
        parent = where.get(r.parent_chat_id)
        if parent is not None and children.get(r.parent_chat_id, 0) == 0:
            s = sessions[parent[0]]
        else:
            kind = rng.choices(list(kinds), weights=[k.share for k in kinds])[0]
            index = len(sessions)
            if parent is None:
                s = _Open(index, f"chat{r.chat_id}-{kind.name}", kind, (ts - t0) / replay.speedup, None, 0.0, [], [], [])
            else:
                ps = sessions[parent[0]]
                s = _Open(index, f"{ps.session_id}.branch{r.chat_id}", kind, None, ps.index,
                          ts - ps.times[parent[1]], [], [], [])
                spawning = ps.turns[parent[1]]
                ps.turns[parent[1]] = TurnPlan(spawning.segments, spawning.output_tokens, spawning.pause_s,
                                               spawning.pause_kind, (*spawning.spawns, index), join=False)
            sessions.append(s)
        if parent is not None:
            children[r.parent_chat_id] = children.get(r.parent_chat_id, 0) + 1
        if s.turns:  # the previous turn's pause: the trace's gap to this one
            prev = s.turns[-1]
            s.turns[-1] = TurnPlan(prev.segments, prev.output_tokens, ts - s.times[-1], "trace", prev.spawns, prev.join)
        s.turns.append(turn)
        s.times.append(ts)
        s.chat_ids.append(r.chat_id)
        where[r.chat_id] = (s.index, len(s.turns) - 1)
    return [SessionPlan(s.index, s.session_id, s.kind, s.start_s, s.parent, tuple(s.turns), s.delay_s, "trace")
            for s in sessions]


__all__ = ["bailian_sessions"]
