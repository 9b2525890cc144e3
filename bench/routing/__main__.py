"""`python -m bench.routing run SCENARIO [--scale S] [--contenders a,b] [--out DIR]` and `list`."""

from __future__ import annotations

import argparse
import asyncio
import logging
import shlex
import sys
import time
from pathlib import Path

from bench.routing.contenders import CONTENDERS
from bench.routing.report import write_report
from bench.routing.runner import run_scenario
from bench.routing.scenarios import SCALES, SCENARIOS, get_scenario

RESULTS = Path(__file__).resolve().parent.parent / "results"


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    parser = argparse.ArgumentParser(prog="python -m bench.routing", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a named scenario against every contender and write the report")
    run.add_argument("scenario", choices=sorted(SCENARIOS))
    run.add_argument("--scale", choices=SCALES, default="small")
    run.add_argument("--contenders", default="all",
                     help=f"comma-separated subset of: {', '.join(CONTENDERS)} (default all)")
    run.add_argument("--out", help="output directory (default bench/results/<scenario>)")
    run.add_argument("--no-raw", action="store_true", help="do not keep per-request records (raw/*.jsonl)")
    run.add_argument("--quiet", action="store_true", help="no progress output")
    sub.add_parser("list", help="list scenarios and contenders")
    args = parser.parse_args(argv)
    if args.command == "list":
        for name in SCENARIOS:
            for scale in SCALES:
                print(f"{name:14s} {scale:7s} {get_scenario(name, scale).workload.describe()}")
        for c in CONTENDERS.values():
            print(f"{c.name:26s} {c.description}")
        return 0
    names = list(CONTENDERS) if args.contenders == "all" else [n.strip() for n in args.contenders.split(",")]
    unknown = [n for n in names if n not in CONTENDERS]
    if unknown:
        parser.error(f"unknown contenders {unknown}; known: {list(CONTENDERS)}")
    # Peers probe replicas with an HTTP/2 preface first; in-process replicas would log each probe.
    logging.getLogger("aiohttp.server").setLevel(logging.CRITICAL)
    scenario = get_scenario(args.scenario, args.scale)
    out = Path(args.out) if args.out else RESULTS / args.scenario
    command = "python -m bench.routing " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    results = asyncio.run(run_scenario(scenario, names, out, progress=not args.quiet, keep_raw=not args.no_raw))
    md = write_report(scenario, results, out, command, started)
    print(f"report: {md}")
    return 0 if all(r.overall is not None or r.status.startswith("unavailable") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
