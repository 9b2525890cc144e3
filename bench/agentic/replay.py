"""Session replay: closed within a session, open across sessions.

Every root session starts on its own schedule (`SessionPlan.start_s` after the replay's start,
whatever the router does: open across sessions). Within a session the next turn goes when the
previous answer has finished (the last byte of its stream) plus the pause after it (closed): a slow
router slows the session down, as it would slow an agent. A turn that spawns sub-agents starts them
when its answer has finished plus their start delay; when the turn joins them (the generator's
sub-agents), the session's next turn waits until every one of them has finished, then its pause.

**Time.** Plans give pauses in seconds of the agent's clock (a tool run, a person's reply); the
replay waits `PauseScale.wall(kind, seconds)` wall seconds: `tool` for tool pauses, sub-agent
dispatch and start delays, `human` for a person's, `trace` for a trace's recorded gaps. Against
a simulated fleet slowed by its `time_scale` (every GPU second takes `time_scale` wall seconds), a
pause scale of `time_scale` keeps pauses and service in the agent's proportions; a smaller one
compresses the pauses (minute-long human pauses are compressed so a run fits in minutes): in
simulated-GPU seconds a pause of p agent seconds then lasts p x scale / time_scale, so the fleet
does less work during it and a session's KV survives it more often than it would in reality. The
report states the scales used.

**Headers.** Each turn carries its session id in its agent kind's header (Claude Code's
`x-claude-code-session-id`, Codex's `session-id`, opencode's `x-session-affinity`), a spawned
session also its parent's id in the parent header (`x-parent-session-id`), and any `aliases`
(header names that carry the same id, for a router that reads only its own header, as a gateway
in front of it would add; the request bodies stay the same for every contender).

**Requests** go to `/v1/completions`, streamed with usage, `max_tokens` the planned output and
`ignore_eos` (a random-weight model would otherwise stop early); the prompt is the plan's segments as
text (bench/agentic/workload.py), built once per turn by extending the session's previous prompt.
A failed turn (an error status, a broken stream, a timeout) does not stop its session (the next
turn's prompt is fixed by the plan): the session and its program are marked incomplete. At
`deadline_s` whatever still runs is cancelled (its records say so) and counted incomplete.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import aiohttp

from bench.agentic.workload import PARENT_HEADER, Segment, SessionPlan, segment_text
from bench.routing.loadgen import RequestRecord, send
from bench.routing.workloads import MODEL, BenchRequest

SHARED_TEXTS = 65_536  # segment texts kept for reuse across sessions (prefixes, trace blocks), least recent out


@dataclass(frozen=True)
class PauseScale:
    """Wall seconds per agent second, by kind of pause."""

    tool: float = 1.0
    human: float = 1.0
    trace: float = 1.0

    def __post_init__(self) -> None:
        if min(self.tool, self.human, self.trace) < 0:
            raise ValueError("pause scales must be >= 0")

    def wall(self, kind: str, seconds: float) -> float:
        """The wall seconds a pause of `seconds` agent seconds of this kind lasts."""
        if kind in ("tool", "subagents"):
            return seconds * self.tool
        if kind == "human":
            return seconds * self.human
        if kind == "trace":
            return seconds * self.trace
        if kind == "end":
            return 0.0
        raise ValueError(f"unknown pause kind {kind!r}")


@dataclass(slots=True)
class TurnResult:
    """One turn as replayed: its request record and when it was allowed to go."""

    session: int
    turn: int
    record: RequestRecord
    ready: float  # perf_counter: the session's start, or the previous answer's end (and sub-agents) plus the pause
    compaction: bool
    planned_prompt_tokens: int
    planned_output_tokens: int


@dataclass
class SessionResult:
    """One session as replayed."""

    index: int
    session_id: str
    kind: str
    parent: int | None
    planned_turns: int
    turns: list[TurnResult] = field(default_factory=list)
    finished: float | None = None  # the last answer's end (perf_counter), when every turn was answered

    @property
    def started(self) -> float | None:
        """When the session was due to start (its first turn's ready time)."""
        return self.turns[0].ready if self.turns else None

    @property
    def complete(self) -> bool:
        return len(self.turns) == self.planned_turns and all(t.record.ok for t in self.turns)


@dataclass
class ReplayResult:
    """Every session of a replay, in plan order."""

    sessions: list[SessionResult]
    started: float
    finished: float

    def records(self) -> list[RequestRecord]:
        """Every turn's record, session by session, turn by turn (the same order for every contender)."""
        return [t.record for s in self.sessions for t in s.turns]

    def roots(self) -> dict[int, list[SessionResult]]:
        """Programs: each root session's index -> the root and every session it (transitively) spawned."""
        root_of: dict[int, int] = {}
        out: dict[int, list[SessionResult]] = {}
        for s in self.sessions:  # a parent always comes before the sessions it spawns
            root = s.index if s.parent is None else root_of[s.parent]
            root_of[s.index] = root
            out.setdefault(root, []).append(s)
        return out


def session_headers(plan: SessionPlan, plans: Sequence[SessionPlan], aliases: Sequence[str] = (),
                    parent_header: str = PARENT_HEADER) -> dict[str, str]:
    """The headers every turn of `plan` carries: its kind's session header, the aliases, the parent link."""
    headers = {plan.kind.header: plan.session_id}
    for name in aliases:
        headers[name] = plan.session_id
    if plan.parent is not None:
        headers[parent_header] = plans[plan.parent].session_id
    return headers


class PromptBuilder:
    """Prompts as text: a session's next prompt extends its previous one; shared segments' texts are kept."""

    def __init__(self, seed: int, tokenizer_dir: str | None = None, capacity: int = SHARED_TEXTS) -> None:
        self.seed, self.tokenizer_dir, self.capacity = seed, tokenizer_dir, capacity
        self._sessions: dict[int, tuple[tuple[Segment, ...], str]] = {}
        self._shared: OrderedDict[tuple[str, int], str] = OrderedDict()

    def _text(self, s: Segment) -> str:
        if s.role not in ("prefix", "block"):  # a session's own text is used once
            return segment_text(s, self.seed, self.tokenizer_dir)
        key = (s.key, s.tokens)
        text = self._shared.get(key)
        if text is None:
            text = self._shared[key] = segment_text(s, self.seed, self.tokenizer_dir)
            if len(self._shared) > self.capacity:
                self._shared.popitem(last=False)
        else:
            self._shared.move_to_end(key)
        return text

    def prompt(self, session: int, segments: tuple[Segment, ...]) -> str:
        """The prompt of `segments` for `session` (reusing its previous prompt when this one extends it)."""
        prev = self._sessions.get(session)
        if prev is not None and segments[:len(prev[0])] == prev[0]:
            text = prev[1] + "".join(self._text(s) for s in segments[len(prev[0]):])
        else:
            text = "".join(self._text(s) for s in segments)
        self._sessions[session] = (segments, text)
        return text

    def forget(self, session: int) -> None:
        """Drop a finished session's prompt."""
        self._sessions.pop(session, None)


def turn_request(prompt: str, output_tokens: int, group: str) -> BenchRequest:
    """A streamed completions request that generates exactly `output_tokens` tokens."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": output_tokens, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    return BenchRequest("/v1/completions", body, group, output_tokens)


async def replay(http: aiohttp.ClientSession, base_url: str, plans: Sequence[SessionPlan], *, seed: int,
                 pauses: PauseScale, deadline_s: float, request_timeout: float = 600.0,
                 aliases: Sequence[str] = (), parent_header: str = PARENT_HEADER, tokenizer_dir: str | None = None,
                 on_turn: Callable[[TurnResult], None] | None = None) -> ReplayResult:
    """Replay `plans` against `base_url`: roots at their start times, turns closed-loop within each session."""
    t0 = time.perf_counter()
    results = [SessionResult(p.index, p.session_id, p.kind.name, p.parent, len(p.turns)) for p in plans]
    prompts = PromptBuilder(seed, tokenizer_dir)
    tasks: set[asyncio.Task[None]] = set()

    def start(plan: SessionPlan, at: float) -> asyncio.Task[None]:
        task = asyncio.ensure_future(run_session(plan, at))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        return task

    async def run_session(plan: SessionPlan, ready: float) -> None:
        res = results[plan.index]
        headers = session_headers(plan, plans, aliases, parent_header)
        end = ready
        try:
            for t, turn in enumerate(plan.turns):
                delay = ready - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                record = RequestRecord(stage=0, group=plan.session_id, sent=0.0)
                result = TurnResult(plan.index, t, record, ready, turn.compaction, turn.prompt_tokens,
                                    turn.output_tokens)
                res.turns.append(result)
                req = turn_request(prompts.prompt(plan.index, turn.segments), turn.output_tokens, plan.session_id)
                await send(http, base_url, req, record, request_timeout, headers)
                end = record.sent + record.e2e if record.e2e is not None else time.perf_counter()
                if on_turn is not None:
                    on_turn(result)
                children = [start(plans[c], end + pauses.wall(plans[c].delay_kind, plans[c].start_delay_s))
                            for c in turn.spawns]
                base = end
                if children and turn.join:
                    await asyncio.gather(*children)
                    base = max(end, time.perf_counter())
                ready = base + pauses.wall(turn.pause_kind, turn.pause_s)
            if res.complete:
                res.finished = end
        finally:
            prompts.forget(plan.index)

    for plan in plans:
        if plan.start_s is not None:
            start(plan, t0 + plan.start_s)
    deadline = t0 + deadline_s
    while tasks:
        remaining = deadline - time.perf_counter()
        if remaining <= 0:
            break
        await asyncio.wait(set(tasks), timeout=remaining)
    for task in list(tasks):
        task.cancel()
    await asyncio.gather(*list(tasks), return_exceptions=True)
    for s in results:
        for t in s.turns:
            if t.record.e2e is None and t.record.error is None:
                t.record.error = "cancelled at the deadline"
    return ReplayResult(results, t0, time.perf_counter())


__all__ = ["SHARED_TEXTS", "PauseScale", "PromptBuilder", "ReplayResult", "SessionResult", "TurnResult", "replay",
           "session_headers", "turn_request"]
