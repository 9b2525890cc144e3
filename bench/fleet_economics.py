"""Fleet economics benchmark: two models sharing four GPUs with sleep/wake, and a cost report.

Part 1 (sleep/wake). Models A and B, one simulated replica of each per GPU (4 GPUs, 8 replicas,
the `h100-llama3-8b` profile, whose `wake_seconds` is the wake time). Demand alternates: A busy
while B only trickles, then the reverse. Two set-ups get the same request sequence:

- `sleep-wake`: each replica has the GPU's whole KV cache, and at most one replica per GPU is
  awake. The picker's `sleep-wake-policy` (gpuLabel) wakes a replica of a model whose awake
  replicas are saturated (putting the idle other-model replica of that GPU to sleep), and puts
  replicas idle for a while to sleep, keeping one awake per model;
- `sleep-wake-last`: the same, but the last awake replica of a model may be put to sleep too
  (`sleepLastReplica: true`), so a busy model can take all four GPUs;
- `all-awake`: every replica always awake with half the KV cache (two models in one GPU's memory).

Reported per model: TTFT p90, requests served (HTTP 200) and failed, replica-seconds awake.

Part 2 (cost). The shared-prefix workload of the routing benchmark on four replicas of one model
through the default picker; `epp cost`'s arithmetic on the picker's token counters (a scrape
before, one after) at stated example prices.

    python -m bench.fleet_economics [--phase-seconds 15] [--rate 16] [--out bench/results/fleet-economics]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import aiohttp

from bench.routing.loadgen import RequestRecord, send
from bench.routing.measure import percentile
from bench.routing.workloads import BenchRequest, SharedPrefix
from epp.config.compose import DEFAULT_SCORER_WEIGHTS, endpoint_picker_config, plugin
from epp.datalayer.registry import EndpointSpec
from epp.engine.sim.fleet import FleetConfig, SimFleet, default_tokenizer_dir
from epp.engine.sim.profiles import get_profile
from epp.envoy import EnvoyProcess, render_config
from epp.fleet.cost import cost_lines, load_prices, read_counters, render, window_counters
from epp.netutil import free_ports
from epp.server.runner import EppServer, ServeOptions

MODELS = ("model-a", "model-b")
GPUS = 4
PROFILE = "h100-llama3-8b"
FULL_KV_BLOCKS = 1200
MAX_NUM_SEQS = 4
TIME_SCALE = 2.0
EXAMPLE_PRICES = {"currency": "USD", "unit_tokens": 1_000_000,
                  "default": {"input": 3.00, "cached": 0.30, "output": 15.00}}


def picker_config(sleep_wake: bool, sleep_last: bool) -> str:
    """GIE's default scorers behind the served-model filter; with `sleep_wake`, the sleep/wake policy too."""
    policy = [plugin("sleep-wake-policy", gpuLabel="gpu", saturationQueueDepth=2, wakeCooldownSeconds=1,
                     maxHoldSeconds=10, idleSleepSeconds=5, idleCheckSeconds=0.5, sleepLastReplica=sleep_last)]
    return endpoint_picker_config([*DEFAULT_SCORER_WEIGHTS, "served-model-filter", *(policy if sleep_wake else [])],
                                  {"served-model-filter": None, **DEFAULT_SCORER_WEIGHTS})


SETUPS = ("sleep-wake", "sleep-wake-last", "all-awake")


@dataclass
class SetupResult:
    """What one set-up measured, per model."""

    name: str
    records: dict[str, list[RequestRecord]] = field(default_factory=dict)
    awake_seconds: dict[str, float] = field(default_factory=dict)
    wakes: float = 0.0
    sleeps: float = 0.0

    def row(self, model: str) -> list[str]:
        recs = self.records.get(model, [])
        ok = [r for r in recs if r.ok]
        p90 = percentile([r.ttft for r in ok if r.ttft is not None], 0.9)
        p50 = percentile([r.ttft for r in ok if r.ttft is not None], 0.5)
        return [self.name, model, f"{p50 * 1e3:.0f}" if p50 is not None else "-",
                f"{p90 * 1e3:.0f}" if p90 is not None else "-", str(len(ok)), str(len(recs) - len(ok)),
                f"{self.awake_seconds.get(model, 0.0):.0f}"]


def model_requests(model: str, seed: int) -> Iterator[BenchRequest]:
    """The shared-prefix stream of one model, addressed to it."""
    w = SharedPrefix(groups=6, users=5, system_tokens=2048, question_tokens=256, output_tokens=32, seed=seed)
    for req in w.requests():
        yield replace(req, body={**req.body, "model": model}, group=f"{model}/{req.group}")


def fleet_config(model: str, blocks: int, time_scale: float) -> FleetConfig:
    return FleetConfig(replicas=GPUS, model=model, profile=PROFILE, num_gpu_blocks=blocks, max_num_seqs=MAX_NUM_SEQS,
                       time_scale=time_scale, kv_events=False, processes=1, name_prefix=model[-1],
                       tokenizer_dir=default_tokenizer_dir())


async def start_stack(config_text: str | None, specs: list[EndpointSpec]) -> tuple[EppServer, EnvoyProcess, str]:
    server = EppServer(ServeOptions(grpc_port=0, grpc_health_port=0, metrics_port=0, bind_address="127.0.0.1",
                                    config_text=config_text, endpoints=specs, refresh_metrics_interval_s=0.05,
                                    grace_period_s=1))
    await server.start()
    listen, admin = free_ports(2)
    envoy = EnvoyProcess(render_config(listen_port=listen, admin_port=admin, epp_port=server.grpc_port), admin)
    await envoy.start()
    return server, envoy, f"http://127.0.0.1:{listen}"


async def run_setup(name: str, phases: int, phase_s: float, rate: float, trickle: float, seed: int,
                    time_scale: float) -> SetupResult:
    sleep_wake = name.startswith("sleep-wake")
    blocks = FULL_KV_BLOCKS if sleep_wake else FULL_KV_BLOCKS // 2
    fleets = {m: await SimFleet(fleet_config(m, blocks, time_scale)).start() for m in MODELS}
    specs = []
    for m, fleet in fleets.items():
        for gpu, endpoint in enumerate(fleet.endpoints):
            host, port = endpoint.rsplit(":", 1)
            specs.append(EndpointSpec(host, int(port), {"model": m, "gpu": f"g{gpu}"}))
    result = SetupResult(name, {m: [] for m in MODELS}, {m: 0.0 for m in MODELS})
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        if sleep_wake:  # start balanced: A on GPUs 0-1, B on GPUs 2-3
            for gpu in range(GPUS):
                asleep = "model-b" if gpu < GPUS // 2 else "model-a"
                async with session.post(f"http://{fleets[asleep].endpoints[gpu]}/sleep?level=1") as resp:
                    assert resp.status == 200
        server, envoy, base = await start_stack(picker_config(sleep_wake, name == "sleep-wake-last"), specs)
        try:
            await asyncio.sleep(1.0)  # first scrapes
            streams = {m: model_requests(m, seed + i) for i, m in enumerate(MODELS)}
            stop = asyncio.Event()
            sampler = asyncio.ensure_future(sample_awake(server, result, stop))
            tasks: set[asyncio.Task] = set()
            rng = random.Random(seed)
            for phase in range(phases):
                busy = MODELS[phase % 2]
                end = time.monotonic() + phase_s
                rates = {m: rate if m == busy else trickle for m in MODELS}
                nxt = {m: time.monotonic() + rng.expovariate(rates[m]) for m in MODELS}
                while True:
                    m = min(nxt, key=nxt.__getitem__)
                    if nxt[m] >= end:
                        break
                    await asyncio.sleep(max(0.0, nxt[m] - time.monotonic()))
                    rec = RequestRecord(stage=phase, group=m, sent=0.0)
                    result.records[m].append(rec)
                    task = asyncio.ensure_future(send(session, base, next(streams[m]), rec, 60.0))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                    nxt[m] += rng.expovariate(rates[m])
                await asyncio.sleep(max(0.0, end - time.monotonic()))
            if tasks:
                await asyncio.wait(tasks, timeout=60)
            stop.set()
            await sampler
            reg = server.metrics.registry
            result.wakes = reg.get_sample_value("epp_sleep_wake_actions_total",
                                                {"action": "wake", "outcome": "ok"}) or 0.0
            result.sleeps = reg.get_sample_value("epp_sleep_wake_actions_total",
                                                 {"action": "sleep", "outcome": "ok"}) or 0.0
        finally:
            await envoy.stop()
            await server.stop(0)
            for fleet in fleets.values():
                await fleet.stop()
    return result


async def sample_awake(server: EppServer, result: SetupResult, stop: asyncio.Event, every: float = 0.25) -> None:
    """Integrate awake replicas per model over time, from the picker's registry (scraped sleep state)."""
    last = time.monotonic()
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), every)
        except TimeoutError:
            pass
        now = time.monotonic()
        for ep in server.endpoints.snapshot():
            if not ep.metrics.sleeping:
                model = ep.labels.get("model", "")
                result.awake_seconds[model] = result.awake_seconds.get(model, 0.0) + (now - last)
        last = now


async def cost_run(seconds: float, rate: float, seed: int) -> str:
    """The shared-prefix workload on four replicas of one model; the cost report of the run."""
    w = SharedPrefix(groups=12, users=5, system_tokens=4096, question_tokens=512, output_tokens=32, seed=seed)
    blocks = int(w.shared_tokens() / 16 / 0.73 / 4) + 1
    fleet = await SimFleet(FleetConfig(replicas=4, profile=PROFILE, num_gpu_blocks=blocks, time_scale=5.0,
                                       kv_events=False, processes=1, tokenizer_dir=default_tokenizer_dir())).start()
    specs = [EndpointSpec(host, int(port)) for host, port in (ep.rsplit(":", 1) for ep in fleet.endpoints)]
    server, envoy, base = await start_stack(None, specs)
    metrics_url = f"http://127.0.0.1:{server.metrics_port}/metrics"
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            await asyncio.sleep(1.0)
            async with session.get(metrics_url) as resp:
                before = read_counters(await resp.text())
            stream = w.requests()
            rng = random.Random(seed)
            tasks = []
            end = time.monotonic() + seconds
            t = time.monotonic()
            while True:
                t += rng.expovariate(rate)
                if t >= end:
                    break
                await asyncio.sleep(max(0.0, t - time.monotonic()))
                tasks.append(asyncio.ensure_future(send(session, base, next(stream), RequestRecord(0, "", 0.0), 60)))
            await asyncio.wait(tasks, timeout=60)
            await asyncio.sleep(0.5)
            async with session.get(metrics_url) as resp:
                after = read_counters(await resp.text())
    finally:
        await envoy.stop()
        await server.stop(0)
        await fleet.stop()
    prices = load_prices(EXAMPLE_PRICES)
    lines = cost_lines(window_counters(before, after), prices)
    return render(lines, prices, by_tenant=False, seconds=seconds)


def _p90_ms(records: list[RequestRecord]) -> int | None:
    p90 = percentile([r.ttft for r in records if r.ttft is not None], 0.9)
    return None if p90 is None else round(p90 * 1e3)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.fleet_economics", description=__doc__.split("\n\n")[0])
    p.add_argument("--phases", type=int, default=4, help="demand phases, alternating A busy / B busy (default 4)")
    p.add_argument("--phase-seconds", type=float, default=15.0)
    p.add_argument("--rate", type=float, default=16.0, help="requests/s of the busy model (default 16)")
    p.add_argument("--trickle", type=float, default=0.5, help="requests/s of the idle model (default 0.5)")
    p.add_argument("--cost-seconds", type=float, default=30.0, help="length of the shared-prefix cost run")
    p.add_argument("--cost-rate", type=float, default=4.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--time-scale", type=float, default=TIME_SCALE,
                   help=f"simulated time runs this much slower than the wall clock (default {TIME_SCALE:g})")
    p.add_argument("--setups", default=",".join(SETUPS), help=f"comma-separated subset of {', '.join(SETUPS)}")
    p.add_argument("--out", default="bench/results/fleet-economics")
    args = p.parse_args(argv)
    wake = get_profile(PROFILE).wake_seconds
    results = [asyncio.run(run_setup(name, args.phases, args.phase_seconds, args.rate, args.trickle, args.seed,
                                     args.time_scale))
               for name in args.setups.split(",")]
    cost = asyncio.run(cost_run(args.cost_seconds, args.cost_rate, args.seed))
    head = ["set-up", "model", "TTFT p50 ms", "TTFT p90 ms", "served", "failed", "replica-s awake"]
    rows = [r.row(m) for r in results for m in MODELS]
    phase_p90 = {f"{r.name}/{m}": [_p90_ms([rec for rec in r.records[m] if rec.ok and rec.stage == ph])
                                    for ph in range(args.phases)] for r in results for m in MODELS}
    errors = {f"{r.name}/{m}": dict(collections.Counter(rec.error for rec in r.records[m] if not rec.ok))
              for r in results for m in MODELS}
    table = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(r) + " |" for r in rows]
    lines = [f"Sleep/wake: {args.phases} phases x {args.phase_seconds:g} s, busy model {args.rate:g} req/s, idle "
             f"model {args.trickle:g} req/s; profile {PROFILE} (wake {wake:g} s simulated), time scale {args.time_scale:g}, "
             f"max_num_seqs {MAX_NUM_SEQS}, KV {FULL_KV_BLOCKS} blocks (all-awake: {FULL_KV_BLOCKS // 2})", "",
             *table, "", "; ".join(f"{r.name}: {r.wakes:.0f} wakes, {r.sleeps:.0f} sleeps" for r in results
                                   if r.name.startswith("sleep-wake")),
             f"failures by cause: {json.dumps({k: v for k, v in errors.items() if v})}", "",
             "TTFT p90 ms by phase (A busy in phases 0 and 2, B busy in 1 and 3):", "",
             *(f"- {k}: {v}" for k, v in phase_p90.items()), "",
             f"Cost report, shared-prefix run ({args.cost_seconds:g} s at {args.cost_rate:g} req/s), example prices "
             f"per million tokens: input $3.00, cached input $0.30, output $15.00:", "", "```", cost.rstrip(), "```"]
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.md").write_text(text)
    (out / "results.json").write_text(json.dumps({
        "setups": [{"name": r.name, "awake_seconds": r.awake_seconds, "wakes": r.wakes, "sleeps": r.sleeps,
                    "rows": [r.row(m) for m in MODELS]} for r in results], "errors": errors, "phase_ttft_p90_ms": phase_p90, "cost": cost}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
