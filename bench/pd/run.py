"""Prefill/decode disaggregation against aggregated serving, at rising load, on simulated H100s.

Each topology has four simulated replicas (latency profile `h100-llama3-8b`): `4 aggregated`
(no roles, the picker's default queue/kv/prefix pipeline), `2P+2D`, `1P+3D` and `3P+1D` (role labels,
`examples/configs/pd.yaml`: every long prompt is prefilled on a prefill replica, its KV moved at
the profile's transfer bandwidth, and decoded on a decode replica behind its `epp engine
pd-sidecar`). The whole stack is real: Envoy (responses not sent through the picker), the
picker (`epp serve`), the sidecars and the replicas run as their own processes; only the GPU is
simulated. The load: unique long prompts (no shared prefix) at open-loop Poisson rates, streamed.

Times are simulated seconds (wall seconds / time scale). Per load: TTFT p90, ITL p99 (gaps
between streamed tokens), output tokens/s per replica, errors; per replica role: prefill and
decode legs, transferred tokens, failed loads (from each replica's /sim/state).
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp

from bench.routing.contenders import RunningRouter, _spawn, _terminate, _wait_http
from bench.routing.loadgen import RequestRecord, Stage, run_stage
from bench.routing.measure import percentile
from bench.routing.workloads import _VOCAB, MODEL, BenchRequest, tokenizer
from epp.engine.sim.fleet import FleetConfig, SimFleet
from epp.envoy import EnvoyProcess, render_config
from epp.netutil import free_ports

PD_CONFIG = Path(__file__).resolve().parents[2] / "examples" / "configs" / "pd.yaml"
ROLE = "llm-d.ai/role"
TOPOLOGIES: dict[str, list[str] | None] = {
    "4 aggregated": None,
    "2P+2D": ["prefill", "prefill", "decode", "decode"],
    "1P+3D": ["prefill", "decode", "decode", "decode"],
    "3P+1D": ["prefill", "prefill", "prefill", "decode"],
}


@dataclass(frozen=True)
class Settings:
    """What one run measures."""

    prompt_tokens: int = 8192
    output_tokens: int = 256
    rates: tuple[float, ...] = (1.0, 2.0, 4.0, 6.0, 8.0, 10.0)  # simulated requests/s
    stage_seconds: float = 25.0                                  # wall seconds per load
    time_scale: float = 2.0                                # wall seconds per simulated second
    profile: str = "h100-llama3-8b"
    seed: int = 7
    topologies: tuple[str, ...] = tuple(TOPOLOGIES)


def _text_of_tokens(rng: random.Random, tokens: int, tok, tag: str) -> str:
    """Seeded text the simulator's tokenizer reads as about `tokens` tokens (linear time: these are long)."""
    words, length = [tag], len(tag)
    while length < tokens * 5:  # ~3 characters per token with this vocabulary: overshoot, then cut
        word = rng.choice(_VOCAB) + str(rng.randrange(1000))
        words.append(word)
        length += len(word) + 1
    text = " ".join(words)
    enc = tok.tokenizer.encode(text, add_special_tokens=False)
    return text if len(enc.ids) <= tokens else text[: enc.offsets[tokens - 1][1]]


def long_prompts(s: Settings, count: int, start: int = 0) -> list[BenchRequest]:
    """`count` unique long prompts (completions API, streamed with usage), seeded by index."""
    tok = tokenizer()
    out = []
    for i in range(start, start + count):
        text = _text_of_tokens(random.Random(s.seed * 1_000_003 + i), s.prompt_tokens, tok, f"document{i}:")
        body = {"model": MODEL, "prompt": text, "max_tokens": s.output_tokens, "stream": True,
                "stream_options": {"include_usage": True}}
        out.append(BenchRequest("/v1/completions", body, f"doc-{i}", s.output_tokens))
    return out


@dataclass
class LoadResult:
    """One topology at one load (simulated seconds)."""

    topology: str
    rate: float
    requests: int
    errors: int
    ttft_p50: float | None
    ttft_p90: float | None
    itl_p50: float | None
    itl_p99: float | None
    tokens_per_s_per_replica: float


@dataclass
class TopologyResult:
    topology: str
    loads: list[LoadResult] = field(default_factory=list)
    roles: dict[str, dict[str, float]] = field(default_factory=dict)
    pd_decisions: dict[str, float] = field(default_factory=dict)


def summarize(topology: str, rate: float, records: list[RequestRecord], busy_wall: float, s: Settings) -> LoadResult:
    ok = [r for r in records if r.ok]
    ts = s.time_scale
    ttft = [r.ttft / ts for r in ok if r.ttft is not None]
    itl = [gap / ts for r in ok for gap in r.itl]
    tokens = sum(r.output_tokens for r in ok)

    def p(values: list[float], q: float) -> float | None:
        return percentile(values, q)

    return LoadResult(topology, rate, len(records), len(records) - len(ok), p(ttft, 50), p(ttft, 90), p(itl, 50),
                      p(itl, 99), tokens / (busy_wall / ts) / 4 if busy_wall > 0 else 0.0)


async def start_stack(roles: list[str] | None, s: Settings, workdir: Path) -> tuple[SimFleet, RunningRouter]:
    """Replicas (one worker process), sidecars, the picker and Envoy for one topology."""
    fleet = SimFleet(FleetConfig(replicas=4, roles=roles, profile=s.profile, time_scale=s.time_scale,
                                 max_model_len=s.prompt_tokens + s.output_tokens + 512, kv_events=False,
                                 processes=1, name_prefix="pd" if roles else "agg"))
    await fleet.start()
    grpc, health, metrics, listen, admin = free_ports(5)
    router = RunningRouter(f"http://127.0.0.1:{listen}", metrics_url=f"http://127.0.0.1:{metrics}/metrics")
    try:
        endpoints = []
        for d in fleet.info:
            role = d["labels"].get(ROLE)
            endpoint = d["endpoint"]
            if role == "decode":
                (port,) = free_ports(1)
                log = workdir / f"sidecar-{d['name']}.log"
                proc = await _spawn([sys.executable, "-m", "epp.engine.pd_sidecar", "--host", "127.0.0.1",
                                     "--port", str(port), "--vllm-port", endpoint.rpartition(":")[2]], log)
                router.stoppers.append(lambda proc=proc: _terminate(proc))
                router.pids.append(proc.pid)
                await _wait_http(f"http://127.0.0.1:{port}/health", 30, proc, log)
                endpoint = f"127.0.0.1:{port}"
            endpoints.append(endpoint + (f"#{ROLE}={role}" if role else ""))
        argv = [sys.executable, "-m", "epp.cli", "serve", "--grpc-port", str(grpc), "--grpc-health-port", str(health),
                "--metrics-port", str(metrics), "--bind-address", "127.0.0.1", "--endpoints", ",".join(endpoints)]
        if roles:
            argv += ["--config-file", str(PD_CONFIG)]
        log = workdir / "epp.log"
        proc = await _spawn(argv, log)
        router.stoppers.append(lambda: _terminate(proc))
        router.pids.append(proc.pid)
        await _wait_http(router.metrics_url or "", 60, proc, log)
        envoy = EnvoyProcess(render_config(listen_port=listen, admin_port=admin, epp_port=grpc,
                                           response_processing=False), admin)
        router.stoppers.append(envoy.stop)
        await envoy.start()
    except BaseException:
        await router.stop()
        await fleet.stop()
        raise
    return fleet, router


async def _role_stats(session: aiohttp.ClientSession, fleet: SimFleet) -> dict[str, dict[str, float]]:
    roles: dict[str, dict[str, float]] = {}
    for d in fleet.info:
        async with session.get(f"http://{d['endpoint']}/sim/state") as resp:
            pd = (await resp.json())["pd"]
        row = roles.setdefault(pd["role"], {"replicas": 0})
        row["replicas"] += 1
        for key in ("prefill_legs", "decode_legs", "remote_tokens", "transfer_seconds", "load_failures"):
            row[key] = row.get(key, 0) + pd[key]
    return roles


async def _pd_decisions(session: aiohttp.ClientSession, url: str | None) -> dict[str, float]:
    if url is None:
        return {}
    async with session.get(url) as resp:
        text = await resp.text()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("epp_pd_decisions_total{"):
            label = line.split('decision="', 1)[1].split('"', 1)[0]
            out[label] = float(line.rsplit(" ", 1)[1])
    return out


async def run_topology(name: str, s: Settings, workdir: Path, progress: bool) -> TopologyResult:
    workdir.mkdir(parents=True, exist_ok=True)
    fleet, router = await start_stack(TOPOLOGIES[name], s, workdir)
    result = TopologyResult(name)
    issued = 0
    try:
        timeout = aiohttp.ClientTimeout(total=None)
        async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
            for i, rate in enumerate(s.rates):
                stage = Stage(s.stage_seconds, rate / s.time_scale)
                # Made before the stage, so building 8K-token prompts never delays sending or reading.
                count = int(stage.rate * stage.duration * 1.5) + 20
                batch = await asyncio.to_thread(long_prompts, s, count, issued)
                issued += count
                res = await run_stage(session, router.base_url, iter(batch), stage, i, seed=s.seed, drain=60.0,
                                      request_timeout=120.0, progress=progress)
                busy = max((r.sent + (r.e2e or 0.0) for r in res.records), default=res.started) - res.started
                load = summarize(name, rate, res.records, max(busy, s.stage_seconds), s)
                result.loads.append(load)
                print(f"  {name:13s} {rate:4g} req/s: TTFT p90 {_s(load.ttft_p90)}  ITL p99 {_s(load.itl_p99)}  "
                      f"{load.tokens_per_s_per_replica:7.1f} tok/s/replica  errors {load.errors}/{load.requests}",
                      flush=True)
            result.roles = await _role_stats(session, fleet)
            result.pd_decisions = await _pd_decisions(session, router.metrics_url)
    finally:
        await router.stop()
        await fleet.stop()
    return result


def _s(v: float | None) -> str:
    return "   -   " if v is None else f"{v * 1000:7.0f} ms" if v < 10 else f"{v:7.1f} s"


def crossover(results: list[TopologyResult]) -> dict[str, str]:
    """Per P/D topology, the loads where it beats 4 aggregated: on ITL p99, on TTFT p90, on both."""
    base = {load.rate: load for r in results if r.topology == "4 aggregated" for load in r.loads}
    out: dict[str, str] = {}
    for r in results:
        if r.topology == "4 aggregated" or not base:
            continue
        parts = []
        for what, test in (("ITL p99", _itl_better), ("TTFT p90", _ttft_better), ("both", _better)):
            wins = [load.rate for load in r.loads if load.rate in base and test(load, base[load.rate])]
            parts.append(f"{what}: " + (", ".join(f"{w:g}" for w in wins) + " req/s" if wins else "none"))
        out[r.topology] = "; ".join(parts)
    return out


def _comparable(pd: LoadResult, agg: LoadResult) -> bool:
    return pd.errors <= agg.errors and None not in (pd.ttft_p90, pd.itl_p99, agg.ttft_p90, agg.itl_p99)


def _itl_better(pd: LoadResult, agg: LoadResult) -> bool:
    return _comparable(pd, agg) and pd.itl_p99 < agg.itl_p99  # type: ignore[operator]


def _ttft_better(pd: LoadResult, agg: LoadResult) -> bool:
    return _comparable(pd, agg) and pd.ttft_p90 <= agg.ttft_p90  # type: ignore[operator]


def _better(pd: LoadResult, agg: LoadResult) -> bool:
    return _itl_better(pd, agg) and _ttft_better(pd, agg)


def report(results: list[TopologyResult], s: Settings, command: str, started: str, wall: float) -> str:
    lines = [
        "# P/D disaggregation vs aggregated serving (simulated H100, Llama-3.1-8B profile)", "",
        f"Command: `{command}`  ", f"Started {started}, {wall / 60:.1f} min wall.  ",
        f"Workload: unique prompts of {s.prompt_tokens} tokens, {s.output_tokens} output tokens, streamed; "
        f"open-loop Poisson; {s.stage_seconds:g} wall s per load; time scale {s.time_scale:g} "
        "(times below are simulated seconds).", "",
        "| topology | load (req/s) | requests | errors | TTFT p50 | TTFT p90 | ITL p50 | ITL p99 | out tok/s per replica |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        for load in r.loads:
            lines.append(f"| {r.topology} | {load.rate:g} | {load.requests} | {load.errors} | {_s(load.ttft_p50)} | "
                         f"{_s(load.ttft_p90)} | {_s(load.itl_p50)} | {_s(load.itl_p99)} | "
                         f"{load.tokens_per_s_per_replica:.1f} |")
    lines += ["", "Per role, over the whole run (from each replica's /sim/state; picker decisions from "
              "`epp_pd_decisions_total`):", "",
              "| topology | role | replicas | prefill legs | decode legs | KV tokens received | transfer s | failed loads |",
              "|---|---|---|---|---|---|---|---|"]
    for r in results:
        for role, row in sorted(r.roles.items()):
            lines.append(f"| {r.topology} | {role} | {row['replicas']:g} | {row['prefill_legs']:g} | "
                         f"{row['decode_legs']:g} | {row['remote_tokens']:.0f} | {row['transfer_seconds']:.2f} | "
                         f"{row['load_failures']:g} |")
        if r.pd_decisions:
            lines.append(f"| {r.topology} | picker | | {json.dumps(r.pd_decisions)} | | | | |")
    lines += ["", "Loads where P/D beats 4 aggregated (with no more errors), on ITL p99, TTFT p90 and both:", ""]
    lines += [f"- {name}: {text}" for name, text in crossover(results).items()]
    return "\n".join(lines) + "\n"


async def run(s: Settings, out: Path, command: str, progress: bool = True) -> str:
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    t0 = time.perf_counter()
    results = []
    for name in s.topologies:
        print(f"{name}:", flush=True)
        # Process logs go under raw/ (not kept in git).
        results.append(await run_topology(name, s, out / "raw" / name.replace(" ", "-"), progress))
    wall = time.perf_counter() - t0
    md = report(results, s, command, started, wall)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.md").write_text(md)
    (out / "results.json").write_text(json.dumps({"settings": asdict(s), "command": command, "started": started,
                                                  "wall_s": wall, "results": [asdict(r) for r in results]},
                                                 indent=1))
    return md


def rewrite_report(out: Path) -> str:
    """report.md again from results.json (same numbers; after a change to the report's layout)."""
    data = json.loads((out / "results.json").read_text())
    settings = data["settings"]
    s = Settings(**{**settings, "rates": tuple(settings["rates"]), "topologies": tuple(settings["topologies"])})
    results = [TopologyResult(r["topology"], [LoadResult(**load) for load in r["loads"]], r["roles"],
                              r["pd_decisions"]) for r in data["results"]]
    md = report(results, s, data["command"], data["started"], data["wall_s"])
    (out / "report.md").write_text(md)
    return md


__all__ = ["Settings", "TOPOLOGIES", "crossover", "long_prompts", "rewrite_report", "run"]
