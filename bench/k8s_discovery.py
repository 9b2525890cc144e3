"""Cost of Kubernetes discovery with a large pool: CPU, memory, and time from pod Ready to routable.

A child process runs the local API server (bench/support/k8s_apiserver.py: the list/watch wire
protocol) holding one InferencePool and `--pods` pods, and later flips pods between Ready and
not Ready at `--rate` changes per second, stamping each change with the system-wide monotonic
clock. This process runs only KubernetesDiscovery (the real kubernetes_asyncio client) feeding an
EndpointRegistry, and stamps when each endpoint appears or disappears; so its CPU time is the
discovery's own. Baseline in the same run: the same pool as an endpoints file, one change at a
time, re-read by FileDiscovery (the non-Kubernetes alternative).

    .venv/bin/python -m bench.k8s_discovery --pods 1000 --changes 1000 --rate 100
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as `python bench/k8s_discovery.py` too: the API server lives in bench/support/
    sys.path.insert(0, str(REPO))


def rss_mib() -> float:
    """Resident memory of this process (MiB), from /proc."""
    with open("/proc/self/status", encoding="ascii") as handle:
        for line in handle:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def pod_ip(i: int) -> str:
    return f"10.{i // 65536 % 256}.{i // 256 % 256}.{i % 256}"


# ---- the API server side (child process) -------------------------------------------------------


async def serve_api(port: int, pods: int) -> None:
    from bench.support.k8s_apiserver import FakeApiServer, inference_pool, pod

    api = FakeApiServer(bookmark_interval=5.0)
    api.port = port
    await api.start()
    api.apply(inference_pool("pool", {"app": "vllm"}, [8000]))
    for i in range(pods):
        api.apply(pod(f"vllm-{i}", pod_ip(i)))
    print("ready", flush=True)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while line := (await reader.readline()).decode().split():
        if line[0] != "churn":
            break
        changes, rate = int(line[1]), float(line[2])
        stamps = []
        start = time.monotonic()
        for n in range(changes):
            # Spread over the pool: the first half of the changes takes pods out of Ready, the
            # second half brings the same pods back in the same order.
            i, now_ready = (n % (changes // 2) * 7919) % pods, n >= changes // 2
            stamps.append((time.monotonic(), f"{pod_ip(i)}:8000", now_ready))
            api.apply(pod(f"vllm-{i}", pod_ip(i), ready=now_ready))
            delay = start + (n + 1) / rate - time.monotonic()
            await asyncio.sleep(max(0.0, delay))
        print(json.dumps(stamps), flush=True)
    await api.stop()


# ---- the discovery side (this process) ---------------------------------------------------------


def percentiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {"p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99), "max": ordered[-1]}


async def measure_kubernetes(pods: int, changes: int, rate: float) -> dict:
    from bench.support.k8s_apiserver import FakeApiServer
    from epp.datalayer.kubernetes import KubernetesDiscovery
    from epp.datalayer.registry import EndpointRegistry
    from epp.netutil import free_ports

    port = free_ports(1)[0]
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bench.k8s_discovery", "--api-server", "--port", str(port), "--pods", str(pods),
        cwd=REPO, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, limit=64 * 1024 * 1024)
    try:
        assert (await asyncio.wait_for(child.stdout.readline(), 120)).strip() == b"ready"
        kubeconfig = os.path.join(tempfile.mkdtemp(), "kubeconfig")
        probe = FakeApiServer()
        probe.port = port
        probe.write_kubeconfig(kubeconfig)
        rss_import = rss_mib()
        import kubernetes_asyncio.client  # noqa: F401  (import cost apart from discovery's own)

        rss_import = rss_mib() - rss_import

        registry = EndpointRegistry()
        seen: list[tuple[float, str, bool]] = []
        registry.add_listener(lambda added, gone: seen.extend(
            [(time.monotonic(), e.name, True) for e in added] + [(time.monotonic(), e.name, False) for e in gone]))
        rss_before, cpu0, wall0 = rss_mib(), time.process_time(), time.perf_counter()
        discovery = KubernetesDiscovery(registry, namespace="default", pool_name="pool", kubeconfig=kubeconfig)
        assert await discovery.start(60.0), discovery.pool_error
        sync = {"wall_s": time.perf_counter() - wall0, "cpu_s": time.process_time() - cpu0,
                "rss_mib": rss_mib() - rss_before, "endpoints": len(registry),
                "client_import_rss_mib": rss_import}
        await asyncio.sleep(1.0)  # watches open, idle
        idle_cpu0 = time.process_time()
        await asyncio.sleep(2.0)
        idle_cpu = (time.process_time() - idle_cpu0) / 2.0
        seen.clear()
        cpu1 = time.process_time()
        child.stdin.write(f"churn {changes} {rate}\n".encode())
        await child.stdin.drain()
        stamps = json.loads(await asyncio.wait_for(child.stdout.readline(), changes / rate + 120))
        await asyncio.sleep(0.5)
        churn_cpu = time.process_time() - cpu1
        rss_after = rss_mib() - rss_before
        to_ready, to_gone = [], []
        for t0, name, ready in stamps:
            arrival = next((t for t, n, added in seen if n == name and added == ready and t >= t0), None)
            assert arrival is not None, f"{name} never became {'routable' if ready else 'unroutable'}"
            (to_ready if ready else to_gone).append((arrival - t0) * 1000)
        await discovery.stop()
        return {"sync": sync, "idle_cpu_per_s": idle_cpu, "churn_cpu_per_change_ms": churn_cpu / changes * 1000,
                "churn_rss_mib": rss_after, "ready_to_routable_ms": percentiles(to_ready),
                "unready_to_unroutable_ms": percentiles(to_gone), "changes": changes, "rate": rate}
    finally:
        if child.returncode is None:
            child.stdin.close()
            try:
                await asyncio.wait_for(child.wait(), 10)
            except TimeoutError:
                child.kill()


async def measure_file(pods: int, changes: int) -> dict:
    """The baseline: the same pool as an endpoints file, re-read after each change."""
    from epp.datalayer.discovery import FileDiscovery
    from epp.datalayer.registry import EndpointRegistry

    path = Path(tempfile.mkdtemp()) / "endpoints.yaml"
    ready = [True] * pods

    def write() -> None:
        lines = ["endpoints:"] + [f"- {pod_ip(i)}:8000#app=vllm;llm-epp.io/pod=vllm-{i}"
                                  for i in range(pods) if ready[i]]
        tmp = path.with_suffix(".tmp")
        tmp.write_text("\n".join(lines) + "\n")
        os.replace(tmp, path)

    write()
    registry = EndpointRegistry()
    discovery = FileDiscovery(registry, path, poll_interval=3600)
    cpu0 = time.process_time()
    assert await discovery.poll_once()
    sync_cpu = time.process_time() - cpu0
    cpu = 0.0
    for n in range(changes):
        i = (n % (changes // 2) * 7919) % pods
        ready[i] = n >= changes // 2
        write()
        start = time.process_time()
        assert await discovery.poll_once()
        cpu += time.process_time() - start
    return {"sync_cpu_s": sync_cpu, "cpu_per_change_ms": cpu / changes * 1000}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pods", type=int, default=1000)
    parser.add_argument("--changes", type=int, default=1000, help="Ready flips during the churn phase")
    parser.add_argument("--rate", type=float, default=100.0, help="changes per second")
    parser.add_argument("--api-server", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    if args.api_server:
        asyncio.run(serve_api(args.port, args.pods))
        return 0
    k8s = asyncio.run(measure_kubernetes(args.pods, args.changes, args.rate))
    file_changes = min(args.changes, 200)
    baseline = asyncio.run(measure_file(args.pods, file_changes))
    results = {"pods": args.pods, "kubernetes": k8s, "file_baseline": baseline}
    s, r, g = k8s["sync"], k8s["ready_to_routable_ms"], k8s["unready_to_unroutable_ms"]
    print(f"pool of {args.pods} pods (1 target port); {args.changes} Ready flips at {args.rate:g}/s")
    print("| measure | Kubernetes watch | endpoints file (baseline) |")
    print("|---|---|---|")
    print(f"| first full view: wall / CPU | {s['wall_s']:.2f} s / {s['cpu_s']:.2f} s | - / {baseline['sync_cpu_s']:.2f} s |")
    print(f"| CPU per pod change | {k8s['churn_cpu_per_change_ms']:.2f} ms | {baseline['cpu_per_change_ms']:.2f} ms "
          f"({baseline['cpu_per_change_ms'] / k8s['churn_cpu_per_change_ms']:.1f}x) |")
    print(f"| CPU while idle (watches open) | {k8s['idle_cpu_per_s'] * 100:.2f} % of a core | - |")
    print(f"| memory (RSS growth: client import / sync / after churn) | {s['client_import_rss_mib']:.1f} / "
          f"{s['rss_mib']:.1f} / {k8s['churn_rss_mib']:.1f} MiB | - |")
    print(f"| pod Ready -> routable (p50/p90/p99/max) | {r['p50']:.1f} / {r['p90']:.1f} / {r['p99']:.1f} / "
          f"{r['max']:.1f} ms | poll interval |")
    print(f"| pod not Ready -> unroutable (p50/p99/max) | {g['p50']:.1f} / {g['p99']:.1f} / {g['max']:.1f} ms | "
          "poll interval |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
