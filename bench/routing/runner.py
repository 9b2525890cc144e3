"""Run a scenario: for every contender a fresh fleet, the router, the stages, the measurements.

Every contender gets its own fleet (cold caches, zeroed counters) and the same trace: the
workload iterator and the arrival times are seeded, so open-loop runs send the same requests
at the same offsets to every router. Between stages the harness waits for in-flight requests
(bounded by the scenario's drain time) and reads the replicas' counters, so each stage's cache
hit rate is a clean delta; in a continuous ramp (`Scenario.continuous`) it does not wait, the
counters are read at each stage's end while requests are still running (so a stage's hit rate
mixes in its predecessor's stragglers), and only the last stage drains.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import aiohttp

from bench.routing.contenders import (
    Contender,
    RunningRouter,
    Tuning,
    Unavailable,
    start_contender,
)
from bench.routing.experiments import lookup
from bench.routing.loadgen import RequestRecord, StageResult, build_ahead, drain_inflight, run_stage
from bench.routing.measure import CpuMeter, scrape_fleet
from bench.routing.oracle import oracle_hits
from bench.routing.scenarios import Scenario
from bench.routing.summary import ContenderResult, StageSummary, request_samples, summarize
from bench.routing.ttft_floor import capacity_reusable, reusable_tokens
from bench.routing.validity import check
from bench.routing.workloads import BenchRequest
from epp.engine.sim.fleet import FleetConfig, SimFleet, default_tokenizer_dir
from epp.engine.sim.profiles import get_profile


def _busy_span(result: StageResult) -> float:
    """From the stage's start to its last completion (the window its tokens were produced in)."""
    ends = [r.sent + r.e2e for r in result.records if r.e2e is not None]
    return (max(ends) if ends else result.issued_until) - result.started


def tuning_for(scenario: Scenario) -> Tuning:
    """Model knobs for contenders that need them (tokenizer, block size, prefill cost)."""
    return fleet_tuning(scenario.fleet, scenario.workload.mean_prompt_tokens())


def fleet_tuning(fleet: FleetConfig, mean_prompt_tokens: int) -> Tuning:
    """What an operator of `fleet` knows of its engines (tokenizer, block size, lengths, KV size) as contender knobs."""
    profile = get_profile(fleet.profile)
    block_size = fleet.block_size or profile.block_size
    return Tuning(tokenizer_dir=fleet.tokenizer_dir or default_tokenizer_dir(),
                  block_size=block_size,
                  prefill_s_per_token=profile.prefill_per_token * fleet.time_scale,
                  mean_prompt_tokens=mean_prompt_tokens,
                  max_model_len=fleet.max_model_len or profile.max_model_len,
                  chunk_tokens=fleet.max_num_batched_tokens or profile.max_num_batched_tokens,
                  # Like vLLM's BlockPool, one block is the reserved null block.
                  kv_capacity_tokens=((fleet.num_gpu_blocks or profile.num_gpu_blocks) - 1) * block_size)


async def run_contender(scenario: Scenario, contender: Contender, workdir: Path, *, progress: bool = True,
                        raw_dir: Path | None = None) -> ContenderResult:
    """One contender through every stage of `scenario` on a fresh simulated fleet."""
    return await run_contender_on(scenario, contender, None, workdir, progress=progress, raw_dir=raw_dir)


async def run_contender_on(scenario: Scenario, contender: Contender, fleet: Any, workdir: Path, *,
                           progress: bool = True, raw_dir: Path | None = None,
                           stage_hook: Callable[[int, str], Awaitable[None]] | None = None,
                           before_stop: Callable[[RunningRouter], Awaitable[None]] | None = None) -> ContenderResult:
    """One contender through `scenario` on `fleet` (anything with `endpoints` and `info`, left running),
    or on a fresh simulated fleet when `fleet` is None; the result carries its validity check.
    `stage_hook(i, "start" | "end")` is awaited around stage i (what the caller measures per stage);
    `before_stop(router)` after the last stage, while the router still runs (what the caller reads from it)."""
    result = ContenderResult(contender.name, contender.description)
    tuning = tuning_for(scenario)
    requests = build_ahead(scenario.workload.requests(tuning.tokenizer_dir), list(scenario.stages))
    first = next(requests)
    requests = _chain(first, requests)
    workdir.mkdir(parents=True, exist_ok=True)
    own_fleet = fleet is None
    if own_fleet:
        fleet = SimFleet(scenario.fleet, tokenizer_dir=tuning.tokenizer_dir, **contender.fleet_options)
        with _stderr_to(workdir / f"{contender.name}-fleet.log"):
            await fleet.start()
    elif any(getattr(fleet, "options", {}).get(k, object()) != v for k, v in contender.fleet_options.items()):
        result.status = f"unavailable: needs fleet options {contender.fleet_options} a running fleet cannot take"
        return result
    router: RunningRouter | None = None
    try:
        try:
            router = await start_contender(contender, fleet, tuning, workdir / contender.name)
        except Unavailable as exc:
            result.status = f"unavailable: {exc}"
            return result
        result.version = router.version
        result.flags = router.flags + "".join(f"; fleet {k}={v!r}" for k, v in contender.fleet_options.items())
        fleet_pids = getattr(fleet, "pids", None) or [p.pid for p in getattr(fleet, "_procs", [])]
        meter = CpuMeter({"router": router.pids, "fleet": fleet_pids})
        issued: list[BenchRequest] = []
        stage_results: list[tuple[StageResult, tuple, dict]] = []
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
            if not await _probe(session, router.base_url, first):
                result.status = "failed: the router did not serve a probe request"
                return result
            async with aiohttp.ClientSession() as scrape:
                before = await scrape_fleet(scrape, fleet.info)
                start_counters = before
                meter.sample()
                inflight: set[asyncio.Task] | None = set() if scenario.continuous else None
                for i, stage in enumerate(scenario.stages):
                    if stage_hook is not None:
                        await stage_hook(i, "start")
                    sr = await run_stage(session, router.base_url, requests, stage, i, drain=scenario.drain,
                                         request_timeout=scenario.request_timeout, progress=progress,
                                         issued=issued, inflight=inflight, objectives=scenario.objectives)
                    if inflight is not None and i == len(scenario.stages) - 1:
                        await drain_inflight(inflight, [r for s, _, _ in stage_results for r in s.records]
                                             + sr.records, scenario.drain)
                        sr.finished = time.perf_counter()
                    if stage_hook is not None:
                        await stage_hook(i, "end")
                    cpu = meter.sample()
                    after = await scrape_fleet(scrape, fleet.info)
                    stage_results.append((sr, (before, after), cpu))
                    before = after
                if router.metrics_url:
                    result.router_metrics = await _router_metrics(scrape, router.metrics_url)
                if before_stop is not None:
                    await before_stop(router)
        oracle = oracle_hits(issued, block_size=tuning.block_size, capacity_blocks=scenario.capacity_blocks,
                             tokenizer_dir=tuning.tokenizer_dir)
        sends = [rec.sent for sr, _, _ in stage_results for rec in sr.records]
        if sends and len(sends) == len(issued):
            reusable = await asyncio.to_thread(reusable_tokens, issued, tuning.block_size, tuning.tokenizer_dir)
            blocks = scenario.fleet.num_gpu_blocks or get_profile(scenario.fleet.profile).num_gpu_blocks
            bounded = await asyncio.to_thread(capacity_reusable, issued, scenario.fleet.replicas, blocks,
                                              tuning.block_size, tuning.tokenizer_dir)
            result.floor_requests = [(at - min(sends), n, hit, capped)
                                     for at, (n, hit), (_, capped) in zip(sends, reusable, bounded)]
        offset = 0
        all_records: list[RequestRecord] = []
        total_seconds = 0.0
        cpu_sum: Counter = Counter()
        for sr, counters, cpu in stage_results:
            n = len(sr.records)
            span = _busy_span(sr)
            total_seconds += span
            for k, v in cpu.items():
                cpu_sum[k] += v * (sr.finished - sr.started)
            result.stages.append(summarize(sr.stage.label, sr.stage.rate or None, sr.records, span, counters,
                                           oracle.rate(range(offset, offset + n)), cpu))
            offset += n
            all_records.extend(sr.records)
        wall = sum(sr.finished - sr.started for sr, _, _ in stage_results) or 1e-9
        result.overall = summarize("all stages", None, all_records, total_seconds,
                                   (start_counters, stage_results[-1][1][1]) if stage_results else None,
                                   oracle.rate(), {k: v / wall for k, v in cpu_sum.items()})
        result.samples = request_samples(all_records)
        if raw_dir is not None:
            await asyncio.to_thread(_write_raw, raw_dir / f"{contender.name}.jsonl", all_records)
        verdict = check(contender, result)
        result.verdict, result.validity = verdict.verdict, verdict.detail
        return result
    finally:
        if router is not None:
            await router.stop()
        if own_fleet:
            await fleet.stop()


# Router-side counters that tell whether a cache-aware router's index saw the replicas' caches.
_ROUTER_SERIES = ("kv_placement_lookups_total", "kv_routing_inputs_total", "prefix_routing_decisions_total",
                  "vllm_router_policy_decisions_total", "smg_worker_selection_total",
                  "epp_kv_index_lookup_hit_blocks_total", "epp_kv_index_lookup_miss_blocks_total",
                  "epp_kv_index_events_applied_total", "epp_kv_events_sequence_gaps_total",
                  "epp_ttft_calibration{", "epp_tpot_calibration{", "epp_flow_control_longest_wait_seconds",
                  "epp_flow_control_slo_shed_total", "epp_peer_decision_staleness_seconds_count",
                  "epp_peer_decision_staleness_seconds_sum", 'epp_peer_decision_staleness_seconds_bucket{le="0.01"}',
                  'epp_peer_decision_staleness_seconds_bucket{le="0.002"}', 'epp_peer_decision_staleness_seconds_bucket{le="0.005"}',
                  'epp_peer_decision_staleness_seconds_bucket{le="0.1"}',
                  "epp_worker_requests{",  # how the streams spread over `--workers` processes
                  "epp_metrics_scrapes_total{", "epp_metrics_peer_scrapes_total{",  # shared scraping
                  "inference_extension_scheduler_e2e_duration_seconds_sum",  # the picker's own time per pick
                  "inference_extension_scheduler_e2e_duration_seconds_count",
                  "inference_extension_scheduler_e2e_duration_seconds_bucket",  # its distribution
                  "inference_extension_plugin_duration_seconds_sum",  # where a pick's time goes, per plugin
                  "inference_extension_plugin_duration_seconds_count")


async def _router_metrics(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """Samples of the router's own metrics that describe its cache index (empty when unreachable)."""
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=5)) as resp:
            text = await resp.text()
    except (TimeoutError, aiohttp.ClientError):
        return {}
    out = {}
    for line in text.splitlines():
        if line.startswith("#") or not any(k in line for k in _ROUTER_SERIES):
            continue
        name, _, value = line.rpartition(" ")
        try:
            out[name] = float(value)
        except ValueError:
            continue
    return out


def _write_raw(path: Path, records: list[RequestRecord]) -> None:
    """Per-request records as JSON lines (kept out of git)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        fh.writelines(json.dumps(asdict(rec)) + "\n" for rec in records)


@contextlib.contextmanager
def _stderr_to(path: Path) -> Iterator[None]:
    """Point fd 2 at `path` while child processes are spawned, so they inherit it, then restore it."""
    sys.stderr.flush()
    saved = os.dup(2)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.dup2(fd, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(fd)


def _chain(first: BenchRequest, rest: Iterator[BenchRequest]) -> Iterator[BenchRequest]:
    yield first
    yield from rest


async def _probe(session: aiohttp.ClientSession, base_url: str, req: BenchRequest) -> bool:
    """One short request through the router before the clock starts (also warms connections)."""
    body = {"model": req.body["model"], "prompt": "probe", "max_tokens": 1}
    for _ in range(20):
        try:
            async with session.post(base_url + "/v1/completions", json=body,
                                    timeout=aiohttp.ClientTimeout(total=10)) as resp:
                await resp.read()
                if resp.status == 200:
                    return True
        except (TimeoutError, aiohttp.ClientError):
            pass
        await asyncio.sleep(0.5)
    return False


async def run_scenario(scenario: Scenario, contenders: list[str], out_dir: Path, *, progress: bool = True,
                       keep_raw: bool = True, epp_args: tuple[str, ...] = ()) -> list[ContenderResult]:
    """Every contender in turn (`epp_args` added to each epp one's `epp serve`); one line per contender as it ends."""
    results = []
    workdir = out_dir / "logs"
    for name in contenders:
        c = lookup(name)
        if c.kind == "epp" and epp_args:
            c = replace(c, serve_args=c.serve_args + epp_args)
        t0 = time.perf_counter()
        if progress:
            print(f"[{scenario.name}/{scenario.scale}] {name}: {c.description}", flush=True)
        try:
            res = await run_contender(scenario, c, workdir, progress=progress,
                                      raw_dir=out_dir / "raw" if keep_raw else None)
        except Exception as exc:  # noqa: BLE001 - one broken contender must not lose the others' results
            res = ContenderResult(name, c.description, status=f"failed: {type(exc).__name__}: {exc}")
        results.append(res)
        if progress:
            o = res.overall
            line = (f"  -> {res.status}" if o is None else
                    f"  -> {o.ok}/{o.requests} ok, {o.output_tokens_per_s:.0f} tok/s, TTFT p90 "
                    f"{_fmt_s(o.ttft_p90)}, hit {_fmt_pct(o.hit_rate)} (oracle {_fmt_pct(o.oracle_hit_rate)}); "
                    f"{res.verdict}: {res.validity}")
            print(f"{line}  [{time.perf_counter() - t0:.0f}s]", flush=True)
    return results


def _fmt_s(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}s"


def _fmt_pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.1%}"


__all__ = ["ContenderResult", "StageSummary", "run_contender", "run_contender_on", "run_scenario", "summarize",
           "tuning_for"]
