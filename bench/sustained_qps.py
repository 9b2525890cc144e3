"""Sustained QPS through Envoy + picker: open-loop rates, multi-turn prompts, picker CPU and added latency.

Fast fake replicas (`FakeReplicas`: aiohttp, one process, answer at once with a usage block and
serve `/metrics`) stand behind two Envoys: one plain round-robin ("direct"), one through `epp
serve` (ext_proc, `--responses` as given). A client process sends chat requests open loop
(Poisson arrivals at a fixed rate, every request on its own, never waiting for the previous
one) from multi-turn conversations around a size: each request is the next turn of one of 64
conversations (a question of ~40 % and an answer of ~60 % of a turn of min(1 KB, size/20)), and
a conversation that passes 1.5x the size starts again as a new one of the size. At each rate the
direct path and the picker path take turns (`--seconds` each); reported per rate: the picker's
CPU (its process and workers, from /proc) and Envoy's, per request; latency p50/p99 through the
picker minus direct (added); errors; and whether the rate held (every request answered 200,
the client kept up within 2 %, and p99 added <= `--bound-ms`). The highest rate held is each
row's result. Rows: `--pipelines` x `--sizes`, and each pipeline with `--workers N`; `--peers`
adds the Rust routers (vllm-router and sglang-router, cache_aware, from the peers venv) on the
same workload: their CPU per request at the rates given (they are HTTP proxies: no Envoy).

The precise pipeline sees no KV events here (the replicas are fakes): every match it finds is
its own claims (speculativeTTL), which it renews in full at each pick.

    python bench/sustained_qps.py --sizes 2 --rates 50,100,200,400,800 --out bench/results/pick-cost-2k
    python bench/sustained_qps.py --sizes 200 --rates 10,20,40,80,160 --out bench/results/pick-cost-200k
    python bench/sustained_qps.py --pipelines default --sizes 2,50 --rates 50,200 --deployments default,lean --peers \
        --out bench/results/pick-cost-peers
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.long_context import pipeline_config  # noqa: E402
from bench.routing.contenders import peer_binary, peers_venv  # noqa: E402
from epp.engine.sim.fleet import default_tokenizer_dir  # noqa: E402
from epp.engine.tinymodel import _WORDS  # noqa: E402
from epp.envoy import EnvoyProcess, render_config  # noqa: E402
from epp.netutil import free_ports  # noqa: E402

MODEL = "sim-model"
REPLICAS = 8
CONVERSATIONS = 64
CLK_TCK = os.sysconf("SC_CLK_TCK")
METRICS_TEXT = (
    "# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{model_name=\"sim-model\"} 0.0\n"
    "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{model_name=\"sim-model\"} 1.0\n"
    "# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{model_name=\"sim-model\"} 0.1\n"
)


# ---- fake replicas --------------------------------------------------------------------------------

def _replicas_main(ports: list[int]) -> None:
    """N replicas in one process: answer every completion at once; /metrics, /health, /v1/models."""
    from aiohttp import web

    async def completion(request: web.Request) -> web.Response:
        body = await request.read()
        return web.json_response({"id": "x", "object": "chat.completion", "model": MODEL,
                                  "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                                               "finish_reason": "stop"}],
                                  "usage": {"prompt_tokens": len(body) // 4, "completion_tokens": 1,
                                            "total_tokens": len(body) // 4 + 1}})

    async def metrics(_request: web.Request) -> web.Response:
        return web.Response(text=METRICS_TEXT)

    async def ok(_request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def run() -> None:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/chat/completions", completion)
        app.router.add_post("/v1/completions", completion)
        app.router.add_get("/metrics", metrics)
        app.router.add_get("/health", ok)
        app.router.add_get("/v1/models", ok)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        for port in ports:
            await web.TCPSite(runner, "127.0.0.1", port).start()
        await asyncio.Event().wait()

    import uvloop
    uvloop.run(run())


# ---- the client -------------------------------------------------------------------------------------

class Conversations:
    """Multi-turn chat bodies around `size` bytes, built by concatenation (the client never re-serialises)."""

    def __init__(self, size: int, seed: int) -> None:
        self.size = size
        self.turn = min(1024, max(60, size // 20))
        self.rng = random.Random(seed)
        self.chats: list[list[bytes]] = [self._fresh() for _ in range(CONVERSATIONS)]
        self.lengths = [sum(map(len, c)) for c in self.chats]
        self.next = 0

    def _text(self, size: int) -> str:
        out, length = [], 0
        while length < size:
            word = self.rng.choice(_WORDS)
            out.append(word)
            length += len(word) + 1
        return " ".join(out)[:size]

    def _message(self, role: str, size: int) -> bytes:
        return json.dumps({"role": role, "content": self._text(size)}).encode()

    def _fresh(self) -> list[bytes]:
        chat = [self._message("system", min(1500, self.size // 2))]
        length = len(chat[0])
        while length < self.size - self.turn:
            chat += [self._message("user", self.turn * 2 // 5), self._message("assistant", self.turn * 3 // 5)]
            length += len(chat[-1]) + len(chat[-2])
        return chat

    def body(self) -> bytes:
        """The next request: one conversation's history and a new question (its answer joins the history)."""
        i = self.next
        self.next = (i + 1) % CONVERSATIONS
        if self.lengths[i] > self.size * 3 // 2:
            self.chats[i] = self._fresh()
            self.lengths[i] = sum(map(len, self.chats[i]))
        chat = self.chats[i]
        chat.append(self._message("user", self.turn * 2 // 5))
        body = b'{"model":"' + MODEL.encode() + b'","max_tokens":1,"messages":[' + b",".join(chat) + b"]}"
        chat.append(self._message("assistant", self.turn * 3 // 5))
        self.lengths[i] += len(chat[-1]) + len(chat[-2])
        return body


def _client_main(size: int, seed: int, commands: Any, results: Any) -> None:
    """A long-lived client process: for each (url, rate, seconds) command, an open-loop run; puts its results."""
    import aiohttp
    import uvloop

    conversations = Conversations(size, seed)

    async def run(url: str, rate: float, seconds: float) -> dict[str, Any]:
        latencies: list[float] = []
        statuses: dict[int, int] = {}
        lags: list[float] = []
        rng = random.Random(seed)
        connector = aiohttp.TCPConnector(limit=0, force_close=False)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as session:
            tasks = []

            async def one(body: bytes) -> None:
                t0 = time.perf_counter()
                try:
                    async with session.post(url, data=body, headers={"content-type": "application/json"}) as resp:
                        await resp.read()
                        status = resp.status
                except (TimeoutError, aiohttp.ClientError):
                    status = 0
                statuses[status] = statuses.get(status, 0) + 1
                if status == 200:
                    latencies.append(time.perf_counter() - t0)

            start = time.perf_counter()
            due = start
            while due - start < seconds:
                due += rng.expovariate(rate)
                body = conversations.body()
                delay = due - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                lags.append(max(0.0, time.perf_counter() - due))
                tasks.append(asyncio.ensure_future(one(body)))
            sent_in = time.perf_counter() - start
            await asyncio.gather(*tasks)
        return {"latencies": latencies, "statuses": statuses, "sent": len(tasks), "send_seconds": sent_in,
                "lag_p99_ms": sorted(lags)[int(0.99 * (len(lags) - 1))] * 1e3 if lags else 0.0}

    async def serve() -> None:
        while True:
            command = await asyncio.to_thread(commands.get)
            if command is None:
                return
            results.put(await run(*command))

    uvloop.run(serve())


class Client:
    """The client process of one row (its conversations persist across the row's rates)."""

    def __init__(self, size: int, seed: int) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.commands, self.results = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(target=_client_main, args=(size, seed, self.commands, self.results), daemon=True)
        self.proc.start()

    async def run(self, url: str, rate: float, seconds: float) -> dict[str, Any]:
        self.commands.put((url, rate, seconds))
        return await asyncio.to_thread(self.results.get)

    def close(self) -> None:
        self.commands.put(None)
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()


# ---- measuring ---------------------------------------------------------------------------------------

def tree_cpu_s(root: int) -> float:
    """CPU seconds (user + system) of a process and its children (the workers of `epp serve --workers N`)."""
    total = 0.0
    pids = [root]
    with contextlib.suppress(OSError):
        pids += [int(p) for p in Path(f"/proc/{root}/task/{root}/children").read_text().split()]
    for pid in pids:
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / CLK_TCK
    return total


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


@dataclass
class Router:
    """A started router under test: its URL, the processes whose CPU is its cost, how to stop it."""

    name: str
    url: str
    picker_pids: list[int]
    envoy_pid: int | None
    stop: Any
    notes: str = ""
    steps: list[dict[str, Any]] = field(default_factory=list)


async def wait_http(url: str, timeout: float = 60) -> None:
    import aiohttp

    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
        while time.monotonic() < deadline:
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, OSError):
                async with session.get(url) as resp:
                    if resp.status < 500:
                        return
            await asyncio.sleep(0.2)
    raise TimeoutError(url)


async def start_epp(name: str, config: str, endpoints: list[str], workdir: Path, *, workers: int, responses: str,
                    serve_args: list[str]) -> Router:
    grpc, health, metrics, listen, admin = free_ports(5)
    config_file = workdir / f"{name}.yaml"
    config_file.write_text(config)
    log = open(workdir / f"{name}.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "epp.cli", "serve", "--grpc-port", str(grpc), "--grpc-health-port", str(health),
         "--metrics-port", str(metrics), "--bind-address", "127.0.0.1", "--endpoints", ",".join(endpoints),
         "--config-file", str(config_file), "--workers", str(workers), *serve_args],
        stdout=log, stderr=log, start_new_session=True)
    log.close()
    envoy = EnvoyProcess(render_config(listen_port=listen, admin_port=admin, epp_port=grpc, responses=responses),
                         admin, concurrency=workers)

    async def stop() -> None:
        await envoy.stop()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        await asyncio.to_thread(proc.wait, 20)

    try:
        await wait_http(f"http://127.0.0.1:{metrics}/metrics")
        await envoy.start()
    except BaseException:
        await stop()
        raise
    assert envoy.process is not None
    return Router(name, f"http://127.0.0.1:{listen}/v1/chat/completions", [proc.pid], envoy.process.pid, stop)


async def start_direct(endpoints: list[str]) -> Router:
    listen, admin = free_ports(2)
    envoy = EnvoyProcess(render_config(listen_port=listen, admin_port=admin, round_robin_backends=endpoints), admin)
    await envoy.start()
    assert envoy.process is not None
    return Router("direct", f"http://127.0.0.1:{listen}/v1/chat/completions", [], envoy.process.pid, envoy.stop)


async def start_peer(kind: str, endpoints: list[str], workdir: Path) -> Router:
    port, prom = free_ports(2)
    urls = [f"http://{e}" for e in endpoints]
    binary = peer_binary(kind)
    launch = ["launch"] if kind == "sglang-router" else []
    argv = [binary, *launch, "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *urls,
            "--policy", "cache_aware", "--prometheus-port", str(prom),
            "--log-level", "warn" if kind == "sglang-router" else "warning",
            "--worker-startup-check-interval", "1", "--worker-startup-timeout-secs", "30"]
    log = open(workdir / f"{kind}.log", "wb")
    proc = subprocess.Popen(argv, stdout=log, stderr=log, start_new_session=True)
    log.close()

    async def stop() -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        await asyncio.to_thread(proc.wait, 20)

    try:
        await wait_http(f"http://127.0.0.1:{port}/health")
    except BaseException:
        await stop()
        raise
    return Router(f"{kind} cache_aware", f"http://127.0.0.1:{port}/v1/chat/completions", [proc.pid], None, stop,
                  notes=f"from {peers_venv()}")


async def step(client: Client, router: Router, direct: Router, rate: float, seconds: float,
               bound_ms: float) -> dict[str, Any]:
    """One rate: the direct path, then the router (CPU read around its own turn only)."""
    baseline = await client.run(direct.url, rate, seconds)
    cpu0 = sum(tree_cpu_s(p) for p in router.picker_pids)
    envoy0 = tree_cpu_s(router.envoy_pid) if router.envoy_pid else 0.0
    got = await client.run(router.url, rate, seconds)
    picker_cpu = sum(tree_cpu_s(p) for p in router.picker_pids) - cpu0
    envoy_cpu = (tree_cpu_s(router.envoy_pid) - envoy0) if router.envoy_pid else 0.0
    done = len(got["latencies"])
    errors = got["sent"] - done
    p50, p99 = pct(got["latencies"], 0.5) * 1e3, pct(got["latencies"], 0.99) * 1e3
    d50, d99 = pct(baseline["latencies"], 0.5) * 1e3, pct(baseline["latencies"], 0.99) * 1e3
    kept_up = got["send_seconds"] <= seconds * 1.02 and got["lag_p99_ms"] < 50
    result = {
        "rate": rate, "sent": got["sent"], "answered": done, "errors": errors,
        "statuses": {str(k): v for k, v in got["statuses"].items()},
        "achieved_rps": done / max(got["send_seconds"], 1e-9),
        "picker_cpu_us": picker_cpu / max(done, 1) * 1e6, "envoy_cpu_us": envoy_cpu / max(done, 1) * 1e6,
        "picker_cores": picker_cpu / max(got["send_seconds"], 1e-9),
        "p50_ms": p50, "p99_ms": p99, "direct_p50_ms": d50, "direct_p99_ms": d99,
        "added_p50_ms": p50 - d50, "added_p99_ms": p99 - d99, "client_lag_p99_ms": got["lag_p99_ms"],
    }
    result["held"] = errors == 0 and kept_up and result["added_p99_ms"] <= bound_ms
    return result


# ---- rows -------------------------------------------------------------------------------------------

async def run_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    workdir = args.out / "raw"  # configs and logs (git-ignored)
    workdir.mkdir(parents=True, exist_ok=True)
    ports = free_ports(REPLICAS)
    endpoints = [f"127.0.0.1:{p}" for p in ports]
    replicas = multiprocessing.get_context("spawn").Process(target=_replicas_main, args=(ports,), daemon=True)
    replicas.start()
    rows: list[dict[str, Any]] = []
    tokenizer_dir = default_tokenizer_dir()
    try:
        await wait_http(f"http://{endpoints[0]}/metrics")
        direct = await start_direct(endpoints)
        try:
            for size in args.sizes:
                plans: list[tuple[str, Any]] = []
                for deployment in args.deployments:
                    for pipeline in args.pipelines:
                        for workers in [1, *args.workers]:
                            label = f"epp {pipeline}" + (f" --workers {workers}" if workers > 1 else "") + (
                                " (lean)" if deployment == "lean" else "")
                            plans.append((label, (pipeline, workers, deployment == "lean")))
                if args.peers:
                    plans += [(kind, kind) for kind in ("vllm-router", "sglang-router")]
                for label, plan in plans:
                    rows.append(await run_row(args, label, plan, size, endpoints, direct, workdir, tokenizer_dir))
                    (args.out / "results.json").write_text(json.dumps(rows, indent=1))
        finally:
            await direct.stop()
    finally:
        replicas.terminate()
        replicas.join(5)
    return rows


async def run_row(args: argparse.Namespace, label: str, plan: Any, size_kb: int, endpoints: list[str], direct: Router,
                  workdir: Path, tokenizer_dir: str) -> dict[str, Any]:
    print(f"-- {label}, {size_kb} KB", file=sys.stderr, flush=True)
    lean = False
    if isinstance(plan, tuple):
        pipeline, workers, lean = plan
        serve_args = ["--refresh-metrics-interval", "0.5"] if lean else []
        router = await start_epp(f"{pipeline}-w{workers}-{size_kb}k{'-lean' if lean else ''}",
                                 pipeline_config(pipeline, tokenizer_dir), endpoints, workdir, workers=workers,
                                 responses="headers" if lean else "full", serve_args=serve_args)
    else:
        router = await start_peer(plan, endpoints, workdir)
    client = Client(size_kb * 1024, seed=size_kb)
    try:
        await client.run(router.url, args.warmup_rate, CONVERSATIONS / args.warmup_rate * 2)  # every conversation seen
        await client.run(direct.url, args.warmup_rate, 2)
        for rate in (args.peer_rates or args.rates) if not isinstance(plan, tuple) else args.rates:
            result = await step(client, router, direct, rate, args.seconds, args.bound_ms)
            router.steps.append(result)
            print(f"   {rate:>6g}/s  answered {result['answered']}/{result['sent']}  picker {result['picker_cpu_us']:.0f} "
                  f"us/req  added p50 {result['added_p50_ms']:.2f} p99 {result['added_p99_ms']:.2f} ms  "
                  f"{'held' if result['held'] else 'NOT held'}", file=sys.stderr, flush=True)
            if not result["held"] and result["errors"] > result["sent"] // 10:
                break  # far past what it holds: the next rates only pile up
    finally:
        client.close()
        await router.stop()
    held = [s["rate"] for s in router.steps if s["held"]]
    return {"router": label, "size_kb": size_kb, "lean": lean, "bound_ms": args.bound_ms,
            "highest_rate_held": max(held) if held else 0, "steps": router.steps, "notes": router.notes}


# ---- report -----------------------------------------------------------------------------------------

def report(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    lines = ["# Sustained QPS through Envoy", "",
             "Deployments: default = `--responses full`, scraping every 50 ms; lean = `--responses headers`, "
             "scraping every 0.5 s (README). Router CPU = the picker's process(es) + its Envoy; the Rust peers "
             "are HTTP proxies (no Envoy).", "",
             f"Command: `python bench/sustained_qps.py {' '.join(sys.argv[1:])}`", "",
             f"{REPLICAS} fake replicas, {CONVERSATIONS} multi-turn conversations per size, open-loop Poisson "
             f"arrivals, {args.seconds:g} s per rate and path, bound: p99 added <= {args.bound_ms:g} ms. "
             f"Machine: {os.cpu_count()} CPUs, shared with the client, Envoys and replicas.", "",
             "| router | prompt | highest rate held (req/s) | picker CPU µs/req at that rate | "
             "requests per picker CPU-second | Envoy CPU µs/req | router CPU µs/req |", "|---|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        steps = {s["rate"]: s for s in row["steps"]}
        at = steps.get(row["highest_rate_held"]) or (row["steps"][0] if row["steps"] else None)
        if at is None:
            continue
        lines.append(f"| {row['router']} | {row['size_kb']} KB | {row['highest_rate_held']:g} | "
                     f"{at['picker_cpu_us']:,.0f} | {1e6 / max(at['picker_cpu_us'], 1):,.0f} | "
                     f"{at['envoy_cpu_us']:,.0f} | {at['picker_cpu_us'] + at['envoy_cpu_us']:,.0f} |")
    lines += ["", "Per rate:", "", "| router | prompt | rate | answered/sent | picker CPU µs/req | picker cores | "
              "p50 / p99 direct (ms) | added p50 / p99 (ms) | held |", "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for row in rows:
        for s in row["steps"]:
            lines.append(f"| {row['router']} | {row['size_kb']} KB | {s['rate']:g} | {s['answered']}/{s['sent']} | "
                         f"{s['picker_cpu_us']:,.0f} | {s['picker_cores']:.2f} | {s['direct_p50_ms']:.2f} / "
                         f"{s['direct_p99_ms']:.2f} | {s['added_p50_ms']:.2f} / {s['added_p99_ms']:.2f} | "
                         f"{'yes' if s['held'] else 'no'} |")
    return "\n".join(lines) + "\n"


def plots(rows: list[dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for size in sorted({r["size_kb"] for r in rows}):
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
        for row in (r for r in rows if r["size_kb"] == size):
            rates = [s["rate"] for s in row["steps"]]
            ax1.plot(rates, [s["added_p99_ms"] for s in row["steps"]], marker="o", label=row["router"])
            ax2.plot(rates, [s["picker_cpu_us"] for s in row["steps"]], marker="o", label=row["router"])
        bound = rows[0]["bound_ms"]
        ax1.axhline(bound, color="grey", linestyle="--", linewidth=1)
        ax1.set(xscale="log", xlabel="offered rate (req/s)", ylabel="p99 added latency (ms)",
                title=f"{size} KB multi-turn: added p99 vs Envoy direct")
        ax2.set(xscale="log", xlabel="offered rate (req/s)", ylabel="router process CPU µs / request",
                title=f"{size} KB: CPU per request")
        ax1.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / f"sustained-{size}k.png", dpi=110)
        plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pipelines", default="default,approximate,precise",
                        type=lambda s: [p for p in s.split(",") if p])
    parser.add_argument("--sizes", default="2,50,200", type=lambda s: [int(x) for x in s.split(",") if x],
                        help="conversation sizes in KB (default 2,50,200)")
    parser.add_argument("--rates", default="25,50,100,200,400", type=lambda s: [float(x) for x in s.split(",") if x])
    parser.add_argument("--workers", default="", type=lambda s: [int(x) for x in s.split(",") if x],
                        help="also run each pipeline with `epp serve --workers N` for these N")
    parser.add_argument("--seconds", type=float, default=6.0, help="seconds per rate and path (default 6)")
    parser.add_argument("--bound-ms", type=float, default=10.0, help="p99 added latency a held rate stays under")
    parser.add_argument("--warmup-rate", type=float, default=20.0)
    parser.add_argument("--deployments", default="default", type=lambda s: [d for d in s.split(",") if d],
                        help="default (`--responses full`, scraping every 50 ms) and/or lean (`--responses "
                             "headers`, scraping every 0.5 s)")
    parser.add_argument("--lean", dest="deployments", action="store_const", const=["lean"],
                        help="the same as --deployments lean")
    parser.add_argument("--peers", action="store_true", help="also run vllm-router and sglang-router (cache_aware)")
    parser.add_argument("--peer-rates", type=lambda s: [float(x) for x in s.split(",") if x],
                        help="the peers' rates (default: --rates)")
    parser.add_argument("--out", type=Path, required=True, help="result folder (report.md, results.json, plots)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = asyncio.run(run_rows(args))
    text = report(rows, args)
    (args.out / "report.md").write_text(text)
    (args.out / "results.json").write_text(json.dumps(rows, indent=1))
    plots(rows, args.out)
    print(text)


if __name__ == "__main__":
    main()
