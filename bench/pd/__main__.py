"""`python -m bench.pd [--rates 1,2,4] [--prompt-tokens N] [--output-tokens N] [--stage-seconds S] [--out DIR]`."""

from __future__ import annotations

import argparse
import asyncio
import logging
import shlex
import sys
from pathlib import Path

from bench.pd.run import TOPOLOGIES, Settings, rewrite_report, run

RESULTS = Path(__file__).resolve().parent.parent / "results" / "pd"


def _floats(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma list of numbers: {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError("rates must be positive")
    return values


def main(argv: list[str] | None = None) -> int:
    """Run every topology at every load and write bench/results/pd/report.md."""
    d = Settings()
    p = argparse.ArgumentParser(prog="python -m bench.pd", description=__doc__)
    p.add_argument("--rates", type=_floats, default=d.rates, help="loads in simulated req/s (default 1,2,4,6,8,10)")
    p.add_argument("--prompt-tokens", type=int, default=d.prompt_tokens, help="tokens per prompt (default 8192)")
    p.add_argument("--output-tokens", type=int, default=d.output_tokens, help="tokens per answer (default 256)")
    p.add_argument("--stage-seconds", type=float, default=d.stage_seconds, help="wall seconds per load (default 25)")
    p.add_argument("--time-scale", type=float, default=d.time_scale,
                   help="wall seconds per simulated second (default 2: the machine drives half-speed GPUs)")
    p.add_argument("--topologies", default=",".join(TOPOLOGIES), help=f"comma list of: {', '.join(TOPOLOGIES)}")
    p.add_argument("--out", type=Path, default=RESULTS, help="output directory (default bench/results/pd)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--report-only", action="store_true", help="rewrite report.md from the results.json in --out")
    args = p.parse_args(argv)
    if args.report_only:
        print(rewrite_report(args.out))
        return 0
    topologies = tuple(t.strip() for t in args.topologies.split(","))
    unknown = [t for t in topologies if t not in TOPOLOGIES]
    if unknown:
        p.error(f"unknown topologies {unknown}; known: {list(TOPOLOGIES)}")
    s = Settings(prompt_tokens=args.prompt_tokens, output_tokens=args.output_tokens, rates=args.rates,
                 stage_seconds=args.stage_seconds, time_scale=args.time_scale, topologies=topologies)
    logging.getLogger("aiohttp.server").setLevel(logging.CRITICAL)
    command = "python -m bench.pd " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    print(asyncio.run(run(s, args.out, command, progress=not args.quiet)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
