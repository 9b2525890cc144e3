"""Replay request traces (Mooncake or Alibaba Bailian JSONL) as a routing-benchmark workload.

Two formats, told apart line by line (one file holds one of them):
- Mooncake (FAST '25): `timestamp` (ms from the trace start), `input_length` and
  `output_length` (tokens) and `hash_ids`, one id per 512-token block of the prompt;
- Alibaba Bailian / Qwen (the `qwen_trace*` files): `chat_id`, `parent_chat_id` (the previous
  turn's `chat_id`, -1 for a conversation's first), `timestamp` (seconds), `input_length`,
  `output_length`, `type` (a workload tag), `turn` and `hash_ids` of 16-token blocks.
In both the last block may be partial, and equal ids mean identical content, so two requests
sharing their first k ids share a k-block prefix. The replay turns every id into the same seeded text each time it is
used (single-token words of the model's tokenizer, so a block is exactly its token count and
blocks concatenate without merging across their boundary) and sends each request at its own
timestamp (open loop, `BenchRequest.at`).

Knobs a small machine needs (`TraceReplay`):
- `block_tokens`: tokens per hash block (512 in a Mooncake trace, 16 in a Bailian one; fewer
  shrinks every prompt by the same factor and keeps the sharing structure), `max_prompt_tokens`: a cap (longer prompts
  keep their first blocks), `max_output_tokens`: a cap on the (equally scaled) output;
- `speedup`: trace seconds per wall second;
- `start_s` / `window_s`: where in the trace to start and how long a stretch to take;
- `fraction`: sample whole conversations (a seeded share of them, every turn of each kept)
  instead of cutting a contiguous slice, which holds little reuse because the turns of one
  conversation are minutes apart. A Bailian trace names each request's previous turn
  (`parent_chat_id`), so its conversations are those chains (a turn whose parent is not in the
  file starts one). A Mooncake trace names no conversations: a request continues the
  conversation of the earlier request it shares its longest prefix with, when that prefix
  reaches beyond the blocks common to a large share of the trace (a system prompt every
  request starts with links nothing; `common_share` sets that share, 5 % by default, which
  suits a trace of thousands of requests, not one of a few dozen).
"""

from __future__ import annotations

import json
import math
import random
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from bench.routing.workloads import BenchRequest, completion_request, tokenizer
from epp.engine.sim.tokenizer import SimTokenizer

TRACE_BLOCK_TOKENS = 512  # what one Mooncake hash id stands for
BAILIAN_BLOCK_TOKENS = 16  # what one Bailian hash id stands for
COMMON_BLOCK_SHARE = 0.05  # blocks in at least this share of requests are shared context, not a conversation


class TraceFormatError(ValueError):
    """A trace file that is neither Mooncake nor Bailian JSONL (the message names the file and line)."""


@dataclass(frozen=True, slots=True)
class TraceRecord:
    """One line of a trace (the Bailian fields are None in a Mooncake one)."""

    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    block_tokens: int = TRACE_BLOCK_TOKENS  # tokens one hash id stands for in the source trace
    chat_id: int | None = None
    parent_chat_id: int | None = None  # -1: the first turn of a conversation
    kind: str | None = None  # Bailian's `type`
    turn: int | None = None

    @property
    def format(self) -> str:
        return "bailian" if self.chat_id is not None else "mooncake"


def _int(value: object, key: str, where: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise TraceFormatError(f"{where}: '{key}' must be a non-negative integer, got {value!r}")
    return value


def _number(value: object, key: str, where: str, unit: str) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0 or not math.isfinite(value):
        raise TraceFormatError(f"{where}: '{key}' must be a non-negative number of {unit}, got {value!r}")
    return float(value)


def parse_line(line: str, where: str) -> TraceRecord:
    """One JSONL line (Mooncake or Bailian) as a record; raises TraceFormatError naming `where` on any defect."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TraceFormatError(f"{where}: not JSON ({exc.msg})") from None
    if not isinstance(obj, dict):
        raise TraceFormatError(f"{where}: a trace line must be a JSON object")
    bailian = "chat_id" in obj
    required = ("chat_id", "parent_chat_id", "timestamp", "input_length", "output_length", "type", "turn",
                "hash_ids") if bailian else ("timestamp", "input_length", "output_length", "hash_ids")
    missing = [k for k in required if k not in obj]
    if missing:
        layout = "Bailian format: " if bailian else "Mooncake format: "
        raise TraceFormatError(f"{where}: missing {', '.join(missing)} ({layout}{', '.join(required)})")
    ids = obj["hash_ids"]
    if not isinstance(ids, list) or not ids:
        raise TraceFormatError(f"{where}: 'hash_ids' must be a non-empty list of integers")
    hash_ids = tuple(_int(h, "hash_ids", where) for h in ids)
    lengths = _int(obj["input_length"], "input_length", where), _int(obj["output_length"], "output_length", where)
    if not bailian:
        return TraceRecord(_number(obj["timestamp"], "timestamp", where, "ms"), *lengths, hash_ids)
    parent = obj["parent_chat_id"]
    if not isinstance(parent, int) or isinstance(parent, bool) or parent < -1:
        raise TraceFormatError(f"{where}: 'parent_chat_id' must be a chat_id or -1, got {parent!r}")
    if not isinstance(obj["type"], str):
        raise TraceFormatError(f"{where}: 'type' must be a string, got {obj['type']!r}")
    return TraceRecord(_number(obj["timestamp"], "timestamp", where, "seconds") * 1000, *lengths, hash_ids,
                       BAILIAN_BLOCK_TOKENS, _int(obj["chat_id"], "chat_id", where), parent, obj["type"],
                       _int(obj["turn"], "turn", where))


def load_trace(path: str | Path) -> list[TraceRecord]:
    """Every request of a Mooncake or Bailian JSONL file, in timestamp order (blank lines skipped)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise TraceFormatError(f"cannot read trace {path}: {exc.strerror or exc}") from None
    records = [parse_line(line, f"{path}:{n}") for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    if not records:
        raise TraceFormatError(f"{path}: no requests in the trace")
    formats = {r.format for r in records}
    if len(formats) > 1:
        first = next(n for n, r in enumerate(records, 1) if r.format != records[0].format)
        raise TraceFormatError(f"{path}: mixes the Mooncake and Bailian formats (request {first} differs from the first)")
    if records[0].format == "bailian":
        seen: set[int] = set()
        for n, r in enumerate(records, 1):
            if r.chat_id in seen:
                raise TraceFormatError(f"{path}: request {n} repeats chat_id {r.chat_id}")
            seen.add(r.chat_id)  # type: ignore[arg-type]
    records.sort(key=lambda r: r.timestamp_ms)  # stable: equal timestamps keep file order
    return records


def conversations(records: list[TraceRecord], common_share: float = COMMON_BLOCK_SHARE) -> list[int]:
    """A conversation number per request (see the module docstring for the rule)."""
    if records and records[0].chat_id is not None:
        return _chains(records)
    seen_in = Counter(h for r in records for h in set(r.hash_ids))
    common = {h for h, n in seen_in.items() if n >= common_share * len(records)}
    owner: dict[int, int] = {}  # chained prefix key -> conversation of its first request
    out: list[int] = []
    next_conv = 0
    for r in records:
        key = 0
        conv = None
        distinct = False
        for h in r.hash_ids:
            key = hash((key, h))
            distinct = distinct or h not in common
            if key not in owner:
                break
            if distinct:
                conv = owner[key]
        if conv is None:
            conv = next_conv
            next_conv += 1
        out.append(conv)
        key = 0
        for h in r.hash_ids:
            key = hash((key, h))
            owner.setdefault(key, conv)
    return out


def _chains(records: list[TraceRecord]) -> list[int]:
    """Bailian: a conversation per `parent_chat_id` chain, numbered in order of first appearance."""
    of_chat: dict[int, int] = {}
    out: list[int] = []
    started = 0
    for r in records:
        conv = of_chat.get(r.parent_chat_id) if r.parent_chat_id is not None and r.parent_chat_id >= 0 else None
        if conv is None:
            conv, started = started, started + 1
        of_chat[r.chat_id] = conv  # type: ignore[index]
        out.append(conv)
    return out


@lru_cache(maxsize=4)
def single_token_words(tokenizer_dir: str | None = None) -> tuple[str, ...]:
    """Words that the tokenizer reads as exactly one token each with a leading space, in id order."""
    tok: SimTokenizer = tokenizer(tokenizer_dir)
    words = []
    for tid in sorted(tok.tokenizer.get_vocab().values()):
        text = tok.tokenizer.decode([tid])
        if len(text) >= 3 and text[0] == " " and text[1:].isalpha() and text[1:].isascii():
            if tok.tokenizer.encode(text, add_special_tokens=False).ids == [tid]:
                words.append(text)
    if len(words) < 16:
        raise ValueError("the tokenizer has too few single-token words to build trace prompts")
    return tuple(words)


@dataclass(frozen=True)
class TraceReplay:
    """A Mooncake trace replayed at its own timestamps, shrunk to what the machine can drive."""

    path: str
    block_tokens: int = 64
    max_prompt_tokens: int = 8192
    max_output_tokens: int = 64
    speedup: float = 1.0
    start_s: float = 0.0
    window_s: float | None = None
    fraction: float = 1.0
    common_share: float = COMMON_BLOCK_SHARE  # blocks in this share of requests link no conversation
    seed: int = 46
    name: str = field(default="trace", init=False)

    def __post_init__(self) -> None:
        if self.block_tokens < 1 or self.max_prompt_tokens < 1 or self.max_output_tokens < 1:
            raise ValueError("block_tokens, max_prompt_tokens and max_output_tokens must be at least 1")
        if not self.speedup > 0:
            raise ValueError(f"speedup must be positive, got {self.speedup}")
        if not 0 < self.fraction <= 1:
            raise ValueError(f"fraction must be in (0, 1], got {self.fraction}")
        if self.start_s < 0 or (self.window_s is not None and self.window_s <= 0):
            raise ValueError("start_s must be >= 0 and window_s > 0")

    def selected(self) -> list[TraceRecord]:
        """The requests replayed: whole sampled conversations that start inside the window."""
        return [r for r, _ in _select(self)]

    def describe(self) -> str:
        sel = self.selected()
        span = (sel[-1].timestamp_ms - sel[0].timestamp_ms) / 1000 if sel else 0.0
        window = f"{self.window_s:g}s" if self.window_s is not None else "the rest"
        source = sel[0].block_tokens if sel else TRACE_BLOCK_TOKENS
        return (f"{sel[0].format if sel else 'empty'} trace {Path(self.path).name}: {len(sel)} requests "
                f"({self.fraction:.0%} of the conversations starting in {window} from {self.start_s:g}s), {span:.0f} "
                f"trace seconds at speedup {self.speedup:g}; {self.block_tokens} tokens per hash block ({source} in the "
                f"trace), prompts capped at {self.max_prompt_tokens}, outputs scaled by {self.block_tokens}/{source} "
                f"and capped at {self.max_output_tokens}")

    def duration_s(self) -> float:
        """Wall seconds from the first request to the last."""
        sel = self.selected()
        return (sel[-1].timestamp_ms - sel[0].timestamp_ms) / 1000 / self.speedup if sel else 0.0

    def prompt_tokens(self, r: TraceRecord) -> int:
        """The replayed prompt length of a record (scaled, capped, at least one token)."""
        full = (len(r.hash_ids) - 1) * r.block_tokens
        last = max(1, r.input_length - full) if r.input_length > full else r.block_tokens
        scaled = (len(r.hash_ids) - 1) * self.block_tokens + math.ceil(last * self.block_tokens / r.block_tokens)
        return max(1, min(scaled, self.max_prompt_tokens))

    def output_tokens(self, r: TraceRecord) -> int:
        """The replayed output length (scaled like the prompt, capped, at least one token)."""
        return max(1, min(math.ceil(r.output_length * self.block_tokens / r.block_tokens),
                          self.max_output_tokens))

    def mean_prompt_tokens(self) -> int:
        sel = self.selected()
        return sum(self.prompt_tokens(r) for r in sel) // max(len(sel), 1)

    def requests(self, tokenizer_dir: str | None = None) -> Iterator[BenchRequest]:
        words = single_token_words(tokenizer_dir)
        sel = _select(self)
        t0 = sel[0][0].timestamp_ms
        texts: dict[int, list[str]] = {}
        for r, conv in sel:
            n = self.prompt_tokens(r)
            parts: list[str] = []
            for h in r.hash_ids:
                if n <= 0:
                    break
                block = texts.get(h)
                if block is None:
                    rng = random.Random(f"{self.seed}:{h}")
                    block = texts[h] = [rng.choice(words) for _ in range(self.block_tokens)]
                parts.extend(block[:n])
                n -= self.block_tokens
            yield completion_request("".join(parts), self.output_tokens(r), f"conv-{conv}",
                                     at=(r.timestamp_ms - t0) / 1000 / self.speedup)


@lru_cache(maxsize=2)
def _records(path: str) -> list[TraceRecord]:
    return load_trace(path)


@lru_cache(maxsize=8)
def _select(t: TraceReplay) -> list[tuple[TraceRecord, int]]:
    records = _records(t.path)
    convs = conversations(records, t.common_share)
    base = records[0].timestamp_ms + t.start_s * 1000
    end = base + t.window_s * 1000 if t.window_s is not None else math.inf
    first_seen: dict[int, float] = {}
    for r, c in zip(records, convs):
        first_seen.setdefault(c, r.timestamp_ms)
    starting = sorted({c for c, ts in first_seen.items() if base <= ts < end})
    rng = random.Random(t.seed)
    keep = {c for c in starting if rng.random() < t.fraction}
    selected = [(r, c) for r, c in zip(records, convs) if c in keep]
    if not selected:
        raise ValueError(f"no conversation of {t.path} starts in the window ({t.start_s:g}s, "
                         f"{t.window_s if t.window_s is not None else 'rest'}) at fraction {t.fraction:g}")
    return selected


__all__ = ["BAILIAN_BLOCK_TOKENS", "TRACE_BLOCK_TOKENS", "TraceFormatError", "TraceRecord", "TraceReplay", "conversations", "load_trace",
           "parse_line", "single_token_words"]
