"""Soak benchmark: hours-long habits in minutes. Steady mixed load through real Envoy and the picker.

The stack: simulated vLLM replicas (engine/sim, in a worker process) with small KV caches, so
blocks are stored and evicted all the time and the picker's precise index follows a stream of
BlockStored/BlockRemoved events; the picker (`epp serve`, precise prefix routing from those
events) behind real Envoy; an open-loop Poisson client sending a fixed mix of requests (shared
system prompts, growing chats, unique prompts) for `--duration` seconds.

Every `--window` seconds it samples the picker's and Envoy's RSS and open file descriptors and
the TTFT of the requests sent in that window, prints one progress line, and at the end checks:
- RSS: no growth after warm-up. A Theil-Sen line through the post-warm-up samples (robust: the
  median of pairwise slopes, so one spike or a GC pause does not move it) must rise less than
  `--max-rss-growth` (5 %) of the median RSS over that span.
- open fds: flat. The same robust line over the fd counts must rise by less than `--max-fd-growth`.
- TTFT: the p99 over the last `--compare` seconds within 10 % of the p99 over the first
  `--compare` seconds after warm-up.
- picker CPU per request (user+system time of its process over the requests sent), last
  `--compare` seconds within 10 % of the first: the picker's own cost, which machine contention
  (other processes on a shared host) moves far less than it moves latency.

    python bench/soak.py                                  # 30 minutes, the numbers in bench/README.md
    python bench/soak.py --duration 120 --warmup 40 --window 10 --compare 30   # the CI variant

Writes `bench/results/soak/soak.json` (every window and the verdicts) unless `--out` says otherwise.
Exit status 0 when every check passes, 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import signal
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp

if __package__ in (None, ""):  # run as `python bench/soak.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.routing.contenders import Tuning, epp_config  # noqa: E402
from bench.routing.loadgen import RequestRecord, send  # noqa: E402
from bench.routing.workloads import BenchRequest, MultiTurn, NoSharing, SharedPrefix  # noqa: E402
from epp.engine.sim.fleet import FleetConfig, SimFleet, default_tokenizer_dir  # noqa: E402
from epp.engine.sim.profiles import get_profile  # noqa: E402
from epp.envoy import EnvoyProcess, render_config  # noqa: E402
from epp.netutil import free_ports  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


@dataclass
class SoakConfig:
    """One soak run: how long, how hard, and the pass thresholds."""

    duration_s: float = 1800.0
    warmup_s: float = 300.0
    window_s: float = 30.0
    compare_s: float = 300.0
    rate: float = 6.0  # requests per second, Poisson arrivals
    replicas: int = 4
    gpu_blocks: int = 400  # per replica: small, so the fleet evicts (and announces it) all the time
    time_scale: float = 2.0
    request_timeout_s: float = 60.0
    max_rss_growth: float = 0.05
    max_fd_growth: float = 2.0
    max_ttft_drift: float = 0.10
    # The picker's tokenization cache is bounded by tokens (4M by default, ~100 MB, filling for
    # about an hour at this load); a soak judges growth once every bounded cache is full, so it
    # runs with a cache that fills during warm-up.
    tokenization_cache_tokens: int = 200_000
    seed: int = 7


@dataclass
class Window:
    """What one window saw: requests sent in it, their TTFTs, and the processes' resources at its end."""

    end_s: float
    sent: int = 0
    ok: int = 0
    failed: int = 0
    ttft_p50: float | None = None
    ttft_p99: float | None = None
    picker_rss_mb: float = 0.0
    picker_fds: int = 0
    envoy_rss_mb: float = 0.0
    envoy_fds: int = 0
    index_entries: float = 0.0
    events_applied: float = 0.0
    cached_tokens: float = 0.0
    picker_cpu_s: float = 0.0  # cumulative user+system CPU of the picker process
    picker_cpu_ms_per_req: float | None = None  # in this window
    schedule_sum_s: float = 0.0  # cumulative scheduler_e2e histogram sum and count
    schedule_count: float = 0.0
    schedule_mean_ms: float | None = None  # in this window
    errors: dict[str, int] = field(default_factory=dict)


@dataclass
class Check:
    """One verdict: the measured value, the limit, and whether it passed."""

    name: str
    value: float | None
    limit: float
    passed: bool
    detail: str


def theil_sen_slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Median of the pairwise slopes: a trend estimate that ignores up to ~29 % outliers."""
    slopes = [(ys[j] - ys[i]) / (xs[j] - xs[i])
              for i in range(len(xs)) for j in range(i + 1, len(xs)) if xs[j] != xs[i]]
    return statistics.median(slopes) if slopes else 0.0


def trend_growth(xs: Sequence[float], ys: Sequence[float]) -> float:
    """How much the robust trend line rises over the span of `xs` (in the units of `ys`)."""
    if len(xs) < 3:
        return 0.0
    return theil_sen_slope(xs, ys) * (max(xs) - min(xs))


def p99(values: Sequence[float]) -> float | None:
    """The 99th percentile (nearest rank), None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(0.99 * len(ordered)) - 1))]


def judge(config: SoakConfig, windows: Sequence[Window], records: Sequence[RequestRecord], t0: float) -> list[Check]:
    """The three soak verdicts over the post-warm-up windows and requests."""
    steady = [w for w in windows if w.end_s > config.warmup_s]
    checks = []
    xs = [w.end_s for w in steady]
    rss = [w.picker_rss_mb for w in steady]
    if len(steady) >= 3:
        base = statistics.median(rss)
        growth = trend_growth(xs, rss) / base
        checks.append(Check("picker RSS growth after warm-up", growth, config.max_rss_growth,
                            growth < config.max_rss_growth,
                            f"Theil-Sen over {len(steady)} samples: {growth:+.2%} of {base:.1f} MB "
                            f"(first {rss[0]:.1f} MB, last {rss[-1]:.1f} MB)"))
        # The picker's own fds only: Envoy's follow its upstream connection pools, which grow and
        # shrink with the number of requests in flight (reported in the table, not judged).
        fds = [w.picker_fds for w in steady]
        rise = trend_growth(xs, fds)
        checks.append(Check("picker open fds flat", rise, config.max_fd_growth, rise < config.max_fd_growth,
                            f"trend {rise:+.1f} fds over the run (min {min(fds)}, max {max(fds)})"))
    else:
        checks.append(Check("enough post-warm-up samples", len(steady), 3, False,
                            "run longer or use shorter windows"))
    # The picker's own cost per request, which machine contention moves far less than latency:
    # a structure that grows and slows the picker down shows here even when TTFT is noisy.
    first_w = [w for w in steady if w.end_s <= config.warmup_s + config.compare_s]
    last_w = [w for w in steady if w.end_s > config.duration_s - config.compare_s]
    cpu_first, cpu_last = _cpu_per_request(first_w, windows), _cpu_per_request(last_w, windows)
    if cpu_first and cpu_last:
        drift = cpu_last / cpu_first - 1
        checks.append(Check("picker CPU per request last vs first compare span", drift, config.max_ttft_drift,
                            drift <= config.max_ttft_drift,
                            f"first {cpu_first:.2f} ms, last {cpu_last:.2f} ms: {drift:+.1%}"))
    start = t0 + config.warmup_s
    end = t0 + config.duration_s
    first = [r.ttft for r in records if r.ttft is not None and start <= r.sent < start + config.compare_s]
    last = [r.ttft for r in records if r.ttft is not None and end - config.compare_s <= r.sent < end]
    p_first, p_last = p99(first), p99(last)
    if p_first and p_last:
        drift = p_last / p_first - 1
        checks.append(Check("TTFT p99 last vs first compare span", drift, config.max_ttft_drift,
                            drift <= config.max_ttft_drift,
                            f"first {p_first * 1000:.1f} ms ({len(first)} req), last {p_last * 1000:.1f} ms "
                            f"({len(last)} req): {drift:+.1%}"))
    else:
        checks.append(Check("TTFT p99 last vs first compare span", None, config.max_ttft_drift, False,
                            "no completed requests in a compare span"))
    return checks


def _cpu_per_request(span: Sequence[Window], windows: Sequence[Window]) -> float | None:
    """Picker CPU milliseconds per request sent over consecutive windows `span`."""
    if not span:
        return None
    before = windows.index(span[0]) - 1
    cpu0 = windows[before].picker_cpu_s if before >= 0 else None
    if cpu0 is None:
        return None
    sent = sum(w.sent for w in span)
    return (span[-1].picker_cpu_s - cpu0) / sent * 1000 if sent else None


def proc_rss_mb(pid: int) -> float:
    """Resident set size of a process, from /proc (MB)."""
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def proc_cpu_seconds(pid: int) -> float:
    """User plus system CPU time a process has used, from /proc (seconds)."""
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def proc_fds(pid: int) -> int:
    """Open file descriptors of a process."""
    return len(os.listdir(f"/proc/{pid}/fd"))


async def picker_samples(session: aiohttp.ClientSession, url: str | None) -> dict[str, float]:
    """The picker's KV index size, events applied, cache size and scheduling time, from its /metrics page."""
    wanted = ("epp_kv_index_entries", "epp_kv_index_events_applied_total", "epp_tokenization_cache_tokens",
              "inference_extension_scheduler_e2e_duration_seconds_sum",
              "inference_extension_scheduler_e2e_duration_seconds_count")
    found: dict[str, float] = {}
    if url is None:
        return found
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=5)) as resp:
            text = await resp.text()
    except (aiohttp.ClientError, TimeoutError):
        return found
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in wanted:
            found[name] = float(value)
    return found


def tuning_of(config: SoakConfig) -> Tuning:
    """Model knobs of the simulated replicas, for the picker's configuration."""
    profile = get_profile("h100-llama3-8b")
    return Tuning(default_tokenizer_dir(), profile.block_size, profile.prefill_per_token * config.time_scale, 600)


def soak_picker_config(tuning: Tuning, cache_tokens: int) -> str:
    """The routing benchmark's `epp-precise` configuration, with the tokenization cache bounded at `cache_tokens`."""
    base = epp_config("precise", tuning)
    anchor = "    mode: per-endpoint\n"
    assert anchor in base, "the epp-precise configuration changed shape"
    return base.replace(anchor, anchor + f"    tokenizationCacheTokens: {cache_tokens}\n", 1)


class Stack:
    """The picker (`epp serve`, its own process) behind real Envoy, in front of a simulated fleet."""

    def __init__(self, fleet: SimFleet, config_text: str, workdir: Path) -> None:
        self.fleet, self.config_text, self.workdir = fleet, config_text, workdir
        self.picker: asyncio.subprocess.Process | None = None
        self.envoy: EnvoyProcess | None = None
        self.base_url = ""
        self.metrics_url = ""

    async def start(self) -> None:
        grpc, health, metrics, listen, admin = free_ports(5)
        endpoints = []
        for d in self.fleet.info:  # the replicas' KV-event and replay ports, as endpoint labels
            labels = [f"{label}={d[key].rpartition(':')[2]}"
                      for label, key in (("kv-events-port", "kv_events_endpoint"), ("kv-replay-port", "kv_replay_endpoint"))
                      if d.get(key)]
            endpoints.append(d["endpoint"] + ("#" + ";".join(labels) if labels else ""))
        self.workdir.mkdir(parents=True, exist_ok=True)
        with open(self.workdir / "epp.log", "wb") as log:
            self.picker = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "epp.cli", "serve", "--grpc-port", str(grpc), "--grpc-health-port", str(health),
                "--metrics-port", str(metrics), "--bind-address", "127.0.0.1", "--config-text", self.config_text,
                "--endpoints", ",".join(endpoints), stdout=log, stderr=log, stdin=asyncio.subprocess.DEVNULL)
        self.metrics_url = f"http://127.0.0.1:{metrics}/metrics"
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
            for _ in range(300):
                if self.picker.returncode is not None:
                    raise RuntimeError(f"the picker exited with {self.picker.returncode}; see {self.workdir}/epp.log")
                try:
                    async with session.get(self.metrics_url) as resp:
                        if resp.status == 200:
                            break
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.2)
            else:
                raise RuntimeError("the picker did not come up in 60 s")
        self.envoy = EnvoyProcess(render_config(listen_port=listen, admin_port=admin, epp_port=grpc), admin)
        await self.envoy.start()
        self.base_url = f"http://127.0.0.1:{listen}"

    @property
    def pids(self) -> tuple[int, int]:
        """(picker pid, Envoy pid)."""
        assert self.picker is not None and self.envoy is not None and self.envoy.process is not None
        return self.picker.pid, self.envoy.process.pid

    async def stop(self) -> None:
        if self.envoy is not None:
            await self.envoy.stop()
        if self.picker is not None and self.picker.returncode is None:
            self.picker.terminate()
            try:
                await asyncio.wait_for(self.picker.wait(), 10)
            except TimeoutError:
                self.picker.kill()
                await self.picker.wait()


def mixed_requests(tokenizer_dir: str, seed: int) -> Iterator[BenchRequest]:
    """Half shared system prompts, a third growing chats, the rest unique prompts (they drive evictions)."""
    shared = SharedPrefix(groups=8, users=4, system_tokens=1024, question_tokens=128, output_tokens=16,
                          seed=seed).requests(tokenizer_dir)
    chats = MultiTurn(sessions=16, active=6, turns=5, system_tokens=256, user_tokens=64, answer_tokens=64,
                      output_tokens=16, seed=seed + 1).requests(tokenizer_dir)
    unique = NoSharing(prompt_tokens=768, output_tokens=16, seed=seed + 2).requests(tokenizer_dir)
    rng = random.Random(seed)
    while True:
        x = rng.random()
        yield next(shared) if x < 0.5 else next(chats) if x < 0.83 else next(unique)


def _fmt_num(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def _fmt_ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f}ms"


class Soak:
    """Starts the stack, drives the load, samples every window, judges at the end."""

    def __init__(self, config: SoakConfig, workdir: Path, progress: bool = True) -> None:
        self.config = config
        self.workdir = workdir
        self.progress = progress
        self.windows: list[Window] = []
        self.records: list[RequestRecord] = []
        self._metrics_url: str | None = None
        self._t0 = 0.0
        self._cpu_at_start = 0.0

    def _say(self, text: str) -> None:
        if self.progress:
            print(text, flush=True)

    async def run(self) -> list[Check]:
        """The whole soak; returns the verdicts (the windows stay in `self.windows`)."""
        cfg = self.config
        tokenizer_dir = default_tokenizer_dir()
        config_text = soak_picker_config(tuning_of(cfg), cfg.tokenization_cache_tokens)
        fleet = SimFleet(FleetConfig(replicas=cfg.replicas, profile="h100-llama3-8b", num_gpu_blocks=cfg.gpu_blocks,
                                     time_scale=cfg.time_scale, processes=1), tokenizer_dir=tokenizer_dir)
        requests = mixed_requests(tokenizer_dir, cfg.seed)
        first = next(requests)  # builds the prompts before the clock starts
        requests = itertools.chain([first], requests)
        self.workdir.mkdir(parents=True, exist_ok=True)
        await fleet.start()
        stack = Stack(fleet, config_text, self.workdir)
        try:
            await stack.start()
            picker_pid, envoy_pid = stack.pids
            self._metrics_url = stack.metrics_url
            self._say(f"soak: {cfg.duration_s:.0f}s at {cfg.rate:g} req/s through Envoy (pid {envoy_pid}) and "
                      f"the picker (pid {picker_pid}), {cfg.replicas} simulated replicas of {cfg.gpu_blocks} blocks; "
                      f"warm-up {cfg.warmup_s:.0f}s, window {cfg.window_s:.0f}s")
            connector = aiohttp.TCPConnector(limit=0)
            async with aiohttp.ClientSession(connector=connector,
                                             timeout=aiohttp.ClientTimeout(total=None, sock_connect=10)) as session:
                await self._drive(session, stack.base_url, requests, picker_pid, envoy_pid)
        finally:
            await stack.stop()
            await fleet.stop()
        return judge(cfg, self.windows, self.records, self._t0)

    async def _drive(self, session: aiohttp.ClientSession, url: str, requests: Iterator[BenchRequest],
                     picker_pid: int, envoy_pid: int) -> None:
        cfg = self.config
        rng = random.Random(cfg.seed)
        tasks: set[asyncio.Task] = set()
        self._cpu_at_start = proc_cpu_seconds(picker_pid)
        self._t0 = t0 = time.perf_counter()
        next_send = t0
        next_window = t0 + cfg.window_s
        window_start = 0
        end = t0 + cfg.duration_s
        while True:
            now = time.perf_counter()
            if now >= next_window:
                await self._close_window(next_window - t0, window_start, picker_pid, envoy_pid)
                window_start = len(self.records)
                next_window += cfg.window_s
                if next_window > end + 1e-6:
                    break
                continue
            if next_send <= now:
                record = RequestRecord(stage=len(self.windows), group="", sent=0.0)
                req = next(requests)
                record.group = req.group
                self.records.append(record)
                task = asyncio.ensure_future(send(session, url, req, record, cfg.request_timeout_s))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                next_send += rng.expovariate(cfg.rate)
                continue
            await asyncio.sleep(min(next_send, next_window) - now)
        if tasks:  # stragglers finish (or time out) before the stack goes down
            await asyncio.wait(set(tasks), timeout=cfg.request_timeout_s)
        self._settle(len(self.windows) - 1)

    async def _close_window(self, end_s: float, first: int, picker_pid: int, envoy_pid: int) -> None:
        w = Window(end_s=end_s, sent=len(self.records) - first)
        w.picker_rss_mb, w.picker_fds = proc_rss_mb(picker_pid), proc_fds(picker_pid)
        w.envoy_rss_mb, w.envoy_fds = proc_rss_mb(envoy_pid), proc_fds(envoy_pid)
        async with aiohttp.ClientSession() as scrape:
            sample = await picker_samples(scrape, self._metrics_url)
        w.index_entries = sample.get("epp_kv_index_entries", 0.0)
        w.events_applied = sample.get("epp_kv_index_events_applied_total", 0.0)
        w.cached_tokens = sample.get("epp_tokenization_cache_tokens", 0.0)
        w.picker_cpu_s = proc_cpu_seconds(picker_pid)
        w.schedule_sum_s = sample.get("inference_extension_scheduler_e2e_duration_seconds_sum", 0.0)
        w.schedule_count = sample.get("inference_extension_scheduler_e2e_duration_seconds_count", 0.0)
        prev = self.windows[-1] if self.windows else Window(end_s=0.0, picker_cpu_s=self._cpu_at_start)
        if w.sent:
            w.picker_cpu_ms_per_req = (w.picker_cpu_s - prev.picker_cpu_s) / w.sent * 1000
        if w.schedule_count > prev.schedule_count:
            w.schedule_mean_ms = ((w.schedule_sum_s - prev.schedule_sum_s)
                                  / (w.schedule_count - prev.schedule_count) * 1000)
        if self.windows:  # the previous window's requests have had a whole window to finish
            self._settle(len(self.windows) - 1)
        self.windows.append(w)

    def _settle(self, index: int) -> None:
        """Fill in the outcomes and TTFTs of the requests sent in window `index`, print its line."""
        w = self.windows[index]
        settled = [r for r in self.records if r.stage == index]
        w.ok = sum(1 for r in settled if r.ttft is not None and r.error is None)
        w.failed = sum(1 for r in settled if r.error is not None)
        for r in settled:
            if r.error is not None:
                w.errors[r.error] = w.errors.get(r.error, 0) + 1
        ttfts = [r.ttft for r in settled if r.ttft is not None]
        w.ttft_p50 = statistics.median(ttfts) if ttfts else None
        w.ttft_p99 = p99(ttfts)
        self._say(f"[{w.end_s:6.0f}s] sent {w.sent:4d} ok {w.ok:4d} failed {w.failed:3d} | "
                  f"ttft p50 {_fmt_ms(w.ttft_p50):>6} p99 {_fmt_ms(w.ttft_p99):>6} | picker rss "
                  f"{w.picker_rss_mb:6.1f}MB fds {w.picker_fds:3d} | envoy rss {w.envoy_rss_mb:6.1f}MB "
                  f"fds {w.envoy_fds:3d} | index {w.index_entries:6.0f} entries, {w.events_applied:8.0f} events, "
                  f"{w.cached_tokens:7.0f} cached tokens | picker cpu {_fmt_num(w.picker_cpu_ms_per_req)}ms/req, "
                  f"schedule {_fmt_num(w.schedule_mean_ms)}ms"
                  + (" (warm-up)" if w.end_s <= self.config.warmup_s else ""))


async def run_soak(config: SoakConfig, workdir: Path, progress: bool = True) -> tuple[list[Check], Soak]:
    """Run one soak; returns the verdicts and the Soak (windows, records)."""
    soak = Soak(config, workdir, progress)
    checks = await soak.run()
    return checks, soak


def render_table(soak: Soak, checks: Sequence[Check]) -> str:
    """A markdown table of the windows and the verdicts."""
    lines = ["| t (s) | sent | ok | failed | TTFT p50 | TTFT p99 | picker RSS MB | picker fds | envoy RSS MB | envoy fds "
             "| index entries | KV events applied | tokenization cache tokens | picker CPU ms/req | schedule ms |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for w in soak.windows:
        lines.append(f"| {w.end_s:.0f} | {w.sent} | {w.ok} | {w.failed} | {_fmt_ms(w.ttft_p50)} | "
                     f"{_fmt_ms(w.ttft_p99)} | {w.picker_rss_mb:.1f} | {w.picker_fds} | {w.envoy_rss_mb:.1f} | "
                     f"{w.envoy_fds} | {w.index_entries:.0f} | {w.events_applied:.0f} | {w.cached_tokens:.0f} | "
                     f"{_fmt_num(w.picker_cpu_ms_per_req)} | {_fmt_num(w.schedule_mean_ms)} |")
    lines += ["", "| check | result | limit | verdict |", "|---|---|---:|---|"]
    for c in checks:
        lines.append(f"| {c.name} | {c.detail} | {c.limit:g} | {'pass' if c.passed else 'FAIL'} |")
    return "\n".join(lines)


async def _until_signal(work):
    """Run `work`; SIGTERM or SIGINT (also in a background job, where SIGINT starts ignored) stop the
    stack cleanly instead of leaving the picker, Envoy and the fleet behind."""
    task = asyncio.ensure_future(work)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, task.cancel)
    return await task


def main(argv: Sequence[str] | None = None) -> int:
    """CLI: run the soak, print the table, write the JSON, exit 1 on a failed check."""
    d = SoakConfig()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--duration", type=float, default=d.duration_s, help="seconds of load")
    p.add_argument("--warmup", type=float, default=d.warmup_s, help="seconds excluded from the trend checks")
    p.add_argument("--window", type=float, default=d.window_s, help="seconds per sample")
    p.add_argument("--compare", type=float, default=d.compare_s, help="length of the first/last TTFT spans")
    p.add_argument("--rate", type=float, default=d.rate, help="requests per second")
    p.add_argument("--replicas", type=int, default=d.replicas)
    p.add_argument("--gpu-blocks", type=int, default=d.gpu_blocks, help="KV blocks per simulated replica")
    p.add_argument("--tokenization-cache-tokens", type=int, default=d.tokenization_cache_tokens,
                   help="the picker's tokenization cache bound (fills during warm-up at the default rate)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "soak")
    args = p.parse_args(argv)
    config = SoakConfig(duration_s=args.duration, warmup_s=args.warmup, window_s=args.window,
                        compare_s=args.compare, rate=args.rate, replicas=args.replicas, gpu_blocks=args.gpu_blocks,
                        tokenization_cache_tokens=args.tokenization_cache_tokens, seed=args.seed)
    try:
        checks, soak = asyncio.run(_until_signal(run_soak(config, args.out / "raw")))  # process logs: ignored by git
    except asyncio.CancelledError:
        print("soak: stopped by a signal; the stack is down", file=sys.stderr)
        return 130
    table = render_table(soak, checks)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "soak.json").write_text(json.dumps({
        "config": asdict(config), "command": " ".join(["python", "bench/soak.py", *(argv or sys.argv[1:])]),
        "windows": [asdict(w) for w in soak.windows], "checks": [asdict(c) for c in checks]}, indent=1))
    return 0 if all(c.passed for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
