"""`python -m bench.routing run SCENARIO [--scale S] [--contenders a,b] [--repeats N] [--out DIR]`, `combine`, `list`."""

from __future__ import annotations

import argparse
import asyncio
import logging
import shlex
import sys
import time
from dataclasses import replace
from pathlib import Path

from bench.routing.combine import join_runs, load_runs, write_combined
from bench.routing.contenders import CONTENDERS
from bench.routing.experiments import FAMILIES, known
from bench.routing.loadgen import Stage
from bench.routing.objectives import DEFAULT_TTFT_OBJECTIVE_MS, Objectives
from bench.routing.report import write_report
from bench.routing.runner import run_scenario
from bench.routing.scenarios import SCALES, SCENARIOS, TRACE_KNOBS, get_scenario

RESULTS = Path(__file__).resolve().parent.parent / "results"


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    parser = argparse.ArgumentParser(prog="python -m bench.routing", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a named scenario against every contender and write the report")
    run.add_argument("scenario", choices=sorted(SCENARIOS))
    run.add_argument("--scale", choices=SCALES, default="small")
    run.add_argument("--contenders", default="all",
                     help="comma-separated names of contenders or experiments (`list` shows both; default: "
                          f"all: {', '.join(n for n, c in CONTENDERS.items() if c.default)})")
    run.add_argument("--out", help="output directory (default bench/results/<scenario>)")
    run.add_argument("--rates", help="override the schedule: comma-separated open-loop rates (req/s, wall clock)")
    run.add_argument("--stage-seconds", type=float, help="override every stage's duration")
    run.add_argument("--time-scale", type=float,
                     help="override the simulator's slowdown (a busy machine: slower replicas need less CPU per "
                          "wall second; divide --rates accordingly)")
    run.add_argument("--arrivals", choices=("poisson", "constant"), help="override the arrival process")
    run.add_argument("--concurrency", help="closed loop instead: comma-separated client counts, one stage each")
    run.add_argument("--continuous", action="store_true",
                     help="continuous ramp: no draining between stages (in-flight requests run into the next)")
    trace = run.add_argument_group("trace scenario (Mooncake or Bailian JSONL replayed at its timestamps)")
    trace.add_argument("--trace", metavar="PATH", help="the trace file: Mooncake JSONL (timestamp, input_length, output_length, hash_ids) "
                       "or Bailian JSONL (chat_id, parent_chat_id, timestamp, ..., hash_ids)")
    trace.add_argument("--trace-block-tokens", type=int, help="tokens per 512-token hash block of the trace")
    trace.add_argument("--trace-max-prompt", type=int, help="cap on prompt tokens (longer prompts keep their first blocks)")
    trace.add_argument("--trace-max-output", type=int, help="cap on output tokens")
    trace.add_argument("--trace-speedup", type=float, help="trace seconds per wall second")
    trace.add_argument("--trace-start", type=float, help="start this many trace seconds in")
    trace.add_argument("--trace-window", type=float, help="take conversations starting within this many trace seconds")
    trace.add_argument("--trace-fraction", type=float, help="share of those conversations replayed (whole)")
    slo = run.add_argument_group("latency objectives (sent as x-llm-d-slo-* headers; the report's goodput)")
    slo.add_argument("--slo-ttft-ms", type=float, default=DEFAULT_TTFT_OBJECTIVE_MS,
                     help="every request's TTFT objective (default %(default)g)")
    slo.add_argument("--sensitive-share", type=float, default=0.0,
                     help="share of the groups (conversations, sessions) marked latency-sensitive")
    slo.add_argument("--sensitive-ttft-ms", type=float, help="their TTFT objective")
    slo.add_argument("--sensitive-tpot-ms", type=float, help="their TPOT objective (time per output token)")
    run.add_argument("--epp-arg", action="append", default=[], metavar="ARG",
                     help="one more `epp serve` argument for every epp contender (repeat for each word, e.g. "
                          "--epp-arg=--refresh-metrics-interval --epp-arg=0.045)")
    run.add_argument("--repeats", type=int, default=1,
                     help="run the whole scenario N times (every contender once per run, the runs in turn): each run "
                          "into <out>/run-<k>/, then the combined report with 95 %% intervals into <out>/ (a claim "
                          "needs 3)")
    run.add_argument("--no-raw", action="store_true", help="do not keep per-request records (raw/*.jsonl)")
    run.add_argument("--quiet", action="store_true", help="no progress output")
    comb = sub.add_parser("combine", help="combine runs of one scenario (folders of single runs or combinations) "
                                          "into one result with 95 % intervals")
    comb.add_argument("runs", nargs="+", help="result folders (each with a results.json)")
    comb.add_argument("--out", required=True, help="output folder")
    comb.add_argument("--join", action="append", default=[], metavar="RUNS",
                      help="contenders measured later on the same workload: this result's k-th run joins the "
                           "k-th run of the others (repeatable; the run counts must match)")
    sub.add_parser("list", help="list scenarios, contenders and experiments")
    args = parser.parse_args(argv)
    command = "python -m bench.routing " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    if args.command == "combine":
        try:
            runs = load_runs(Path(p) for p in args.runs)
            for more in args.join:
                runs = join_runs(runs, load_runs([Path(more)]))
        except (ValueError, KeyError, OSError) as exc:
            parser.error(str(exc))
        print(f"report: {write_combined(runs, Path(args.out), command)}")
        return 0
    if args.command == "list":
        for name in SCENARIOS:
            for scale in SCALES:
                if name == "trace":
                    print(f"{name:14s} {scale:7s} a Mooncake or Bailian JSONL trace (--trace PATH), knobs {TRACE_KNOBS[scale]}")
                    continue
                print(f"{name:14s} {scale:7s} {get_scenario(name, scale).workload.describe()}")
        print("\ncontenders (`all`: those marked *)")
        for c in CONTENDERS.values():
            print(f"{'*' if c.default else ' '} {c.name:32s} {c.description}")
        print("\nexperiments (bench/routing/experiments.py), by the question each family answers")
        for family in FAMILIES:
            print(f"\n  {family.question} (bench/notes/{family.note})")
            for c in family.contenders:
                print(f"    {c.name:32s} {c.description}")
        return 0
    names = [n for n, c in CONTENDERS.items() if c.default] if args.contenders == "all" else [n.strip() for n in args.contenders.split(",")]
    unknown = [n for n in names if n not in known()]
    if unknown:
        parser.error(f"unknown contenders {unknown}; `python -m bench.routing list` shows the contenders and experiments")
    # Peers probe replicas with an HTTP/2 preface first; in-process replicas would log each probe.
    logging.getLogger("aiohttp.server").setLevel(logging.CRITICAL)
    if args.scenario == "trace" and (args.rates or args.concurrency or args.arrivals):
        parser.error("the trace scenario replays the trace's own timestamps: use --trace-speedup, not "
                     "--rates/--concurrency/--arrivals")
    if args.trace and args.scenario != "trace":
        parser.error("--trace goes with the trace scenario")
    try:
        scenario = get_scenario(args.scenario, args.scale, args.trace, block_tokens=args.trace_block_tokens,
                                max_prompt_tokens=args.trace_max_prompt, max_output_tokens=args.trace_max_output,
                                speedup=args.trace_speedup, start_s=args.trace_start, window_s=args.trace_window,
                                fraction=args.trace_fraction)
    except ValueError as exc:  # includes TraceFormatError: a bad trace file or knob
        parser.error(str(exc))
    try:
        scenario.objectives = Objectives(args.slo_ttft_ms, args.sensitive_share, args.sensitive_ttft_ms,
                                         args.sensitive_tpot_ms)
    except ValueError as exc:
        parser.error(str(exc))
    scenario.stages = _schedule(scenario.stages, args)
    if args.time_scale:
        if args.time_scale <= 0:
            parser.error("--time-scale must be > 0")
        scenario.fleet = replace(scenario.fleet, time_scale=args.time_scale)
    scenario.continuous = scenario.continuous or args.continuous
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    out = Path(args.out) if args.out else RESULTS / args.scenario
    ok = True
    run_dirs = [out] if args.repeats == 1 else [out / f"run-{k + 1}" for k in range(args.repeats)]
    for k, run_dir in enumerate(run_dirs):
        if args.repeats > 1 and not args.quiet:
            print(f"== run {k + 1} of {args.repeats} -> {run_dir}", flush=True)
        started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
        results = asyncio.run(run_scenario(scenario, names, run_dir, progress=not args.quiet, keep_raw=not args.no_raw,
                                           epp_args=tuple(args.epp_arg)))
        md = write_report(scenario, results, run_dir, command, started)
        ok = ok and all(r.overall is not None or r.status.startswith("unavailable") for r in results)
    if args.repeats > 1:
        md = write_combined(load_runs(run_dirs), out, command, [d.name for d in run_dirs])
    print(f"report: {md}")
    return 0 if ok else 1


def _schedule(stages: list[Stage], args: argparse.Namespace) -> list[Stage]:
    """The scenario's stages with the command line's overrides applied."""
    if stages and stages[0].arrivals == "trace":
        return stages  # timed by the trace itself
    duration = args.stage_seconds or stages[0].duration
    arrivals = args.arrivals or stages[0].arrivals
    if args.concurrency:
        return [Stage(duration, concurrency=int(c)) for c in args.concurrency.split(",")]
    if args.rates:
        return [Stage(duration, float(r), arrivals) for r in args.rates.split(",")]
    return [replace(s, duration=args.stage_seconds or s.duration, arrivals=args.arrivals or s.arrivals)
            for s in stages]


if __name__ == "__main__":
    sys.exit(main())
