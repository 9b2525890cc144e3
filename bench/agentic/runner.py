"""Run the agentic replay through each contender: a fresh fleet (or a given one), the router, the replay,
the replicas' counters and the router's CPU around it, and the numbers of bench/agentic/metrics.py.

Scenarios (`scenario`): a load (`light`, `knee`) at a scale:

- `small`: 8 simulated replicas of the `h100-llama3-8b` profile slowed 5x (`time_scale`), 1,100 GPU
  blocks of 16 tokens each (17,600 tokens: a session's longest prompt fits one replica) and a CPU
  offload tier of 2,200 blocks (the simulator's `cpu_blocks`: a prefix evicted from the GPU is
  loaded back at 5.2 us a token, not recomputed); the generator's `small` preset (token scale
  0.075: prefixes of 1,350 / 900 / 750 tokens, a 12,000-token context limit). Pauses: tool pauses at
  1 wall second per agent second, human pauses at 0.05 (45 s -> 2.25 s). `light`: 30 sessions
  starting 0.15 a second (about 8 running at once: their contexts fit the fleet's GPU tier);
  `knee`: 60 sessions at 0.6 a second (about 40 at once: their contexts are ~1.5x the GPU tier, so
  turns miss and re-prefill; the prefill work offered stays a small share of the fleet's capacity
  when every turn hits). The knee's definition (the best peer's TTFT p90 3-10x its light value) is
  checked by `python -m bench.agentic sweep` and stated in the combined report (`--light-results`).
- `tiny`: 4 replicas of the fast profile in this process, the `tiny` preset (CI and smoke runs).

A Bailian trace (`trace=PATH`) replaces the generated sessions by the trace's chains
(bench/agentic/bailian.py) on the same fleet.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp

from bench.agentic.bailian import bailian_sessions
from bench.agentic.contenders import ALIASES, refusal, resolve, validity, with_cpu_tier
from bench.agentic.metrics import TurnCost, ideal_seconds, new_tokens, samples, session_metrics
from bench.agentic.replay import PauseScale, ReplayResult, replay
from bench.agentic.workload import PRESETS, SessionPlan, generate, summarize_plans
from bench.routing.contenders import RunningRouter, Tuning, Unavailable, start_contender
from bench.routing.measure import CpuMeter, scrape_fleet
from bench.routing.objectives import DEFAULT_TTFT_OBJECTIVE_MS
from bench.routing.runner import fleet_tuning
from bench.routing.summary import ContenderResult, summarize
from bench.routing.traces import TraceReplay
from epp.engine.sim.fleet import FleetConfig, SimFleet
from epp.engine.sim.profiles import get_profile

SCALES = ("tiny", "small")
LOADS = ("light", "knee")
# Per scale: the fleet, the preset, the pause scales and per load (sessions, sessions started a second).
SCALE_SETTINGS: dict[str, dict[str, Any]] = {
    "tiny": {"fleet": FleetConfig(replicas=4, profile="fast", num_gpu_blocks=160, cpu_blocks=320, processes=0,
                                  max_model_len=2048),
             "preset": "tiny", "pauses": PauseScale(tool=0.05, human=0.005, trace=0.05),
             "loads": {"light": (8, 4.0), "knee": (16, 16.0)}, "deadline_s": 120.0, "request_timeout": 60.0},
    "small": {"fleet": FleetConfig(replicas=8, profile="h100-llama3-8b", time_scale=5.0, num_gpu_blocks=1100,
                                   cpu_blocks=2200, processes=2, max_model_len=16384, max_num_batched_tokens=8192),
              "preset": "small", "pauses": PauseScale(tool=1.0, human=0.05, trace=1.0),
              "loads": {"light": (30, 0.15), "knee": (60, 0.6)}, "deadline_s": 1500.0, "request_timeout": 600.0},
}


@dataclass
class AgenticScenario:
    """Everything a run needs besides the contenders."""

    name: str
    scale: str
    plans: list[SessionPlan]
    workload: dict[str, Any]  # the generator's parameters (seeds included) or the trace's knobs
    fleet: FleetConfig
    pauses: PauseScale
    deadline_s: float
    request_timeout: float = 600.0
    ttft_objective_ms: float = DEFAULT_TTFT_OBJECTIVE_MS
    text_seed: int = 2026
    notes: list[str] = field(default_factory=list)

    @property
    def block_size(self) -> int:
        return int(self.fleet.block_size or get_profile(self.fleet.profile).block_size)

    @property
    def cpu_tier_tokens(self) -> int:
        return int(self.fleet.cpu_blocks) * self.block_size

    def cost(self) -> TurnCost:
        """What a turn costs alone on one replica of the fleet (the ideal of the slowdowns)."""
        p = get_profile(self.fleet.profile)
        return TurnCost.from_profile(p, self.fleet.time_scale, self.fleet.max_num_batched_tokens)

    def describe(self) -> str:
        return summarize_plans(self.plans).describe()


def scenario(load: str, scale: str = "small", *, sessions: int | None = None, session_rate: float | None = None,
             seed: int | None = None, pauses: PauseScale | None = None, trace: TraceReplay | None = None,
             fleet: dict[str, Any] | None = None) -> AgenticScenario:
    """The named load at `scale`, with any override (a Bailian `trace` replaces the generated sessions)."""
    if scale not in SCALE_SETTINGS:
        raise ValueError(f"unknown scale {scale!r}; known: {SCALES}")
    s = SCALE_SETTINGS[scale]
    if load not in s["loads"] and trace is None:
        raise ValueError(f"unknown load {load!r}; known: {LOADS}")
    fleet_config = replace(s["fleet"], **(fleet or {}))
    pause = pauses or s["pauses"]
    if trace is not None:
        plans = bailian_sessions(trace, seed=seed if seed is not None else 2026)
        if pauses is None:
            pause = replace(pause, trace=1.0 / trace.speedup)
        knobs = {k: v for k, v in asdict(trace).items() if k != "name"}
        return AgenticScenario("bailian", scale, plans, {"trace": knobs}, fleet_config, pause, s["deadline_s"],
                               s["request_timeout"], text_seed=trace.seed)
    count, rate = s["loads"][load]
    params = replace(PRESETS[s["preset"]], sessions=sessions or count, session_rate=session_rate or rate)
    if seed is not None:
        params = replace(params, seed=seed)
    return AgenticScenario(load, scale, generate(params), {"generator": params.record()}, fleet_config, pause,
                           s["deadline_s"], s["request_timeout"], text_seed=params.seed)


def tuning(sc: AgenticScenario) -> Tuning:
    """Model knobs for contenders that need them (tokenizer, block size)."""
    turns = [t for p in sc.plans for t in p.turns]
    mean = sum(t.prompt_tokens for t in turns) // max(len(turns), 1)
    return replace(fleet_tuning(sc.fleet, mean), block_size=sc.block_size)


def reusable_share(plans: list[SessionPlan]) -> float:
    """Share of the planned prompt tokens any router could serve from cache (all but each turn's new tokens)."""
    total = new = 0
    for p in plans:
        prev = None
        for t in p.turns:
            total += t.prompt_tokens
            new += new_tokens(prev, t)
            prev = t
    return 1 - new / total if total else 0.0


# Router-side series kept in the results: policy and index counters (validity), the picker's session
# and flow-control counters, its scheduling time.
_ROUTER_PREFIXES = ("vllm_router_policy_decisions_total", "vllm_router_prefix_routing_decisions_total",
                    "vllm_router_kv_placement_lookups_total", "vllm_router_kv_routing_inputs_total",
                    "smg_worker_selection_total", "vllm_router_agent_aware_admission_required_tokens_count",
                    "epp_kv_index_", "epp_session_", "epp_program_aware_",
                    "epp_flow_control_", "inference_extension_scheduler_e2e_duration_seconds_sum",
                    "inference_extension_scheduler_e2e_duration_seconds_count")


async def router_metrics(http: aiohttp.ClientSession, url: str | None) -> dict[str, float]:
    """The router's own counters of `_ROUTER_PREFIXES` (empty when it has no page or it cannot be read)."""
    if not url:
        return {}
    try:
        async with http.get(url, timeout=aiohttp.ClientTimeout(total=5)) as resp:
            text = await resp.text()
    except (TimeoutError, aiohttp.ClientError):
        return {}
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(_ROUTER_PREFIXES):
            continue
        name, _, value = line.rpartition(" ")
        with contextlib.suppress(ValueError):
            out[name] = float(value)
    return out


async def _probe(http: aiohttp.ClientSession, base_url: str) -> bool:
    """One short request through the router before the clock starts (also warms its connections)."""
    body = {"model": "sim-model", "prompt": "probe", "max_tokens": 1}
    for _ in range(30):
        with contextlib.suppress(TimeoutError, aiohttp.ClientError):
            async with http.post(base_url + "/v1/completions", json=body,
                                 timeout=aiohttp.ClientTimeout(total=10)) as resp:
                await resp.read()
                if resp.status == 200:
                    return True
        await asyncio.sleep(0.5)
    return False


def _unavailable(name: str, description: str, why: str) -> dict[str, Any]:
    return {"name": name, "description": description, "status": f"unavailable: {why}", "overall": None}


async def run_one(sc: AgenticScenario, name: str, workdir: Path, *, fleet: Any = None,
                  progress: bool = True) -> dict[str, Any]:
    """One contender through the replay on `fleet` (left running) or on a fresh simulated fleet."""
    c = resolve(name)
    if c is None:
        return _unavailable(name, "", "not registered in this checkout (bench/routing/contenders.py or experiments)")
    t = tuning(sc)
    if c.kind == "epp":
        c = with_cpu_tier(c, sc.cpu_tier_tokens, t, workdir / name)
        why = await asyncio.to_thread(refusal, c, t)
        if why:
            return _unavailable(name, c.description, why)
    own = fleet is None
    if own:
        fleet = SimFleet(sc.fleet, tokenizer_dir=t.tokenizer_dir, **c.fleet_options)
        await fleet.start()
    elif any(getattr(fleet, "options", {}).get(k, object()) != v for k, v in c.fleet_options.items()):
        return _unavailable(name, c.description, f"needs fleet options {c.fleet_options} a running fleet cannot take")
    router: RunningRouter | None = None
    try:
        try:
            router = await start_contender(c, fleet, t, workdir / name)
        except Unavailable as exc:
            return _unavailable(name, c.description, str(exc))
        fleet_pids = getattr(fleet, "pids", None) or [p.pid for p in getattr(fleet, "_procs", [])]
        meter = CpuMeter({"router": router.pids, "fleet": fleet_pids})
        aliases = ALIASES.get(name, ())
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
        async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as http, \
                aiohttp.ClientSession() as scrape:
            if not await _probe(http, router.base_url):
                return {**_unavailable(name, c.description, ""), "status": "failed: the router did not serve a probe"}
            before = await scrape_fleet(scrape, fleet.info)
            meter.sample()
            done = [0]
            total = sum(len(p.turns) for p in sc.plans)

            def tick(_: object) -> None:
                done[0] += 1
                if progress and done[0] % max(1, total // 4) == 0:
                    print(f"    {done[0]}/{total} turns", flush=True)

            result = await replay(http, router.base_url, sc.plans, seed=sc.text_seed, pauses=sc.pauses,
                                  deadline_s=sc.deadline_s, request_timeout=sc.request_timeout, aliases=aliases,
                                  tokenizer_dir=t.tokenizer_dir, on_turn=tick)
            cpu = meter.sample()
            after = await scrape_fleet(scrape, fleet.info)
            counters = await router_metrics(scrape, router.metrics_url)
        return measured(sc, c, router, result, (before, after), cpu, counters, aliases)
    finally:
        if router is not None:
            await router.stop()
        if own:
            await fleet.stop()


def measured(sc: AgenticScenario, c: Any, router: RunningRouter, result: ReplayResult, counters: tuple[Any, Any],
             cpu: dict[str, float], router_counters: dict[str, float], aliases: tuple[str, ...]) -> dict[str, Any]:
    """The result row of one contender: the turns' summary, the programs' metrics, the validity check, samples."""
    records = result.records()
    for r in records:
        r.slo_ttft_ms = sc.ttft_objective_ms
    wall = result.finished - result.started
    overall = summarize("all turns", None, records, wall, counters, None, cpu)
    ideal = ideal_seconds(sc.plans, sc.pauses, sc.cost())
    metrics = session_metrics(result, sc.plans, ideal)
    row = ContenderResult(c.name, c.description, overall=replace(overall, oracle_hit_rate=reusable_share(sc.plans)),
                          router_metrics=router_counters)
    verdict = validity(c, row)
    ok = max(overall.ok, 1)
    return {"name": c.name, "description": c.description, "status": "ok", "version": router.version,
            "flags": router.flags, "aliases": list(aliases), "verdict": verdict.verdict, "validity": verdict.detail,
            "overall": asdict(overall), "sessions": asdict(metrics),
            "router_cpu_ms_per_turn": cpu.get("router", 0.0) * wall / ok * 1e3,
            "router_metrics": router_counters, "samples": samples(result),
            "replay_s": wall}


async def run_all(sc: AgenticScenario, names: list[str], out_dir: Path, *, progress: bool = True) -> list[dict[str, Any]]:
    """Every contender in turn on its own fleet; one line per contender as it ends."""
    rows = []
    for name in names:
        t0 = time.perf_counter()
        if progress:
            print(f"[agentic {sc.name}/{sc.scale}] {name}", flush=True)
        try:
            row = await run_one(sc, name, out_dir / "logs", progress=progress)
        except Exception as exc:  # noqa: BLE001 - one broken contender must not lose the others' results
            row = {"name": name, "description": "", "status": f"failed: {type(exc).__name__}: {exc}", "overall": None}
        rows.append(row)
        if progress:
            print(f"  -> {one_line(row)}  [{time.perf_counter() - t0:.0f}s]", flush=True)
    return rows


def one_line(row: dict[str, Any]) -> str:
    """A result row in one line (progress output)."""
    if row.get("overall") is None:
        return str(row["status"])
    o, s = row["overall"], row["sessions"]

    def sec(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}s"

    return (f"{s['complete']}/{s['programs']} programs, completion p90 {sec(s['completion_p90'])}, TTFT p90 "
            f"{sec(o['ttft_p90'])} p99 {sec(o['ttft_p99'])}, hit {o['hit_rate'] or 0:.1%}, router "
            f"{row['router_cpu_ms_per_turn']:.1f} ms CPU/turn; {row['verdict']}: {row['validity']}")


__all__ = ["LOADS", "SCALES", "SCALE_SETTINGS", "AgenticScenario", "one_line", "reusable_share", "run_all", "run_one",
           "scenario", "tuning"]
