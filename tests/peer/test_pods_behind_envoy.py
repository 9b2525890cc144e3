"""Separate `epp serve` processes as the pods of one pool, behind one real Envoy ext_proc cluster.

Two pickers, each its own process with its own ports, told of each other with `--peer-port` and
`--peers`, are both members of Envoy's `epp` cluster: Envoy spreads the requests' ext_proc
streams over them. Simulated vLLM replicas serve. Each group's first requests are sent at once,
so they reach both pickers before either can have heard of the other's pick; with the rendezvous
home on (`rendezvousHome: true`, off by default) the group must still land on one replica, and
stay there.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys

import aiohttp
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from epp.config.compose import DEFAULT_CONFIG_YAML
from epp.engine.sim import FleetConfig, SimFleet
from epp.engine.sim.fleet import default_tokenizer_dir
from epp.envoy import EnvoyProcess, render_config
from epp.netutil import free_ports
from tests.support.extproc import metric_samples
from tests.support.precise import prompt_of
from tests.support.wait import wait_until

pytestmark = [pytest.mark.envoy, pytest.mark.timeout(180)]

MODEL = "sim-model"
# Each group's home is its best-ranked replica, random for a run (the replicas' ports are): with
# 4 groups on 3 replicas all would share one home in 1 run of 27, with 8 in 1 of 2,187.
GROUPS = 8


def pod_samples(metrics_port: int) -> dict[str, float]:
    """One picker's metrics page as {'name{labels}': value} (empty while it does not answer)."""
    try:
        return metric_samples(metrics_port)
    except OSError:
        return {}


async def served(http: aiohttp.ClientSession, endpoints: list[str]) -> list[float]:
    """Requests each replica has finished (its own `vllm:request_success_total`)."""
    out = []
    for endpoint in endpoints:
        async with http.get(f"http://{endpoint}/metrics") as resp:
            text = await resp.text()
        out.append(sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
                       if s.name == "vllm:request_success_total"))
    return out


async def complete(http: aiohttp.ClientSession, url: str, prompt: str) -> None:
    async with http.post(url, json={"model": MODEL, "prompt": prompt, "max_tokens": 2}) as resp:
        assert resp.status == 200, await resp.text()
        await resp.read()


def default_config_with_home() -> str:
    """GIE's default pipeline with the approximate producer's rendezvous home on."""
    document = yaml.safe_load(DEFAULT_CONFIG_YAML)
    document["plugins"].insert(0, {"type": "approx-prefix-cache-producer", "parameters": {"rendezvousHome": True}})
    return yaml.safe_dump(document, sort_keys=False)


async def test_two_pods_behind_one_envoy_send_each_group_to_one_replica():
    tokenizer_dir = default_tokenizer_dir()
    fleet_config = FleetConfig(replicas=3, model=MODEL, tokenizer_dir=tokenizer_dir, profile="fast*100",
                               num_gpu_blocks=1024, block_size=16, kv_events=False)
    pods = [free_ports(4) for _ in range(2)]  # grpc, health, metrics, peer
    procs: list[asyncio.subprocess.Process] = []
    envoy = None
    async with SimFleet(fleet_config) as fleet, aiohttp.ClientSession() as http:
        try:
            for i, (grpc, health, metrics, peer) in enumerate(pods):
                other = pods[1 - i][3]
                procs.append(await asyncio.create_subprocess_exec(
                    sys.executable, "-m", "epp.cli", "serve", "--grpc-port", str(grpc), "--grpc-health-port",
                    str(health), "--metrics-port", str(metrics), "--bind-address", "127.0.0.1",
                    "--endpoints", ",".join(fleet.endpoints), "--refresh-metrics-interval", "0.05",
                    "--grace-period", "1", "--peer-port", str(peer), "--peers", f"127.0.0.1:{other}",
                    "--config-text", default_config_with_home(),
                    stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL))

            async def linked() -> bool:
                pages = [await asyncio.to_thread(pod_samples, p[2]) for p in pods]
                return all(page.get("epp_peer_following") == 1.0 for page in pages)

            for _ in range(600):  # the pods start and follow each other (60 s at most)
                if await linked():
                    break
                assert all(p.returncode is None for p in procs), "a picker exited"
                await asyncio.sleep(0.1)
            else:
                raise AssertionError("the two pickers did not follow each other within 60s")
            listen, admin = free_ports(2)
            envoy = EnvoyProcess(render_config(listen_port=listen, admin_port=admin, epp_port=pods[0][0],
                                               extra_epp_ports=[pods[1][0]]), admin)
            await envoy.start()
            url = f"http://127.0.0.1:{listen}/v1/completions"
            placed: dict[int, list[int]] = {}
            for group in range(GROUPS):
                system = prompt_of(tokenizer_dir, seed=300 + group, tokens=600)
                before = await served(http, fleet.endpoints)
                for wave in range(2):  # two at once (one to each pod), twice
                    await asyncio.wait_for(asyncio.gather(*(
                        complete(http, url, f"{system}\nQuestion {wave}.{k}?") for k in range(2))), 30)
                after = await served(http, fleet.endpoints)
                placed[group] = [int(a - b) for a, b in zip(after, before)]
            # Each group's four requests went to one replica; the groups did not all share one.
            assert all(sorted(counts) == [0, 0, 4] for counts in placed.values()), placed
            assert len({counts.index(4) for counts in placed.values()}) >= 2, placed
            # Both pods routed: Envoy spread the streams, and each learned the other's routes.
            pages = [await asyncio.to_thread(pod_samples, p[2]) for p in pods]
            taken = [page.get('epp_extproc_messages_total{phase="request_headers"}', 0) for page in pages]
            assert sum(taken) == 4 * GROUPS and min(taken) > 0, taken
            await wait_until(lambda: all(
                pod_samples(p[2]).get('epp_peer_decisions_received_total{kind="prefix_routed"}') == other
                for p, other in zip(pods, reversed(taken))), "each pod to learn the other's routes", 10)
        finally:
            if envoy is not None:
                await envoy.stop()
            for proc in procs:
                with contextlib.suppress(ProcessLookupError):
                    proc.terminate()
            for proc in procs:
                try:
                    await asyncio.wait_for(proc.wait(), 20)
                except TimeoutError:
                    proc.kill()
                    await proc.wait()
