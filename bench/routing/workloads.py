"""Seeded, reproducible request traces for the routing benchmark.

Every workload is a deterministic function of its parameters and a seed: the same call yields
the same prompts in the same order. Prompt lengths are in tokens of the simulator's tokenizer
(the tiny model's byte-level BPE), so "a 4,096-token system prompt" is 4,096 tokens as the
replicas count them, whatever router sits in front.

- shared-prefix: `groups` system prompts of `system_tokens`, `users` questions of
  `question_tokens` per group; each request is one (group, user) pair drawn uniformly
  (the llm-d `shared_prefix` shape: 150 x 5 x 6,000 / 1,200 in "73-capacity").
- multi-turn: `sessions` chats that grow one turn at a time (previous turns, a synthetic
  assistant answer, then a new user message), turns interleaved across `active` sessions.
- agentic: long-context agents (completions API) whose context grows by a tool result per
  step: long input, short output.
- no-sharing: unique prompts with no common prefix beyond the BOS token (the control).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from epp.engine.sim.fleet import default_tokenizer_dir
from epp.engine.sim.tokenizer import SimTokenizer

MODEL = "sim-model"
_VOCAB = [
    "cache", "route", "replica", "token", "prompt", "model", "server", "latency", "queue", "block",
    "prefix", "request", "system", "user", "answer", "question", "table", "query", "index",
    "memory", "tier", "offload", "batch", "decode", "schedule", "policy", "invoice", "customer",
    "order", "region", "account", "report", "ticket", "invoice", "agent", "tool", "result", "file",
    "function", "error", "trace", "metric", "window", "budget",
]


@lru_cache(maxsize=2)
def tokenizer(tokenizer_dir: str | None = None) -> SimTokenizer:
    """The simulator's tokenizer (the same files the replicas load)."""
    return SimTokenizer(tokenizer_dir or default_tokenizer_dir())


def text_of_tokens(rng: random.Random, tokens: int, tok: SimTokenizer, tag: str = "") -> str:
    """Seeded random text that the simulator's tokenizer reads as about `tokens` tokens."""
    words = [tag] if tag else []
    # ~3 characters per token with this vocabulary: overshoot, then cut at the token boundary.
    while sum(len(w) + 1 for w in words) < tokens * 5:
        words.append(rng.choice(_VOCAB) + str(rng.randrange(1000)))
    text = " ".join(words)
    enc = tok.tokenizer.encode(text, add_special_tokens=False)
    if len(enc.ids) <= tokens:
        return text
    return text[: enc.offsets[tokens - 1][1]]


@dataclass(frozen=True, slots=True)
class BenchRequest:
    """One request of a trace: where it goes, its body, and the sharing group it belongs to."""

    path: str
    body: dict[str, Any]
    group: str
    max_tokens: int
    at: float | None = None  # seconds after the stage's start (timed replay); None: the stage's arrival process


def completion_request(prompt: str, max_tokens: int, group: str, at: float | None = None) -> BenchRequest:
    """A streamed completions request with usage reported."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}}
    return BenchRequest("/v1/completions", body, group, max_tokens, at)


def _chat(messages: list[dict[str, str]], max_tokens: int, group: str) -> BenchRequest:
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}}
    return BenchRequest("/v1/chat/completions", body, group, max_tokens)


@dataclass(frozen=True)
class SharedPrefix:
    """groups x users x system prompt x question x output (llm-d's shared_prefix)."""

    groups: int = 12
    users: int = 5
    system_tokens: int = 4096
    question_tokens: int = 512
    output_tokens: int = 32
    seed: int = 42
    name: str = field(default="shared-prefix", init=False)

    def describe(self) -> str:
        return (f"{self.groups} groups x {self.users} users, system prompt {self.system_tokens} tokens, "
                f"question {self.question_tokens} tokens, output {self.output_tokens} tokens")

    def mean_prompt_tokens(self) -> int:
        """Average prompt length, for contenders calibrated in seconds per prompt token."""
        return self.system_tokens + self.question_tokens

    def shared_tokens(self) -> int:
        """Tokens of all distinct system prompts together (what must fit the fleet's cache)."""
        return self.groups * self.system_tokens

    def requests(self, tokenizer_dir: str | None = None) -> Iterator[BenchRequest]:
        tok = tokenizer(tokenizer_dir)
        rng = random.Random(self.seed)
        systems = [text_of_tokens(rng, self.system_tokens, tok, f"group{g}:") for g in range(self.groups)]
        questions = [[text_of_tokens(rng, self.question_tokens, tok, f"user{g}.{u}:") for u in range(self.users)]
                     for g in range(self.groups)]
        while True:
            g, u = rng.randrange(self.groups), rng.randrange(self.users)
            yield completion_request(systems[g] + "\n" + questions[g][u], self.output_tokens, f"group-{g}")


@dataclass(frozen=True)
class MultiTurn:
    """Chat sessions that grow: each turn resends the history plus a new user message."""

    sessions: int = 32
    active: int = 8
    turns: int = 6
    system_tokens: int = 512
    user_tokens: int = 128
    answer_tokens: int = 128
    output_tokens: int = 32
    seed: int = 43
    name: str = field(default="multi-turn", init=False)

    def describe(self) -> str:
        return (f"{self.sessions} sessions ({self.active} active at a time) x {self.turns} turns, system "
                f"{self.system_tokens}, user {self.user_tokens}, answer {self.answer_tokens} tokens/turn")

    def mean_prompt_tokens(self) -> int:
        """Average prompt length over a session's turns."""
        return self.system_tokens + (self.turns + 1) * (self.user_tokens + self.answer_tokens) // 2

    def requests(self, tokenizer_dir: str | None = None) -> Iterator[BenchRequest]:
        tok = tokenizer(tokenizer_dir)
        rng = random.Random(self.seed)
        serial = 0
        while True:  # cycles of `sessions` new sessions, so an open-loop run never runs dry
            pending = list(range(self.sessions))
            active: dict[int, list[dict[str, str]]] = {}
            turn: dict[int, int] = {}
            while pending or active:
                while pending and len(active) < self.active:
                    s = pending.pop(0)
                    active[s] = [{"role": "system", "content": text_of_tokens(rng, self.system_tokens, tok,
                                                                              f"session{serial}.{s}:")}]
                    turn[s] = 0
                s = rng.choice(list(active))
                history = active[s]
                history.append({"role": "user", "content": text_of_tokens(rng, self.user_tokens, tok)})
                yield _chat(list(history), self.output_tokens, f"session-{serial}.{s}")
                history.append({"role": "assistant", "content": text_of_tokens(rng, self.answer_tokens, tok)})
                turn[s] += 1
                if turn[s] >= self.turns:
                    del active[s]
            serial += 1


@dataclass(frozen=True)
class Agentic:
    """Long-context agents: a long first context, a tool result appended per step, short outputs."""

    agents: int = 8
    active: int = 4
    steps: int = 6
    context_tokens: int = 4096
    tool_tokens: int = 384
    output_tokens: int = 16
    seed: int = 44
    name: str = field(default="agentic", init=False)

    def describe(self) -> str:
        return (f"{self.agents} agents ({self.active} active) x {self.steps} steps, initial context "
                f"{self.context_tokens} tokens, +{self.tool_tokens} tool tokens/step, output {self.output_tokens}")

    def mean_prompt_tokens(self) -> int:
        """Average context length over an agent's steps."""
        return self.context_tokens + (self.steps - 1) * self.tool_tokens // 2

    def requests(self, tokenizer_dir: str | None = None) -> Iterator[BenchRequest]:
        tok = tokenizer(tokenizer_dir)
        rng = random.Random(self.seed)
        serial = 0
        while True:
            pending = list(range(self.agents))
            active: dict[int, str] = {}
            step: dict[int, int] = {}
            while pending or active:
                while pending and len(active) < self.active:
                    a = pending.pop(0)
                    active[a] = text_of_tokens(rng, self.context_tokens, tok, f"agent{serial}.{a}:")
                    step[a] = 0
                a = rng.choice(list(active))
                yield completion_request(active[a], self.output_tokens, f"agent-{serial}.{a}")
                active[a] += "\n" + text_of_tokens(rng, self.tool_tokens, tok, f"tool{step[a]}:")
                step[a] += 1
                if step[a] >= self.steps:
                    del active[a]
            serial += 1


@dataclass(frozen=True)
class NoSharing:
    """Unique prompts: nothing to gain from cache-aware routing (the control)."""

    prompt_tokens: int = 2048
    output_tokens: int = 32
    seed: int = 45
    name: str = field(default="no-sharing", init=False)

    def describe(self) -> str:
        return f"unique prompts of {self.prompt_tokens} tokens, output {self.output_tokens} tokens"

    def mean_prompt_tokens(self) -> int:
        """Every prompt has the same length."""
        return self.prompt_tokens

    def requests(self, tokenizer_dir: str | None = None) -> Iterator[BenchRequest]:
        tok = tokenizer(tokenizer_dir)
        rng = random.Random(self.seed)
        i = 0
        while True:
            yield completion_request(text_of_tokens(rng, self.prompt_tokens, tok, f"unique{i}:"), self.output_tokens,
                              f"unique-{i}")
            i += 1


Workload = SharedPrefix | MultiTurn | Agentic | NoSharing

REAL_VLLM_WORKLOADS = ("shared-prefix", "multi-turn")


def real_vllm_workload(name: str, *, groups: int = 6, users: int = 4, system_tokens: int = 512,
                       question_tokens: int = 64, output_tokens: int = 8) -> Workload:
    """A real-vLLM run's workload by name, at the sizes its tiny replicas serve (prompts fit 1,536 tokens)."""
    if name == "shared-prefix":
        return SharedPrefix(groups=groups, users=users, system_tokens=system_tokens, question_tokens=question_tokens,
                            output_tokens=output_tokens)
    if name == "multi-turn":
        # 12 turns: a session's cold first turn is 1 request in 12, so the p90 is a routing result,
        # not the share of first turns every router must prefill whole.
        return MultiTurn(sessions=16, active=4, turns=12, system_tokens=128, user_tokens=32, answer_tokens=48,
                         output_tokens=output_tokens)
    raise ValueError(f"unknown workload {name!r}; known: {REAL_VLLM_WORKLOADS}")


__all__ = ["REAL_VLLM_WORKLOADS", "Agentic", "BenchRequest", "MultiTurn", "NoSharing", "SharedPrefix", "Workload",
           "completion_request", "real_vllm_workload", "text_of_tokens",
           "tokenizer"]
