"""`epp demo`: real Envoy + the picker + simulated vLLM replicas on loopback, and a short workload.

The same mixed workload (chat sessions sharing long system prompts, plus one-off prompts) runs
through the picker with approximate prefix routing (GIE defaults), with precise prefix routing
(from the replicas' KV events) and, for comparison, through Envoy round-robin, each on a fresh
fleet; the demo prints where requests went, the replicas' prefix-cache hit rates and latencies.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from tqdm import tqdm

from epp.config.compose import endpoint_picker_config, plugin
from epp.datalayer.promparse import parse_vllm_metrics
from epp.engine.sim.fleet import FleetConfig, SimFleet
from epp.engine.tinymodel import write_tiny_model
from epp.envoy import EnvoyProcess, render_config
from epp.netutil import free_ports

_WORDS = ("cache route replica token prompt model server latency queue block prefix request "
          "system user answer question table query index memory tier offload batch decode").split()


@dataclass
class DemoRequest:
    group: str
    body: dict


def build_workload(requests: int, groups: int, seed: int = 7) -> list[DemoRequest]:
    """Chat requests of `groups` tenants sharing a long system prompt each, and 1/5 one-off prompts."""
    rng = random.Random(seed)
    systems = [f"You are assistant {g}. " + " ".join(rng.choice(_WORDS) for _ in range(1200)) for g in range(groups)]
    out: list[DemoRequest] = []
    for i in range(requests):
        question = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(20, 60))) + f" #{i}?"
        if rng.random() < 0.2:
            out.append(DemoRequest("one-off", {"model": "sim-model", "prompt": question * 8, "max_tokens": 16}))
            continue
        g = rng.randrange(groups)
        out.append(DemoRequest(f"tenant-{g}", {
            "model": "sim-model", "max_tokens": 16, "stream": rng.random() < 0.5,
            "messages": [{"role": "system", "content": systems[g]}, {"role": "user", "content": question}]}))
    return out


@dataclass
class RunResult:
    label: str
    by_replica: dict[str, int] = field(default_factory=dict)
    by_group: dict[str, set[str]] = field(default_factory=dict)
    latencies: list[float] = field(default_factory=list)
    errors: int = 0
    hits: dict[str, float] = field(default_factory=dict)
    queries: dict[str, float] = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        q = sum(self.queries.values())
        return sum(self.hits.values()) / q if q else 0.0


async def _send(session: aiohttp.ClientSession, url: str, req: DemoRequest, result: RunResult) -> None:
    path = "/v1/chat/completions" if "messages" in req.body else "/v1/completions"
    t0 = time.perf_counter()
    try:
        async with session.post(url + path, json=req.body) as resp:
            await resp.read()
            if resp.status != 200:
                result.errors += 1
                return
            replica = resp.headers.get("x-sim-replica", "?")
    except aiohttp.ClientError:
        result.errors += 1
        return
    result.latencies.append(time.perf_counter() - t0)
    result.by_replica[replica] = result.by_replica.get(replica, 0) + 1
    result.by_group.setdefault(req.group, set()).add(replica)


async def _cache_counters(fleet: SimFleet) -> tuple[dict[str, float], dict[str, float]]:
    hits, queries = {}, {}
    async with aiohttp.ClientSession() as session:
        for info in fleet.info:
            async with session.get(f"http://{info['endpoint']}/metrics") as resp:
                page = parse_vllm_metrics(await resp.read())
            name = info.get("name", info["endpoint"])
            hits[name] = page.prefix_cache_hits or 0.0
            queries[name] = page.prefix_cache_queries or 0.0
    return hits, queries


async def _drive(label: str, url: str, workload: list[DemoRequest], concurrency: int,
                 fleet: SimFleet) -> RunResult:
    result = RunResult(label)
    queue: asyncio.Queue[DemoRequest] = asyncio.Queue()
    for req in workload:
        queue.put_nowait(req)
    bar = tqdm(total=len(workload), desc=f"{label:<22}", unit="req", leave=True)

    async def worker(session: aiohttp.ClientSession) -> None:
        while not queue.empty():
            await _send(session, url, queue.get_nowait(), result)
            bar.update(1)

    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
    bar.close()
    result.hits, result.queries = await _cache_counters(fleet)
    return result


async def _wait_ready(url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            with contextlib.suppress(aiohttp.ClientError):
                async with session.get(url) as resp:
                    if resp.status == 200:
                        return
            await asyncio.sleep(0.2)
    raise TimeoutError(f"{url} did not become ready")


def _fleet_config(replicas: int, tokenizer_dir: str) -> FleetConfig:
    # A GPU cache of ~6k tokens holds two or three tenants' system prompts, not all of them:
    # where requests land decides the hit rate, as on a real fleet.
    return FleetConfig(replicas=replicas, profile="h100-llama3-8b", num_gpu_blocks=400, processes=1,
                       tokenizer_dir=tokenizer_dir)


def precise_config(block_size: int, model: str, tokenizer_dir: str) -> str:
    """Precise prefix routing from the replicas' KV events, with GIE's load scorers and a prefix home."""
    return endpoint_picker_config(
        [plugin("precise-prefix-cache-producer", blockSizeTokens=block_size, tokenizers={model: tokenizer_dir}),
         "prefix-cache-scorer", "queue-scorer", "kv-cache-utilization-scorer", "prefix-home-scorer"],
        {"prefix-cache-scorer": 3, "prefix-home-scorer": 1, "queue-scorer": 2, "kv-cache-utilization-scorer": 2})


def _port_of(zmq_endpoint: str) -> str:
    return zmq_endpoint.rpartition(":")[2]


def _picker_args(fleet: SimFleet, precise: bool) -> list[str]:
    """`epp serve` arguments for a fleet: the GIE default config, or precise prefix routing from KV events."""
    if not precise:
        return ["--endpoints", fleet.endpoints_arg]
    endpoints = ",".join(
        f"{info['endpoint']}#kv-events-port={_port_of(info['kv_events_endpoint'])};"
        f"kv-replay-port={_port_of(info['kv_replay_endpoint'])}" for info in fleet.info)
    first = fleet.info[0]
    assert fleet.config.tokenizer_dir is not None  # the demo always gives its fleets a tokenizer
    config = precise_config(first["block_size"], first["model"], fleet.config.tokenizer_dir)
    return ["--endpoints", endpoints, "--config-text", config]


async def _run_with_picker(label: str, precise: bool, fleet_config: FleetConfig, workload: list[DemoRequest],
                           concurrency: int) -> RunResult:
    grpc, health, metrics, listen, admin = free_ports(5)
    async with SimFleet(fleet_config) as fleet:
        epp = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "epp.cli", "serve", "--grpc-port", str(grpc), "--grpc-health-port", str(health),
            "--metrics-port", str(metrics), "--bind-address", "127.0.0.1", *_picker_args(fleet, precise),
            stdout=asyncio.subprocess.DEVNULL, start_new_session=True)  # its start line; errors still show
        envoy = EnvoyProcess(render_config(listen_port=listen, admin_port=admin, epp_port=grpc), admin)
        try:
            await _wait_ready(f"http://127.0.0.1:{metrics}/metrics")
            await envoy.start()
            return await _drive(label, f"http://127.0.0.1:{listen}", workload, concurrency, fleet)
        finally:
            await envoy.stop()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(epp.pid, signal.SIGTERM)
            await epp.wait()


async def _run_round_robin(fleet_config: FleetConfig, workload: list[DemoRequest], concurrency: int) -> RunResult:
    listen, admin = free_ports(2)
    async with SimFleet(fleet_config) as fleet:
        envoy = EnvoyProcess(render_config(listen_port=listen, admin_port=admin,
                                           round_robin_backends=fleet.endpoints), admin)
        try:
            await envoy.start()
            return await _drive("Envoy round-robin", f"http://127.0.0.1:{listen}", workload, concurrency, fleet)
        finally:
            await envoy.stop()


def _report(results: list[RunResult], replicas: int) -> str:
    names = sorted({r for res in results for r in res.by_replica} | {n for res in results for n in res.queries})
    lines = ["", "Requests per replica (prefix-cache hit rate of that replica):", ""]
    header = "| replica | " + " | ".join(res.label for res in results) + " |"
    lines += [header, "|" + "---|" * (len(results) + 1)]
    for name in names:
        cells = []
        for res in results:
            q = res.queries.get(name, 0.0)
            rate = f"{res.hits.get(name, 0.0) / q:.0%}" if q else "-"
            cells.append(f"{res.by_replica.get(name, 0)} ({rate})")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "| | " + " | ".join(res.label for res in results) + " |", "|" + "---|" * (len(results) + 1)]

    def row(title: str, fn) -> str:
        return f"| {title} | " + " | ".join(fn(res) for res in results) + " |"

    lines.append(row("prefix-cache hit rate", lambda r: f"{r.hit_rate:.1%}"))
    lines.append(row("latency p50 (s)", lambda r: f"{statistics.median(r.latencies):.3f}" if r.latencies else "-"))
    lines.append(row("latency p90 (s)", lambda r: f"{sorted(r.latencies)[int(0.9 * len(r.latencies))]:.3f}"
                     if r.latencies else "-"))
    lines.append(row("replicas per tenant (mean)", lambda r: f"{statistics.fmean(len(v) for k, v in r.by_group.items() if k != 'one-off'):.1f}"
                     if r.by_group else "-"))
    lines.append(row("errors", lambda r: str(r.errors)))
    return "\n".join(lines)


def machine_note(cores: int, load_before: float, load_after: float, replicas: int) -> str:
    """What the latency rows are worth on this machine: everything the demo runs shares its cores."""
    note = (f"Latencies: Envoy, the picker, {replicas} simulated replicas and the client all ran on this machine's "
            f"{cores} core(s); load average {load_before:.1f} before the demo (others' work), "
            f"{load_after:.1f} at its end.")
    busy = load_before / cores if cores else float("inf")
    if cores < 4 or busy > 0.5:
        why = f"only {cores} core(s)" if cores < 4 else f"{load_before:.1f} runnable tasks on {cores} cores before it"
        note += (f"\nThis machine is too small or busy for the latency rows to mean much ({why}): the picker's "
                 "extra hop competes with the replicas for CPU here, which a real deployment does not; "
                 "read the routing and prefix-cache hit-rate rows.")
    return note


async def _demo(replicas: int, requests: int, concurrency: int, groups: int, tokenizer_dir: str) -> int:
    workload = build_workload(requests, groups)
    print(f"epp demo: {replicas} simulated vLLM replicas (H100 / Llama-3-8B latency profile), "
          f"{len(workload)} requests from {groups} tenants sharing long system prompts, concurrency {concurrency}")
    load_before = os.getloadavg()[0]
    fleet = _fleet_config(replicas, tokenizer_dir)
    results = [await _run_with_picker("picker: approx. prefix", False, fleet, workload, concurrency),
               await _run_with_picker("picker: precise prefix", True, fleet, workload, concurrency),
               await _run_round_robin(fleet, workload, concurrency)]
    print(_report(results, replicas))
    print("\n" + machine_note(os.cpu_count() or 1, load_before, os.getloadavg()[0], replicas))
    return 1 if any(res.errors for res in results) else 0


def run_demo(replicas: int = 4, requests: int = 200, concurrency: int = 8, short: bool = False) -> int:
    """Run the demo; Ctrl-C stops everything it started."""
    if short:
        requests, replicas = min(requests, 60), min(replicas, 3)
    groups = max(2, replicas * 2)
    # The replicas' tokenizer lives in a directory of this run's own, removed at the end: nothing is
    # left in /tmp, and demos of several users on one host do not share (or block) one directory.
    try:
        with tempfile.TemporaryDirectory(prefix="epp-demo-") as tmp:
            tokenizer_dir = str(write_tiny_model(Path(tmp) / "tokenizer", weights=False))
            return asyncio.run(_demo(replicas, requests, concurrency, groups, tokenizer_dir))
    except KeyboardInterrupt:
        print("\nepp demo: interrupted, everything it started has been stopped", file=sys.stderr)
        return 130


__all__ = ["build_workload", "machine_note", "precise_config", "run_demo"]
