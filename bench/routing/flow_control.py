"""Flow control under overload: `python -m bench.routing.flow_control [--load-seconds S] [--out DIR]`.

Simulated replicas behind real Envoy and our picker, run twice on fresh fleets: flow control
off (GIE's default: everything goes on to the replicas, where it waits in vLLM's queue) and on
(the picker holds requests by priority band and tenant). Per run:

1. the fleet's capacity C, from the latency profile: batch slots (replicas x max_num_seqs) over
   one request's simulated service time (a prefill step, then one decode step per output token
   with a full batch), in wall seconds; on a busy machine the simulator falls behind the wall
   clock, so the real capacity can only be lower and the overload only higher;
2. idle: `idle_requests` interactive requests one after the other (nothing else running), for the
   TTFT p90 of that class on an idle fleet (TTFT does not depend on the output length, so these
   ask for 4 tokens);
3. overload: `overload` x C requests/s for `load_seconds`; four tenants
   (`x-gateway-inference-fairness-id`), one of which sends 70 % of the requests and the others
   10 % each; 10 % of all requests are interactive (priority 10), spread evenly over the
   tenants, the rest standard (priority 0): the heavy tenant is a bulk sender, so priority and
   fairness do not pull against each other (strict priority serves a band before any fairness).

Reported: the interactive class's TTFT p90 (and its ratio to the idle value), goodput (output
tokens/s of answered requests whose TTFT met the SLO), answers by class (200 / 429 / 503),
requests lost without an answer (timeouts, resets), and Jain's fairness index of the tokens
each tenant was served during the overload (requests whose first token came between
`warmup_seconds` after the load started and its end, so the first seconds, before any queue
forms, do not count), each tenant's tokens divided by its max-min fair share of what the fleet
served (Jain's original normalisation: 1.0 = every tenant got its
fair share; tenants asking for less than an equal share count as fair when fully served).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from bench.routing.contenders import RunningRouter, Unavailable, _spawn, _start_envoy, _terminate, _wait_http
from bench.routing.loadgen import RequestRecord, send
from bench.routing.measure import percentile
from bench.routing.workloads import BenchRequest, completion_request, text_of_tokens, tokenizer
from epp.config.compose import endpoint_picker_config, plugin
from epp.engine.sim.fleet import FleetConfig, SimFleet, default_tokenizer_dir
from epp.engine.sim.profiles import get_profile
from epp.envoy import render_config
from epp.netutil import free_ports

TENANTS = (("tenant-a", 0.70), ("tenant-b", 0.10), ("tenant-c", 0.10), ("tenant-d", 0.10))
CLASSES = (("interactive", 10), ("standard", 0))


@dataclass
class FlowBench:
    """The scenario: fleet shape, traffic mix and the picker's flow-control settings."""

    replicas: int = 4
    max_num_seqs: int = 8
    num_gpu_blocks: int = 226  # 8 requests of 256 + 128 tokens fill ~85 % of a replica's KV cache
    time_scale: float = 10.0
    prompt_tokens: int = 256
    output_tokens: int = 128
    interactive_share: float = 0.10
    overload: float = 2.0
    idle_requests: int = 30
    load_seconds: float = 60.0
    warmup_seconds: float = 10.0
    request_timeout: float = 120.0
    ttl: str = "15s"
    standard_ceiling: float = 0.6  # usage limit of priority 0: room held back for interactive
    ttft_slo: float = 2.0  # seconds, for goodput
    seed: int = 7

    def fleet(self) -> FleetConfig:
        return FleetConfig(replicas=self.replicas, profile="h100-llama3-8b", time_scale=self.time_scale,
                           num_gpu_blocks=self.num_gpu_blocks, max_num_seqs=self.max_num_seqs, processes=2,
                           kv_events=False, kv_replay=False)

    def epp_config(self, flow_control: bool) -> str:
        """The picker's EndpointPickerConfig; `flow_control` only adds the feature gate."""
        bands = [{"priority": p, "fairnessPolicyRef": "round-robin-fairness-policy"} for p in (10, 0)]
        return endpoint_picker_config(
            ["queue-scorer", "kv-cache-utilization-scorer",
             plugin("utilization-detector", queueDepthThreshold=1, kvCacheUtilThreshold=0.8),
             plugin("static-usage-limit-policy", priorityThresholds={0: self.standard_ceiling})],
            {"queue-scorer": 1, "kv-cache-utilization-scorer": 1},
            **({"featureGates": ["flowControl"]} if flow_control else {}),
            objectives=[{"name": "interactive", "priority": 10}, {"name": "standard", "priority": 0}],
            saturationDetector={"pluginRef": "utilization-detector"},
            flowControl={"defaultRequestTTL": self.ttl, "maxRequests": 1000,
                         "usageLimitPolicyPluginRef": "static-usage-limit-policy", "priorityBands": bands})


@dataclass
class Sent:
    """One request of the overload or idle phase and what came back."""

    tenant: str
    klass: str
    record: RequestRecord


@dataclass
class ModeResult:
    """The numbers of one run (flow control off or on)."""

    mode: str
    capacity: float
    idle_ttft_p90: float | None
    interactive_ttft_p90: float | None
    standard_ttft_p90: float | None
    goodput_tokens_per_s: float
    served_tokens_per_s: float
    answers: dict[str, dict[str, int]] = field(default_factory=dict)
    lost: int = 0
    jain: float | None = None
    jain_standard: float | None = None
    tenant_tokens: dict[str, int] = field(default_factory=dict)
    tenant_fair: dict[str, float] = field(default_factory=dict)
    tenant_answers: dict[str, dict[str, int]] = field(default_factory=dict)


def prompts(bench: FlowBench, count: int) -> list[str]:
    """Unique prompts (no shared prefixes): the cache plays no part in this scenario."""
    tok = tokenizer(default_tokenizer_dir())
    rng = random.Random(bench.seed)
    return [text_of_tokens(rng, bench.prompt_tokens, tok, f"q{i}:") for i in range(count)]


class Traffic:
    """Seeded Poisson arrivals of (tenant, class) requests through one aiohttp session per class."""

    def __init__(self, bench: FlowBench, base_url: str, texts: list[str]) -> None:
        self.bench = bench
        self.base_url = base_url
        self.texts = texts
        self.next_text = 0
        self.sessions: dict[tuple[str, str], aiohttp.ClientSession] = {}

    async def __aenter__(self) -> Traffic:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
        for tenant, _ in TENANTS:
            for klass, _ in CLASSES:
                headers = {"x-gateway-inference-fairness-id": tenant, "x-gateway-inference-objective": klass}
                self.sessions[(tenant, klass)] = aiohttp.ClientSession(
                    headers=headers, timeout=timeout, connector=aiohttp.TCPConnector(limit=0))
        return self

    async def __aexit__(self, *exc: object) -> None:
        for session in self.sessions.values():
            await session.close()

    def request(self, max_tokens: int | None = None) -> BenchRequest:
        text = self.texts[self.next_text % len(self.texts)]
        self.next_text += 1
        return completion_request(text, max_tokens or self.bench.output_tokens, "flow")

    async def one_by_one(self, count: int, max_tokens: int) -> list[Sent]:
        """`count` interactive requests, each sent when the previous one has finished."""
        sent = []
        for i in range(count):
            tenant = TENANTS[i % len(TENANTS)][0]
            record = RequestRecord(stage=0, group=f"{tenant}/interactive", sent=0.0)
            await send(self.sessions[(tenant, "interactive")], self.base_url, self.request(max_tokens), record,
                       self.bench.request_timeout)
            sent.append(Sent(tenant, "interactive", record))
        return sent

    async def open_loop(self, rate: float, seconds: float, rng: random.Random) -> list[Sent]:
        """Send at `rate` requests/s for `seconds`; wait (bounded by the request timeout) for every answer."""
        sent: list[Sent] = []
        tasks = []
        start = time.perf_counter()
        t = start
        while True:
            t += rng.expovariate(rate)
            if t >= start + seconds:
                break
            await asyncio.sleep(max(0.0, t - time.perf_counter()))
            tenant = rng.choices([n for n, _ in TENANTS], [w for _, w in TENANTS])[0]
            # Interactive traffic is spread evenly over the tenants whatever their share of the requests.
            p_interactive = self.bench.interactive_share / (len(TENANTS) * dict(TENANTS)[tenant])
            klass = "interactive" if rng.random() < p_interactive else "standard"
            record = RequestRecord(stage=0, group=f"{tenant}/{klass}", sent=0.0)
            sent.append(Sent(tenant, klass, record))
            tasks.append(asyncio.ensure_future(send(self.sessions[(tenant, klass)], self.base_url, self.request(),
                                                    record, self.bench.request_timeout)))
        await asyncio.gather(*tasks)
        return sent


async def start_picker(bench: FlowBench, fleet: SimFleet, flow_control: bool, workdir: Path) -> RunningRouter:
    """`epp serve` with the scenario's config behind a real Envoy (responses not sent to the picker)."""
    grpc, health, metrics, listen, admin = free_ports(5)
    router = RunningRouter(f"http://127.0.0.1:{listen}", metrics_url=f"http://127.0.0.1:{metrics}/metrics")
    workdir.mkdir(parents=True, exist_ok=True)
    config = bench.epp_config(flow_control)
    (workdir / "epp-config.yaml").write_text(config)
    log = workdir / "epp.log"
    proc = await _spawn([sys.executable, "-m", "epp.cli", "serve", "--grpc-port", str(grpc), "--grpc-health-port",
                         str(health), "--metrics-port", str(metrics), "--bind-address", "127.0.0.1",
                         "--config-text", config, "--endpoints", fleet.endpoints_arg], log)
    router.pids.append(proc.pid)
    router.stoppers.append(lambda: _terminate(proc))
    try:
        await _wait_http(f"http://127.0.0.1:{metrics}/metrics", 60, proc, log)
        await _start_envoy(router, render_config(listen_port=listen, admin_port=admin, epp_port=grpc,
                                                 responses="none"), admin, workdir)
    except BaseException:
        await router.stop()
        raise
    return router


def max_min_shares(demand: dict[str, float], capacity: float) -> dict[str, float]:
    """Water-filling: each tenant gets min(demand, an equal split of what is left)."""
    share: dict[str, float] = {}
    left, open_ = capacity, sorted(demand, key=demand.get)
    while open_:
        equal = left / len(open_)
        tenant = open_[0]
        if demand[tenant] <= equal:
            share[tenant] = demand[tenant]
            left -= demand[tenant]
            open_.pop(0)
        else:
            for t in open_:
                share[t] = equal
            break
    return share


def jain(values: list[float]) -> float | None:
    """Jain's fairness index: (sum x)^2 / (n * sum x^2); 1.0 = all equal."""
    if not values or not any(values):
        return None
    return sum(values) ** 2 / (len(values) * sum(v * v for v in values))


def fairness(sent: list[Sent], window: tuple[float, float], bench: FlowBench
             ) -> tuple[dict[str, int], dict[str, float], list[float]]:
    """Tokens whose service started in `window` per tenant, their max-min fair shares, and the ratios."""
    served = {t: 0 for t, _ in TENANTS}
    demand = {t: 0.0 for t, _ in TENANTS}
    for s in sent:
        demand[s.tenant] += bench.output_tokens
        first = s.record.sent + (s.record.ttft or 0.0)
        if s.record.ok and window[0] <= first <= window[1]:
            served[s.tenant] += s.record.output_tokens
    fair = max_min_shares(demand, sum(served.values()))
    return served, fair, [served[t] / fair[t] for t in served if fair.get(t)]


def summarize(mode: str, capacity: float, idle: list[Sent], load: list[Sent], load_start: float, load_end: float,
              bench: FlowBench) -> ModeResult:
    """The reported numbers of one run."""
    def p90(sent: list[Sent]) -> float | None:
        return percentile([s.record.ttft for s in sent if s.record.ok and s.record.ttft is not None], 90)

    ok = [s for s in load if s.record.ok]
    ends = [s.record.sent + s.record.e2e for s in ok if s.record.e2e is not None]
    span = (max(ends) if ends else load_end) - load_start
    good = sum(s.record.output_tokens for s in ok if (s.record.ttft or 1e9) <= bench.ttft_slo)
    answers: dict[str, dict[str, int]] = {}
    tenant_answers: dict[str, dict[str, int]] = {}
    lost = 0
    for s in load:
        status = str(s.record.status) if s.record.status else None
        if s.record.ok:
            status = "200"
        elif status not in ("429", "503"):
            lost += 1
            status = f"lost ({s.record.error})"
        by_class = answers.setdefault(s.klass, {})
        by_class[status] = by_class.get(status, 0) + 1
        by_tenant = tenant_answers.setdefault(f"{s.tenant}/{s.klass}", {})
        by_tenant[status] = by_tenant.get(status, 0) + 1
    # Fairness: tokens whose service started inside the window, against each tenant's max-min fair share
    # of them; demand is what each tenant sent in the window (requests that could have been served there).
    window = (load_start + bench.warmup_seconds, load_end)
    served, fair, ratios = fairness(load, window, bench)
    _, _, standard_ratios = fairness([s for s in load if s.klass == "standard"], window, bench)
    return ModeResult(
        mode=mode, capacity=capacity, idle_ttft_p90=p90(idle),
        interactive_ttft_p90=p90([s for s in load if s.klass == "interactive"]),
        standard_ttft_p90=p90([s for s in load if s.klass == "standard"]),
        goodput_tokens_per_s=good / span, served_tokens_per_s=sum(s.record.output_tokens for s in ok) / span,
        answers=answers, lost=lost, jain=jain(ratios), jain_standard=jain(standard_ratios), tenant_tokens=served, tenant_fair=fair,
        tenant_answers=dict(sorted(tenant_answers.items())))


_TRACED = ("inference_extension_flow_control_pool_saturation", "inference_extension_flow_control_queue_size",
           "inference_extension_flow_control_requests_total")


async def trace_picker(router: RunningRouter, path: Path) -> None:
    """Every second, the picker's flow-control series (saturation, queue sizes, outcomes) to `path`."""
    lines: list[str] = []
    start = time.perf_counter()
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
            while True:
                try:
                    async with session.get(router.metrics_url or "") as resp:
                        text = await resp.text()
                except (TimeoutError, aiohttp.ClientError):
                    text = ""
                t = time.perf_counter() - start
                lines += [f"{t:7.2f} {line}" for line in text.splitlines() if line.startswith(_TRACED)]
                await asyncio.sleep(1.0)
    finally:
        path.write_text("\n".join(lines) + "\n")


def nominal_capacity(bench: FlowBench) -> float:
    """Requests/s the fleet completes with every batch slot busy, from its latency profile."""
    profile = get_profile("h100-llama3-8b")
    slots = bench.max_num_seqs
    prefill = profile.step_time(bench.prompt_tokens, slots - 1)
    decode = bench.output_tokens * profile.step_time(0, slots)
    return bench.replicas * slots / ((prefill + decode) * bench.time_scale)


async def run_mode(bench: FlowBench, flow_control: bool, capacity: float, texts: list[str],
                   workdir: Path) -> ModeResult:
    """One run on a fresh fleet: idle, then overload."""
    mode = "on" if flow_control else "off"
    fleet = SimFleet(bench.fleet(), tokenizer_dir=default_tokenizer_dir())
    await fleet.start()
    router = None
    try:
        router = await start_picker(bench, fleet, flow_control, workdir / f"flow-control-{mode}")
        async with Traffic(bench, router.base_url, texts) as traffic:
            idle = await traffic.one_by_one(bench.idle_requests, 4)
            load_start = time.perf_counter()
            tracer = asyncio.ensure_future(trace_picker(router, workdir / f"flow-control-{mode}" / "trace.txt"))
            try:
                load = await traffic.open_loop(bench.overload * capacity, bench.load_seconds,
                                               random.Random(bench.seed))
            finally:
                tracer.cancel()
            load_end = load_start + bench.load_seconds
        return summarize(mode, capacity, idle, load, load_start, load_end, bench)
    finally:
        if router is not None:
            await router.stop()
        await fleet.stop()


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def table(results: list[ModeResult], bench: FlowBench) -> str:
    """The Markdown table of the flow-control results (bench/notes/2026-12-flow-control-issue15.md)."""
    lines = ["| flow control | interactive TTFT p90 s (x idle) | standard TTFT p90 s | goodput tok/s "
             f"(TTFT <= {bench.ttft_slo:g} s) | served tok/s | interactive 200/429/503 | standard 200/429/503 "
             "| lost | Jain, all / standard |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        ratio = (f" ({r.interactive_ttft_p90 / r.idle_ttft_p90:.2f}x)"
                 if r.interactive_ttft_p90 and r.idle_ttft_p90 else "")
        counts = {k: "/".join(str(r.answers.get(k, {}).get(code, 0)) for code in ("200", "429", "503"))
                  for k in ("interactive", "standard")}
        lines.append(f"| {r.mode} | {_s(r.interactive_ttft_p90)}{ratio} | {_s(r.standard_ttft_p90)} | "
                     f"{r.goodput_tokens_per_s:.0f} | {r.served_tokens_per_s:.0f} | {counts['interactive']} | "
                     f"{counts['standard']} | {r.lost} | {_s(r.jain)} / {_s(r.jain_standard)} |")
    return "\n".join(lines)


async def main_async(bench: FlowBench, out: Path, modes: tuple[bool, ...] = (False, True)) -> list[ModeResult]:
    texts = await asyncio.to_thread(prompts, bench, 4000)
    results: list[ModeResult] = []
    capacity = nominal_capacity(bench)
    print(f"fleet capacity {capacity:.2f} req/s; offered {bench.overload * capacity:.2f} req/s", flush=True)
    for flow_control in modes:
        print(f"flow control {'on' if flow_control else 'off'}", flush=True)
        try:
            result = await run_mode(bench, flow_control, capacity, texts, out / "logs")
        except Unavailable as exc:
            print(f"  unavailable: {exc}", flush=True)
            raise
        results.append(result)
        print(f"  idle interactive TTFT p90 {_s(result.idle_ttft_p90)} s; overload: interactive p90 "
              f"{_s(result.interactive_ttft_p90)} s, answers {result.answers}, lost {result.lost}, "
              f"Jain {_s(result.jain)}, tenant tokens {result.tenant_tokens}", flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    parser = argparse.ArgumentParser(prog="python -m bench.routing.flow_control", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--load-seconds", type=float, default=FlowBench.load_seconds)
    parser.add_argument("--output-tokens", type=int, default=FlowBench.output_tokens)
    parser.add_argument("--standard-ceiling", type=float, default=FlowBench.standard_ceiling,
                        help="usage-limit ceiling of priority 0 (1.0 = no room held back)")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / "results" / "flow-control"))
    parser.add_argument("--modes", default="off,on", help="which runs, in order: off, on or both")
    args = parser.parse_args(argv)
    bench = FlowBench(load_seconds=args.load_seconds, output_tokens=args.output_tokens,
                      standard_ceiling=args.standard_ceiling)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    modes = tuple(m.strip() == "on" for m in args.modes.split(","))
    results = asyncio.run(main_async(bench, out, modes))
    md = table(results, bench)
    print(md)
    (out / "flow-control.md").write_text(md + "\n")
    (out / "flow-control.json").write_text(json.dumps([r.__dict__ for r in results], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
