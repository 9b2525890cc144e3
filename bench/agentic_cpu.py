"""The picker's CPU at agentic sizes, through Envoy, against 100 endpoints; and llm-d's published conditions.

llm-d's operations guide budgets its router at 0.5-1 core per request/s of 100k-token agentic traffic
(100 pods, ~99 req/s took 35-46 cores, llm-d-sim, Qwen3-8B, 1k tokens out) and about 5 cores for
500 req/s of 200-token prompts. This measures ours the same way as far as one 2-core machine goes:

- 100 simulated replicas (`epp sim`'s fleet, the fast latency profile, KV events on: the precise
  pipeline's index is fed by real events) behind Envoy, our picker as its ext_proc (`epp serve`, one
  process; `--responses full`, the default deployment, streams every answer's chunks through the
  picker, `--responses first-token` each answer up to its first token: docs/response-modes.md);
- **agentic**: `--conversations` coding-agent conversations around `--context` tokens (an agent
  kind's prefix of 10-18k tokens shared by its conversations, then a history, 0.8-1.2x `--context`
  in all; each turn adds the model's reply and a tool result from the agentic generator's
  full-scale distributions; past 1.6x `--context` a conversation compacts: its next turn is the
  prefix, a summary and the tool result), `--output-tokens` out (llm-d's 1k); each conversation's
  first turn is sent before the clock starts (the steady state of agentic traffic is continuation
  turns: a cold 100k prompt is rare, contexts grow a turn at a time), then turns go open loop
  (Poisson) at each rate of `--rates`, a conversation's next turn only after its previous one has
  been answered;
- **short**: unique `--short-tokens`-token prompts (llm-d's 200) at `--short-rates`;
- per pipeline and traffic, two phases. **Fixed**: the picker as deployed (scraping every 50 ms),
  nothing routed, `--seconds`: what it burns at 100 endpoints for nothing (scraping, the event
  subscriptions). **Per turn**: the same pipeline scraping every `--quiet-scrape` seconds (2), warmed
  up, then idle, rate, idle, rate, ..., idle steps of `--seconds`: the scraping cost drifts with how
  fast 100 loaded replicas answer (0.14 to 0.36 cores in one smoke run), far more than a few turns
  a second cost, so it is kept out of the difference between loaded and idle steps. Per step: the
  picker's CPU (its process, from /proc), Envoy's, the fleet's and this load generator's; TTFT at the
  client; a rate holds when every turn was answered, an idle conversation was there for every
  arrival and the client kept its schedule (sent within 100 ms, p99).

**From what one machine sustains to llm-d's conditions.** Two cores cannot offer 100 turns a second
of 100k tokens (the simulated replicas alone tokenize each prompt). So the picker's CPU per turn is
the slope of its cores against the rate (least squares over the steps that held and the idle
ones; each rate's own figure against the idle steps beside it is shown too), and llm-d's
conditions are read off `cores(R) = fixed + R x per_turn`: at 99 turns/s and at 500 requests/s.
That assumes (1) the cost per turn stays what it is at a few turns a second (no batching gains, no
contention losses: the picker is one asyncio process; past about one core a deployment runs
`--workers N` or several pods, which repeat the fixed part per process unless scraping is shared),
(2) llm-d's traffic shape: continuation turns of conversations the picker has seen (a cold 100k
prompt costs more: it is tokenized whole), (3) Envoy's CPU is not the picker's (llm-d counts its
EPP pods only; Envoy's is reported beside), (4) routing on metrics 2 s old costs what routing on
50-ms-old ones does (the scorers read the same fields). Routed turns per picker CPU-second are
given both ways: all-in at the highest rate held (scraping slowed) and marginal (1 / per_turn).

    python bench/agentic_cpu.py --pipelines epp-precise,epp-approx --rates 1,2,4 --seconds 30 \\
        --short-rates 25,50,100 --responses first-token --out bench/results/agentic-cpu
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.agentic.contenders import known_names, resolve  # noqa: E402
from bench.agentic.replay import PromptBuilder, turn_request  # noqa: E402
from bench.agentic.workload import AGENT_KINDS, PRESETS, AgentKind, Segment  # noqa: E402
from bench.routing.contenders import RunningRouter, Tuning, start_contender  # noqa: E402
from bench.routing.loadgen import RequestRecord, send  # noqa: E402
from bench.routing.measure import process_cpu_seconds  # noqa: E402
from epp.engine.sim.fleet import FleetConfig, SimFleet, default_tokenizer_dir  # noqa: E402
from epp.envoy import RESPONSE_MODES  # noqa: E402

# llm-d docs/operations.md: ~99 turns/s of 100k-token agentic traffic against 100 pods took 35-46 cores; 500 req/s of
# 200-token prompts about 5.
LLMD_AGENTIC: dict[str, Any] = {"turns_per_s": 99, "cores": (35, 46), "pods": 100}
LLMD_SHORT: dict[str, Any] = {"requests_per_s": 500, "cores": 5, "prompt_tokens": 200}


@dataclass
class Conversation:
    """One agent conversation: its kind, its segments so far, its session id."""

    session_id: str
    kind: AgentKind
    segments: list[Segment]
    busy: bool = False
    turns: int = 0
    replica: str | None = None  # the replica that served its last turn

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.segments)


class Conversations:
    """Agentic conversations around `context` tokens (see the module docstring), seeded."""

    def __init__(self, count: int, context: int, seed: int) -> None:
        self.context, self.rng, self.serial = context, random.Random(seed), 0
        self.params = PRESETS["full"]
        self.items = [self._new() for _ in range(count)]
        self.next = 0

    def _new(self) -> Conversation:
        kind = self.rng.choices(list(AGENT_KINDS), weights=[k.share for k in AGENT_KINDS])[0]
        sid = f"cpu{self.serial:05d}-{kind.name}"
        self.serial += 1
        start = round(self.context * self.rng.uniform(0.8, 1.2))  # the conversations' contexts spread around it
        history = Segment(f"{sid}:history", max(1, start - kind.prefix_tokens), "task")
        return Conversation(sid, kind, [Segment(f"prefix:{kind.name}", kind.prefix_tokens, "prefix"), history])

    def grow(self, c: Conversation) -> Conversation:
        """The conversation's next turn: the reply and a tool result appended; past 1.6x the context it compacts
        (the next turn is the prefix, a summary and the tool result, as an agent's after its compaction)."""
        p = self.params
        reply = Segment(f"{c.session_id}:{c.turns}:reply", p.reply_tokens.tokens(self.rng), "reply")
        tool = Segment(f"{c.session_id}:{c.turns}:tool", p.tool_tokens.tokens(self.rng), "tool")
        c.segments += [reply, tool]
        if c.tokens > self.context * 1.6:
            summary = Segment(f"{c.session_id}:{c.turns}:summary", p.summary_tokens.tokens(self.rng), "summary")
            c.segments = [c.segments[0], summary, tool]
        c.turns += 1
        return c

    def pick(self) -> Conversation | None:
        """The next idle conversation in turn (None: all are waiting for an answer)."""
        for _ in range(len(self.items)):
            c = self.items[self.next % len(self.items)]
            self.next += 1
            if not c.busy:
                return c
        return None


@dataclass
class Step:
    """What one rate measured."""

    rate: float
    seconds: float
    sent: int = 0
    answered: int = 0
    skipped: int = 0  # arrivals with every conversation still waiting for its previous answer
    errors: dict[str, int] = field(default_factory=dict)
    ttft: list[float] = field(default_factory=list)
    prompt_tokens: list[int] = field(default_factory=list)
    cached_tokens: int = 0  # of the answered turns' prompts, what the replica had cached
    moved: int = 0  # turns a replica other than their conversation's last one served
    cpu_s: dict[str, float] = field(default_factory=dict)
    late_ms_p99: float = 0.0

    def row(self) -> dict[str, Any]:
        q = statistics.quantiles(self.ttft, n=100) if len(self.ttft) >= 2 else [float("nan")] * 99
        per = max(self.answered, 1)
        return {"rate": self.rate, "seconds": self.seconds, "sent": self.sent, "answered": self.answered,
                "skipped": self.skipped, "errors": self.errors,
                "mean_prompt_tokens": statistics.fmean(self.prompt_tokens) if self.prompt_tokens else 0,
                "hit_rate": self.cached_tokens / sum(self.prompt_tokens) if sum(self.prompt_tokens) else None,
                "moved": self.moved,
                "ttft_p50_ms": q[49] * 1e3, "ttft_p99_ms": q[98] * 1e3, "client_late_p99_ms": self.late_ms_p99,
                "cores": {k: v / self.seconds for k, v in self.cpu_s.items()},
                "picker_ms_per_turn": self.cpu_s.get("picker", 0.0) / per * 1e3 if self.answered else None,
                "envoy_ms_per_turn": self.cpu_s.get("envoy", 0.0) / per * 1e3 if self.answered else None,
                "held": not self.why_not_held(), "why_not_held": self.why_not_held()}

    def why_not_held(self) -> str:
        """Why the rate did not hold ('' when it did): unanswered turns, no idle conversation, a late client."""
        why = []
        if self.answered < self.sent or self.errors:
            why.append(f"{self.sent - self.answered} unanswered")
        if self.skipped:
            why.append(f"{self.skipped} arrivals found every conversation waiting")
        if self.late_ms_p99 >= 100:
            why.append(f"the client sent {self.late_ms_p99:.0f} ms late (p99)")
        return "; ".join(why)


def cpu_now(groups: dict[str, list[int]]) -> dict[str, float]:
    """CPU seconds so far of each group of processes."""
    out = {}
    for name, pids in groups.items():
        total = 0.0
        for pid in pids:
            try:
                total += process_cpu_seconds(pid)
            except OSError:
                continue
        out[name] = total
    return out


async def run_step(http: aiohttp.ClientSession, url: str, rate: float, seconds: float, next_turn: Any,
                   groups: dict[str, list[int]], seed: int, timeout: float) -> Step:
    """Open-loop Poisson arrivals at `rate` for `seconds`; CPU of every group over the step."""
    step = Step(rate, seconds)
    rng = random.Random(seed)
    late: list[float] = []
    tasks: set[asyncio.Task[None]] = set()
    before = cpu_now(groups)
    t0 = time.perf_counter()
    if rate > 0:
        at = rng.expovariate(rate)
        while at < seconds:
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            late.append(max(0.0, -delay) * 1e3)
            item = next_turn()
            if item is None:
                step.skipped += 1
            else:
                req, headers, done = item
                rec = RequestRecord(stage=0, group="", sent=0.0)
                step.sent += 1

                async def one(req: Any = req, headers: Any = headers, rec: RequestRecord = rec, done: Any = done) -> None:
                    await send(http, url, req, rec, timeout, headers)
                    step.moved += done(rec)
                    if rec.ok:
                        step.answered += 1
                        step.ttft.append(rec.ttft or 0.0)
                        step.prompt_tokens.append(rec.prompt_tokens or 0)
                        step.cached_tokens += rec.cached_tokens or 0
                    else:
                        step.errors[rec.error or "?"] = step.errors.get(rec.error or "?", 0) + 1

                task = asyncio.ensure_future(one())
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            at += rng.expovariate(rate)
    await asyncio.sleep(max(0.0, t0 + seconds - time.perf_counter()))
    if tasks:
        await asyncio.wait(set(tasks), timeout=timeout)
    after = cpu_now(groups)
    step.seconds = time.perf_counter() - t0
    step.cpu_s = {k: after[k] - before[k] for k in after}
    step.late_ms_p99 = statistics.quantiles(late, n=100)[98] if len(late) >= 2 else 0.0
    return step


def fit(rows: list[dict[str, Any]]) -> dict[str, float] | None:
    """Least squares of picker cores on the turns answered a second (the steps that held, and idle): idle cores,
    CPU seconds per turn. The answered rate, not the offered one: Poisson arrivals over a short step vary."""
    points = [(r["answered"] / r["seconds"], r["cores"]["picker"]) for r in rows if r["rate"] == 0 or r["held"]]
    if len({x for x, _ in points}) < 2:
        return None
    mx, my = statistics.fmean(x for x, _ in points), statistics.fmean(y for _, y in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    return {"idle_cores": my - slope * mx, "cpu_s_per_turn": slope}


class Condition:
    """A kind of traffic: how the next request is made."""

    def __init__(self, name: str, output_tokens: int, seed: int, *, conversations: int = 0, context: int = 0,
                 short_tokens: int = 0, tokenizer_dir: str | None = None) -> None:
        self.name, self.output_tokens = name, output_tokens
        self.prompts = PromptBuilder(seed, tokenizer_dir)
        self.convs = Conversations(conversations, context, seed) if conversations else None
        self.short_tokens, self.serial = short_tokens, 0

    def first_turns(self) -> list[tuple[Any, dict[str, str], Any]]:
        """Every conversation's first turn (the warm-up: one token out, its cost is not measured)."""
        out = []
        if self.convs is not None:
            for c in list(self.convs.items):
                out.append(self._turn(c, 1))
        return out

    def _turn(self, c: Conversation, output_tokens: int | None = None) -> tuple[Any, dict[str, str], Any]:
        c.busy = True
        req = turn_request(self.prompts.prompt(hash(c.session_id), tuple(c.segments)),
                           output_tokens or self.output_tokens, c.session_id)

        def done(rec: RequestRecord) -> bool:
            """The turn is answered: the conversation grows; True if another replica than its last one served it."""
            c.busy = False
            assert self.convs is not None
            self.convs.grow(c)
            moved = c.replica is not None and rec.replica is not None and rec.replica != c.replica
            c.replica = rec.replica or c.replica
            return moved

        return req, {c.kind.header: c.session_id}, done

    def homes(self) -> dict[str, int]:
        """How many conversations each replica served last (where their contexts are)."""
        out: dict[str, int] = {}
        for c in self.convs.items if self.convs is not None else ():
            if c.replica is not None:
                out[c.replica] = out.get(c.replica, 0) + 1
        return out

    def next_turn(self) -> tuple[Any, dict[str, str], Any] | None:
        if self.convs is None:
            self.serial += 1
            seg = Segment(f"short{self.serial}", self.short_tokens, "task")
            return turn_request(self.prompts.prompt(-1, (seg,)), self.output_tokens, "short"), {}, lambda _: False
        c = self.convs.pick()
        return None if c is None else self._turn(c)


def _groups(router: RunningRouter, fleet: SimFleet) -> dict[str, list[int]]:
    """The processes whose CPU each step reads: the picker, Envoy, the fleet, this load generator."""
    picker = [p for p in router.pids if "envoy" not in Path(f"/proc/{p}/cmdline").read_text(errors="replace")]
    return {"picker": picker, "envoy": [p for p in router.pids if p not in picker],
            "fleet": [p.pid for p in fleet._procs], "client": [os.getpid()]}


def _print(pipeline: str, cond: str, row: dict[str, Any]) -> None:
    print(f"  {pipeline} {cond} {row['rate']:g}/s: {row['answered']}/{row['sent']} answered, picker "
          f"{row['cores']['picker']:.3f} cores ({_ms(row['picker_ms_per_turn'])} ms/turn), envoy "
          f"{row['cores']['envoy']:.2f}, fleet {row['cores']['fleet']:.2f}, client {row['cores']['client']:.2f}; "
          f"TTFT p50 {row['ttft_p50_ms']:.0f} ms; moved {row['moved']}, hit {_pct(row['hit_rate'])}; "
          f"{'held' if row['held'] else row['why_not_held']}", flush=True)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f} %"


async def measure(args: argparse.Namespace, pipeline: str, cond: Condition, rates: list[float],
                  fleet: SimFleet, tuning: Tuning, workdir: Path) -> dict[str, Any]:
    """One pipeline under one condition: its fixed cost as deployed, then its cost per turn (the module docstring)."""
    contender = resolve(pipeline)
    assert contender is not None
    contender = replace(contender, responses=args.responses)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
    # 1. The fixed part: the deployment as it is (scraping every 50 ms), nothing routed.
    router: RunningRouter = await start_contender(contender, fleet, tuning, workdir / f"{pipeline}-{cond.name}-idle")
    try:
        async with aiohttp.ClientSession(timeout=timeout) as http:
            fixed = (await run_step(http, router.base_url, 0.0, args.seconds, cond.next_turn, _groups(router, fleet),
                                    args.seed, args.timeout)).row()
        print(f"  {pipeline} {cond.name}: idle as deployed, picker {fixed['cores']['picker']:.3f} cores", flush=True)
    finally:
        await router.stop()
    # 2. The cost per turn: the same pipeline scraping every `--quiet-scrape` seconds, so that the scraping (which
    # drifts with how fast 100 loaded replicas answer) stays out of the difference between loaded and idle steps.
    quiet = replace(contender, serve_args=(*contender.serve_args, "--refresh-metrics-interval", f"{args.quiet_scrape:g}"))
    router = await start_contender(quiet, fleet, tuning, workdir / f"{pipeline}-{cond.name}")
    rows: list[dict[str, Any]] = []
    homes: dict[str, int] = {}
    try:
        groups = _groups(router, fleet)
        async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as http:
            warm = cond.first_turns()
            if warm:
                print(f"  warm-up: {len(warm)} first turns", flush=True)
                sem = asyncio.Semaphore(4)

                async def first(item: Any) -> None:
                    async with sem:
                        rec = RequestRecord(stage=0, group="", sent=0.0)
                        await send(http, router.base_url, item[0], rec, args.timeout, item[1])
                        item[2](rec)

                await asyncio.gather(*(first(w) for w in warm))
                homes = cond.homes()
                if homes:  # where the warm-up put the conversations: stacked ones evict each other every turn
                    print(f"  warm-up: {sum(homes.values())} conversations on {len(homes)} replicas, at most "
                          f"{max(homes.values())} on one", flush=True)
            warmed = await picker_counters(http, router.metrics_url)
            # An idle step before each rate and after the last: each rate's cost is read against the idle
            # steps on either side of it.
            schedule = [x for rate in rates for x in (0.0, rate)] + [0.0]
            for i, rate in enumerate(schedule):
                step = await run_step(http, router.base_url, rate, args.seconds, cond.next_turn, groups, args.seed + i,
                                      args.timeout)
                rows.append(step.row())
                _print(pipeline, cond.name, rows[-1])
            after = await picker_counters(http, router.metrics_url)
    finally:
        await router.stop()
    marginal(rows)
    # The measured steps' own counts (the warm-up's first turns taken out).
    counters = {k: v - warmed.get(k, 0.0) for k, v in after.items()}
    if counters:
        print(f"  {pipeline} {cond.name}, the measured steps: {counters}", flush=True)
    return {"pipeline": pipeline, "condition": cond.name, "fixed": fixed, "rows": rows, "fit": fit(rows),
            "counters": counters, "homes": homes}


# What the picker's own counters say of its caches at the end (why a turn cost what it did).
_COUNTERS = ("epp_tokenization_cache_lookups_total", "epp_tokenization_requests_total",
             "epp_tokenization_cache_store_evictions_total", "epp_kv_key_cache_lookups_total",
             "epp_kv_key_cache_store_evictions_total", "epp_kv_index_events_applied_total",
             "epp_kv_match_memo_lookups_total", "epp_extproc_messages_total", "epp_session_routing_decisions_total",
             "epp_kv_events_messages_total", "epp_kv_index_events_dropped_total")


async def picker_counters(http: aiohttp.ClientSession, url: str | None) -> dict[str, float]:
    """The samples of `_COUNTERS` on the picker's metrics page (empty when it cannot be read)."""
    if not url:
        return {}
    try:
        async with http.get(url, timeout=aiohttp.ClientTimeout(total=10)) as resp:
            text = await resp.text()
    except (TimeoutError, aiohttp.ClientError):
        return {}
    out = {}
    for line in text.splitlines():
        if line.startswith(_COUNTERS):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def marginal(rows: list[dict[str, Any]]) -> None:
    """Each loaded step's picker CPU per turn beyond the mean of the idle steps next to it (`marginal_ms_per_turn`)."""
    for i, row in enumerate(rows):
        if row["rate"] == 0 or not row["answered"]:
            continue
        idle = [r["cores"]["picker"] for r in (rows[i - 1] if i else None, rows[i + 1] if i + 1 < len(rows) else None)
                if r is not None and r["rate"] == 0]
        if idle:
            extra = (row["cores"]["picker"] - statistics.fmean(idle)) * row["seconds"]
            row["idle_cores_around"] = statistics.fmean(idle)
            row["marginal_ms_per_turn"] = extra / row["answered"] * 1e3


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def summary(result: dict[str, Any]) -> dict[str, Any]:
    """Turns per picker CPU-second (all-in at the highest rate held, and marginal) and llm-d's conditions."""
    held = [r for r in result["rows"] if r["rate"] > 0 and r["held"]]
    top = max(held, key=lambda r: r["rate"]) if held else None
    f = result["fit"]
    out: dict[str, Any] = {"highest_rate_held": top["rate"] if top else None,
                           "all_in_turns_per_cpu_s": (top["answered"] / max(top["cores"]["picker"] * top["seconds"], 1e-9))
                           if top else None}
    out["fixed_cores"] = result["fixed"]["cores"]["picker"]
    if f:
        out["quiet_idle_cores"] = f["idle_cores"]
        out["picker_ms_per_turn_marginal"] = f["cpu_s_per_turn"] * 1e3
        out["marginal_turns_per_cpu_s"] = 1 / f["cpu_s_per_turn"] if f["cpu_s_per_turn"] > 0 else None
        rate = LLMD_AGENTIC["turns_per_s"] if result["condition"] == "agentic" else LLMD_SHORT["requests_per_s"]
        out["cores_at_llmd_rate"] = out["fixed_cores"] + rate * f["cpu_s_per_turn"]
        out["llmd_rate"] = rate
    return out


def report(results: list[dict[str, Any]], args: argparse.Namespace, out: Path) -> Path:
    """report.md and results.json."""
    out.mkdir(parents=True, exist_ok=True)
    for r in results:
        r["summary"] = summary(r)
    doc = {"command": " ".join(sys.argv), "args": {k: v for k, v in vars(args).items() if k != "out"},
           "started": args.started, "llmd": {"agentic": LLMD_AGENTIC, "short": LLMD_SHORT}, "results": results}
    (out / "results.json").write_text(json.dumps(doc, indent=1, default=str))
    lines = ["# The picker's CPU at agentic sizes (100 endpoints, through Envoy)", "",
             f"Command: `{doc['command']}`  ", f"Started: {args.started}", "",
             f"{args.endpoints} simulated replicas (fast profile, KV events), `epp serve` (one process) behind Envoy "
             f"(`epp envoy-config --responses {args.responses}`). "
             f"Agentic: {args.conversations} conversations around {args.context:,} tokens, {args.output_tokens} tokens "
             f"out; short: {args.short_tokens}-token unique prompts, {args.short_output_tokens} out. {args.seconds:g} s "
             "a step.", "", "## Steps", "",
             "| pipeline | traffic | rate (/s) | answered / sent | prompt tokens (mean) | hit rate | turns moved | "
             "TTFT p50 / p99 (ms) | picker cores | picker ms/turn, all-in / beyond idle | Envoy cores | fleet cores | "
             "client cores | held |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        for row in r["rows"]:
            c = row["cores"]
            lines.append(f"| {r['pipeline']} | {r['condition']} | {row['rate']:g} | {row['answered']} / {row['sent']} | "
                         f"{row['mean_prompt_tokens']:,.0f} | {_pct(row.get('hit_rate'))} | {row.get('moved', '-')} | "
                         f"{row['ttft_p50_ms']:.0f} / {row['ttft_p99_ms']:.0f} | "
                         f"{c['picker']:.3f} | {_ms(row['picker_ms_per_turn'])} / {_ms(row.get('marginal_ms_per_turn'))} | "
                         f"{c['envoy']:.3f} | {c['fleet']:.2f} | {c['client']:.2f} | "
                         f"{'yes' if row['held'] else 'no: ' + row['why_not_held']} |")
    lines += ["", "## Against llm-d's published core counts", "",
              "CPU per turn: the slope of picker cores against the rate over the steps that held and the idle ones "
              f"(scraping every {args.quiet_scrape:g} s). Fixed: the picker as deployed (scraping every 50 ms), "
              "nothing routed. Cores at llm-d's rate: fixed + rate x CPU per turn (the module docstring says what that "
              "assumes). All-in: turns over the picker's CPU at the highest rate held, scraping slowed.", "",
              "| pipeline | traffic | highest rate held | turns per picker CPU-s, all-in there | ms per turn | "
              "turns per CPU-s (marginal) | fixed cores as deployed | cores at llm-d's rate | llm-d's cores |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        s = r["summary"]
        llmd = f"{LLMD_AGENTIC['cores'][0]}-{LLMD_AGENTIC['cores'][1]} at ~{LLMD_AGENTIC['turns_per_s']}/s" \
            if r["condition"] == "agentic" else f"~{LLMD_SHORT['cores']} at {LLMD_SHORT['requests_per_s']}/s"
        lines.append(f"| {r['pipeline']} | {r['condition']} | {s.get('highest_rate_held') or '-'} | "
                     f"{_f(s.get('all_in_turns_per_cpu_s'))} | {_f(s.get('picker_ms_per_turn_marginal'))} | "
                     f"{_f(s.get('marginal_turns_per_cpu_s'))} | {_f(s.get('fixed_cores'), 3)} | "
                     f"{_f(s.get('cores_at_llmd_rate'))} at {s.get('llmd_rate', '-')}/s | {llmd} |")
    lines += ["", "## Where the warm-up put the conversations; the picker's caches over the measured steps (the warm-up "
              "taken out)", ""]
    for r in results:
        shown = ", ".join(f"`{k}` {v:g}" for k, v in r.get("counters", {}).items()) or "none read"
        homes = r.get("homes") or {}
        placed = (f"the warm-up's {sum(homes.values())} conversations on {len(homes)} replicas, at most "
                  f"{max(homes.values())} on one; " if homes else "")
        lines.append(f"- {r['pipeline']} {r['condition']}: {placed}{shown}")
    (out / "report.md").write_text("\n".join(lines) + "\n")
    return out / "report.md"


def _f(v: float | None, digits: int = 1) -> str:
    return "-" if v is None else f"{v:,.{digits}f}"


async def main_async(args: argparse.Namespace) -> list[dict[str, Any]]:
    tok = default_tokenizer_dir()
    fleet = SimFleet(FleetConfig(replicas=args.endpoints, profile="fast", num_gpu_blocks=args.blocks, processes=2,
                                 max_model_len=args.max_model_len, max_num_batched_tokens=8192), tokenizer_dir=tok)
    await fleet.start()
    tuning = Tuning(tokenizer_dir=tok, block_size=16, prefill_s_per_token=2e-6, mean_prompt_tokens=args.context)
    results = []
    try:
        for pipeline in args.pipelines.split(","):
            if args.rates:
                cond = Condition("agentic", args.output_tokens, args.seed, conversations=args.conversations,
                                 context=args.context, tokenizer_dir=tok)
                results.append(await measure(args, pipeline, cond, args.rates, fleet, tuning, args.out / "logs"))
            if args.short_rates:
                cond = Condition("short", args.short_output_tokens, args.seed, short_tokens=args.short_tokens,
                                 tokenizer_dir=tok)
                results.append(await measure(args, pipeline, cond, args.short_rates, fleet, tuning, args.out / "logs"))
    finally:
        await fleet.stop()
    return results


def main() -> int:
    """Entry point."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pipelines", default="epp-precise,epp-approx",
                   help="epp contenders (`python -m bench.agentic list`)")
    p.add_argument("--endpoints", type=int, default=100)
    p.add_argument("--rates", default="1,2,4", type=lambda s: [float(x) for x in s.split(",") if x],
                   help="agentic turns a second ('' to skip)")
    p.add_argument("--short-rates", default="25,50,100", type=lambda s: [float(x) for x in s.split(",") if x],
                   help="short requests a second ('' to skip)")
    p.add_argument("--seconds", type=float, default=30.0, help="seconds a step")
    p.add_argument("--conversations", type=int, default=100)
    p.add_argument("--context", type=int, default=100_000, help="tokens a conversation is kept around")
    p.add_argument("--output-tokens", type=int, default=1000, help="agentic tokens out (llm-d's 1k)")
    p.add_argument("--short-tokens", type=int, default=200)
    p.add_argument("--short-output-tokens", type=int, default=100)
    p.add_argument("--blocks", type=int, default=16384, help="KV blocks of 16 tokens per replica")
    p.add_argument("--max-model-len", type=int, default=262_144)
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--quiet-scrape", type=float, default=2.0,
                   help="the picker's scrape interval (s) while the cost per turn is measured")
    p.add_argument("--responses", choices=RESPONSE_MODES, default="full",
                   help="how much of each response Envoy shows the picker (`epp envoy-config --responses`): full "
                        "(every streamed chunk crosses gRPC), first-token (each answer up to its first token)")
    p.add_argument("--seed", type=int, default=43)
    p.add_argument("--out", type=Path, default=Path("/tmp/epp-agentic-cpu"))
    args = p.parse_args()
    unknown = [n for n in args.pipelines.split(",") if n not in known_names() or not n.startswith("epp-")]
    if unknown:
        p.error(f"unknown pipelines {unknown}")
    args.started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    results = asyncio.run(main_async(args))
    print(f"report: {report(results, args, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
