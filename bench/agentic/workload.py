"""A seeded generator of coding-agent traffic: sessions of tens of turns over a long shared prefix.

The shape (issue 43), at full scale (`token_scale` 1.0):

- **Agent kinds** (`AgentKind`): each carries a fixed prefix (system prompt and tool definitions)
  that every session of the kind starts with, and the session header its client sends:
  Claude Code (18,000 tokens, `x-claude-code-session-id`, half the sessions), Codex (12,000,
  `session-id`, a quarter) and opencode (10,000, `x-session-affinity`, a quarter).
- **A session** starts with the prefix and a task (`task_tokens`), then runs `turns` turns. Each
  turn's prompt is the previous prompt plus the model's reply to it (`reply_tokens`, which is also
  the turn's output length) plus what came back: a tool result (`tool_tokens`) after a tool pause,
  or a person's message (`user_tokens`) after a human pause. So the context grows by a few thousand
  tokens a turn, to 100k and more in the long sessions.
- **Pauses** between turns: a person answers with probability `human_share` after
  `human_pause_s`, otherwise a tool runs for `tool_pause_s` (seconds of the agent's own clock: the
  replay scales them, bench/agentic/replay.py).
- **Compaction**: when the next turn's context would pass `context_limit`, the agent first sends a
  compaction turn (the whole context plus a short instruction; its output is a summary of
  `summary_tokens`), and the next turn's context restarts from the prefix plus that summary.
- **Sub-agents**: a turn spawns sub-agents with probability `spawn_share` (between `subagents[0]`
  and `subagents[1]` of them); they run in parallel, each a session of the parent's kind (the same
  prefix) of `subagent_turns` turns starting from a task, linked to the parent by the parent
  header; the parent's next turn waits until all of them have finished and reads their reports as
  its tool result. Sub-agents do not spawn (one level, as Claude Code's Task tool).
- **Arrivals**: `sessions` root sessions start as a Poisson process of `session_rate` a second
  (open across sessions; `seed` fixes it).

Every length is drawn from a lognormal (`Dist`: a median, a spread `sigma` of the log, clamped to
[low, high]); the defaults are our reading of coding-agent traffic (a long tail of large tool
results such as file reads, short replies that are mostly tool calls, pauses of seconds for tools
and of tens of seconds to minutes for people), not a fit to a published trace: no public trace
records pauses and per-turn growth together. `tests/bench/test_agentic_workload.py` checks that
the generator draws from these distributions on fixed seeds.

**Scale.** `scaled(f)` multiplies every token length (prefixes, replies, tool results, the context
limit, summaries) by f and keeps turns, pauses and probabilities, so the shape stays while a
simulated replica of 16k tokens (`small`: f = 0.075, a 12,000-token limit) or a tiny real vLLM
(`tiny`: f = 0.01) can serve it. `PRESETS` names the scales the benchmark uses.

The generator produces plans (`SessionPlan`: per turn the prompt as a list of `Segment`s, the
output length, the pause after it, the sub-agents it starts); `segment_text` turns a segment
into text of exactly its token count (single-token words, so segments never merge across their
boundary), the same text for the same segment key every time (a kind's prefix is one key shared
by all its sessions). Same parameters and seed, same plans, same prompts.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from bench.routing.traces import single_token_words


@dataclass(frozen=True)
class Dist:
    """A lognormal with median `median` and log-spread `sigma`, clamped to [low, high]."""

    median: float
    sigma: float
    low: float
    high: float

    def __post_init__(self) -> None:
        if not (0 < self.low <= self.median <= self.high) or self.sigma < 0:
            raise ValueError(f"a Dist needs 0 < low <= median <= high and sigma >= 0, got {self}")

    def draw(self, rng: random.Random) -> float:
        """One value."""
        return min(self.high, max(self.low, self.median * math.exp(self.sigma * rng.gauss(0.0, 1.0))))

    def tokens(self, rng: random.Random) -> int:
        """One value rounded to a whole number of tokens (at least 1)."""
        return max(1, round(self.draw(rng)))

    def scaled(self, factor: float) -> Dist:
        """The same shape, every value times `factor` (never below one token)."""
        return Dist(max(1.0, self.median * factor), self.sigma, max(1.0, self.low * factor),
                    max(1.0, self.high * factor))


@dataclass(frozen=True)
class AgentKind:
    """A kind of agent: its shared prefix, the header its client names the session in, its share of sessions."""

    name: str
    header: str
    prefix_tokens: int
    share: float


AGENT_KINDS = (
    AgentKind("claude-code", "x-claude-code-session-id", 18_000, 0.5),
    AgentKind("codex", "session-id", 12_000, 0.25),
    AgentKind("opencode", "x-session-affinity", 10_000, 0.25),
)
PARENT_HEADER = "x-parent-session-id"  # agent-identity's default parentSessionHeader


@dataclass(frozen=True)
class AgenticParams:
    """Everything the generator draws from (see the module docstring); `asdict` is what a result records."""

    kinds: tuple[AgentKind, ...] = AGENT_KINDS
    sessions: int = 100
    session_rate: float = 0.05  # root sessions started a second (Poisson)
    turns: Dist = Dist(24, 0.6, 4, 80)
    task_tokens: Dist = Dist(500, 0.8, 50, 4_000)
    reply_tokens: Dist = Dist(250, 0.9, 16, 4_000)
    tool_tokens: Dist = Dist(2_500, 1.2, 20, 30_000)
    user_tokens: Dist = Dist(60, 1.0, 5, 2_000)
    human_share: float = 0.1
    tool_pause_s: Dist = Dist(2.0, 1.0, 0.05, 120.0)
    human_pause_s: Dist = Dist(45.0, 1.0, 5.0, 1_800.0)
    context_limit: int = 160_000
    compact_tokens: int = 40  # the compaction instruction
    summary_tokens: Dist = Dist(3_000, 0.5, 500, 10_000)
    spawn_share: float = 0.03
    subagents: tuple[int, int] = (1, 4)
    subagent_turns: Dist = Dist(8, 0.5, 2, 30)
    token_scale: float = 1.0  # what `scaled` applied (recorded; the lengths above are already scaled)
    seed: int = 2026

    def __post_init__(self) -> None:
        if not self.kinds or any(k.share <= 0 or k.prefix_tokens < 1 for k in self.kinds):
            raise ValueError("agent kinds need a positive share and prefix")
        if self.sessions < 1 or self.session_rate <= 0:
            raise ValueError("sessions must be >= 1 and session_rate > 0")
        for name in ("human_share", "spawn_share"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name} must be within [0, 1]")
        if not 0 <= self.subagents[0] <= self.subagents[1]:
            raise ValueError("subagents must be (min, max) with 0 <= min <= max")
        if self.context_limit <= max(k.prefix_tokens for k in self.kinds) + self.summary_tokens.high:
            raise ValueError("context_limit must exceed the longest prefix plus the longest summary")

    def scaled(self, factor: float) -> AgenticParams:
        """Every token length times `factor` (turns, pauses and probabilities unchanged)."""
        if factor <= 0:
            raise ValueError("a token scale must be > 0")
        kinds = tuple(replace(k, prefix_tokens=max(1, round(k.prefix_tokens * factor))) for k in self.kinds)
        return replace(self, kinds=kinds, task_tokens=self.task_tokens.scaled(factor),
                       reply_tokens=self.reply_tokens.scaled(factor), tool_tokens=self.tool_tokens.scaled(factor),
                       user_tokens=self.user_tokens.scaled(factor), summary_tokens=self.summary_tokens.scaled(factor),
                       context_limit=max(2, round(self.context_limit * factor)),
                       compact_tokens=max(1, round(self.compact_tokens * factor)),
                       token_scale=self.token_scale * factor)

    def record(self) -> dict[str, Any]:
        """The parameters as plain JSON (what results.json keeps, seeds included)."""
        return asdict(self)

    def describe(self) -> str:
        """One line: sessions, kinds and their prefixes, the scale, the seed."""
        kinds = ", ".join(f"{k.name} {k.prefix_tokens} ({k.share:.0%})" for k in self.kinds)
        return (f"{self.sessions} sessions at {self.session_rate:g}/s, turns median {self.turns.median:g}, prefixes "
                f"{kinds}, tool result median {self.tool_tokens.median:g}, reply median {self.reply_tokens.median:g}, "
                f"context limit {self.context_limit}, token scale {self.token_scale:g}, seed {self.seed}")


# The scales the benchmark runs at: full (llm-d's conditions, the CPU benchmark), the simulated
# fleet (16k-token replicas), the tiny model of the real vLLM-CPU run and of CI.
PRESETS: dict[str, AgenticParams] = {
    "full": AgenticParams(),
    "small": AgenticParams().scaled(0.075),
    "tiny": replace(AgenticParams().scaled(0.01), turns=Dist(6, 0.5, 2, 12), subagent_turns=Dist(3, 0.3, 2, 5)),
}


@dataclass(frozen=True, slots=True)
class Segment:
    """A run of `tokens` tokens of the text seeded by `key` (the same key: the same text)."""

    key: str
    tokens: int
    role: str  # prefix | task | reply | tool | user | compact | summary | report | block


@dataclass(frozen=True)
class TurnPlan:
    """One request of a session: its whole prompt, its output, and what follows it."""

    segments: tuple[Segment, ...]
    output_tokens: int
    pause_s: float  # after the answer (agent seconds; 0 after the last turn)
    pause_kind: str  # "tool" | "human" | "subagents" | "end"
    spawns: tuple[int, ...] = ()  # sessions started when this turn's answer has finished
    join: bool = True  # the next turn waits until the spawned sessions have finished
    compaction: bool = False  # a compaction request (its output is the summary the next turn starts from)

    @property
    def prompt_tokens(self) -> int:
        """Tokens of the prompt (without the BOS the replica adds)."""
        return sum(s.tokens for s in self.segments)


@dataclass(frozen=True)
class SessionPlan:
    """A session: its id and kind, when it starts, its parent, its turns."""

    index: int
    session_id: str
    kind: AgentKind
    start_s: float | None  # root sessions: seconds after the run's start; spawned ones: None
    parent: int | None
    turns: tuple[TurnPlan, ...]
    start_delay_s: float = 0.0  # spawned sessions: after the spawning turn's answer (agent seconds)
    delay_kind: str = "tool"  # how the replay scales that delay (a pause kind)

    @property
    def root(self) -> bool:
        return self.parent is None


def _kind(rng: random.Random, kinds: Sequence[AgentKind]) -> AgentKind:
    return rng.choices(list(kinds), weights=[k.share for k in kinds])[0]


class _Builder:
    """Builds the plans of one run: root sessions in start order, sub-agents appended as they are spawned."""

    def __init__(self, p: AgenticParams) -> None:
        self.p = p
        self.plans: list[SessionPlan | None] = []

    def reserve(self) -> int:
        self.plans.append(None)
        return len(self.plans) - 1

    def session(self, index: int, session_id: str, kind: AgentKind, start_s: float | None, parent: int | None,
                turns: int, rng: random.Random) -> None:
        p = self.p
        prefix = Segment(f"prefix:{kind.name}", kind.prefix_tokens, "prefix")
        context: list[Segment] = [prefix, Segment(f"{session_id}:task", p.task_tokens.tokens(rng), "task")]
        plans: list[TurnPlan] = []
        turn = 0
        while turn < turns:
            reply = p.reply_tokens.tokens(rng)
            last = turn == turns - 1
            spawns: tuple[int, ...] = ()
            if last:
                pause, kind_of_pause = 0.0, "end"
            elif parent is None and p.subagents[1] > 0 and rng.random() < p.spawn_share:
                n = rng.randint(max(1, p.subagents[0]), p.subagents[1])
                spawns = tuple(self.reserve() for _ in range(n))
                pause, kind_of_pause = p.tool_pause_s.draw(rng), "subagents"
            elif rng.random() < p.human_share:
                pause, kind_of_pause = p.human_pause_s.draw(rng), "human"
            else:
                pause, kind_of_pause = p.tool_pause_s.draw(rng), "tool"
            plans.append(TurnPlan(tuple(context), reply, pause, kind_of_pause, spawns))
            for j, child in enumerate(spawns):
                child_rng = random.Random(f"{p.seed}:session:{session_id}.sub{turn}.{j}")
                self.session(child, f"{session_id}.sub{turn}.{j}", kind, None, index,
                             round(p.subagent_turns.draw(child_rng)), child_rng)
            if last:
                break
            came_back = (p.user_tokens if kind_of_pause == "human" else p.tool_tokens).tokens(rng)
            role = {"human": "user", "subagents": "report"}.get(kind_of_pause, "tool")
            grown = [Segment(f"{session_id}:{turn}:reply", reply, "reply"),
                     Segment(f"{session_id}:{turn}:{role}", came_back, role)]
            if sum(s.tokens for s in context) + sum(s.tokens for s in grown) > p.context_limit:
                # The agent compacts before it goes on: one request over the whole context asks for a
                # summary, and the context restarts from the prefix, the summary and what just came back.
                summary = p.summary_tokens.tokens(rng)
                instruction = Segment(f"{session_id}:{turn}:compact", p.compact_tokens, "compact")
                plans.append(TurnPlan((*context, *grown, instruction), summary, 0.0, "tool", compaction=True))
                context = [prefix, Segment(f"{session_id}:{turn}:summary", summary, "summary")]
                grown = grown[1:]
            context.extend(grown)
            turn += 1
        delay = p.tool_pause_s.draw(rng) if start_s is None else 0.0
        self.plans[index] = SessionPlan(index, session_id, kind, start_s, parent, tuple(plans), delay)


def generate(p: AgenticParams) -> list[SessionPlan]:
    """The plans of `p.sessions` root sessions and every sub-agent they spawn (index = position)."""
    arrivals = random.Random(f"{p.seed}:arrivals")
    b = _Builder(p)
    t = 0.0
    for s in range(p.sessions):
        t += arrivals.expovariate(p.session_rate)
        rng = random.Random(f"{p.seed}:session:{s}")
        kind = _kind(rng, p.kinds)
        index = b.reserve()
        b.session(index, f"s{s:04d}-{kind.name}", kind, t, None, round(p.turns.draw(rng)), rng)
    plans = [pl for pl in b.plans if pl is not None]
    assert len(plans) == len(b.plans)
    return plans


@dataclass(frozen=True)
class PlanSummary:
    """What a set of plans holds (the report's workload section)."""

    sessions: int
    subagents: int
    turns: int
    compactions: int
    mean_prompt_tokens: float
    max_prompt_tokens: int
    prompt_tokens: int
    output_tokens: int
    pauses: dict[str, int] = field(default_factory=dict)
    arrival_span_s: float = 0.0

    def describe(self) -> str:
        pauses = ", ".join(f"{k} {v}" for k, v in sorted(self.pauses.items()))
        return (f"{self.sessions} root sessions and {self.subagents} sub-agents, {self.turns} turns "
                f"({self.compactions} compactions), prompts mean {self.mean_prompt_tokens:,.0f} / max "
                f"{self.max_prompt_tokens:,} tokens, {self.prompt_tokens:,} prompt and {self.output_tokens:,} output "
                f"tokens in all; pauses: {pauses}; sessions start over {self.arrival_span_s:.0f} s")


def summarize_plans(plans: Sequence[SessionPlan]) -> PlanSummary:
    """Counts and sizes of `plans`."""
    turns = [t for s in plans for t in s.turns]
    pauses: dict[str, int] = {}
    for t in turns:
        pauses[t.pause_kind] = pauses.get(t.pause_kind, 0) + 1
    starts = [s.start_s for s in plans if s.start_s is not None]
    prompt = [t.prompt_tokens for t in turns]
    return PlanSummary(sum(s.root for s in plans), sum(not s.root for s in plans), len(turns),
                       sum(t.compaction for t in turns), sum(prompt) / max(len(prompt), 1), max(prompt, default=0),
                       sum(prompt), sum(t.output_tokens for t in turns), pauses,
                       (max(starts) - min(starts)) if starts else 0.0)


def segment_words(key: str, tokens: int, seed: int, tokenizer_dir: str | None = None) -> Iterator[str]:
    """The first `tokens` single-token words of the text seeded by `key` (a prefix of any longer run of it)."""
    words = single_token_words(tokenizer_dir)
    rng = random.Random(f"{seed}:text:{key}")
    for _ in range(tokens):
        yield rng.choice(words)


def segment_text(segment: Segment, seed: int, tokenizer_dir: str | None = None) -> str:
    """The text of a segment: exactly `segment.tokens` tokens of the simulator's tokenizer."""
    return "".join(segment_words(segment.key, segment.tokens, seed, tokenizer_dir))


__all__ = ["AGENT_KINDS", "PARENT_HEADER", "PRESETS", "AgentKind", "AgenticParams", "Dist", "PlanSummary", "Segment",
           "SessionPlan", "TurnPlan", "generate", "segment_text", "segment_words", "summarize_plans"]
