"""Fake vLLM pods for black-box tests: real aiohttp servers serving `/metrics` on distinct loopback IPs.

Pods sit at `127.0.0.<idx + 2>:<port>`, every pod on the same port, the way GIE's integration
tests put pods at `192.168.1.<idx + 1>:8000`. Linux routes all of 127.0.0.0/8 to loopback, so
each bind works without any setup.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence

from bench.support.metrics_server import MetricsServer
from epp.datalayer.registry import EndpointSpec
from epp.framework.types import Endpoint
from epp.server.runner import EppServer, ServeOptions
from tests.support.vllm_metrics import VllmState, vllm_metrics_page
from tests.support.wait import wait_until

# vLLM keeps one `lora_requests_info` series per adapter set it ever had; the value is the
# set's creation time and the newest one is the truth. Every pod also carries an older series
# naming an adapter it no longer runs: a parser that took the first series would see it.
STALE_ADAPTER = "sql-lora-1fdg2"
OLD_LORA_TIMESTAMP = 1.7e9
NEW_LORA_TIMESTAMP = 1.7e9 + 3600.0


def pod_address(idx: int) -> str:
    """The loopback address of pod `idx` (127.0.0.2, 127.0.0.3, ...)."""
    return f"127.0.0.{idx + 2}"


def common_free_port(hosts: Sequence[str], attempts: int = 50) -> int:
    """A TCP port that is free on every host of `hosts` right now."""
    for _ in range(attempts):
        with socket.socket() as first:
            first.bind((hosts[0], 0))
            port = first.getsockname()[1]
            others = []
            try:
                for host in hosts[1:]:
                    sock = socket.socket()
                    others.append(sock)
                    sock.bind((host, port))
            except OSError:
                continue
            finally:
                for sock in others:
                    sock.close()
            return port
    raise RuntimeError(f"no common free port on {hosts}")


class FakeVllmPod(MetricsServer):
    """One pod: vLLM's `/metrics` page with the queue / KV / LoRA values set by the test."""

    def __init__(self, host: str, port: int, *, block_size: int = 16, num_gpu_blocks: int = 100_000) -> None:
        super().__init__(host=host, port=port)
        self.state = VllmState(block_size=block_size, num_gpu_blocks=num_gpu_blocks)
        self.set()

    @property
    def spec(self) -> EndpointSpec:
        return EndpointSpec(self.host, self.port)

    def set(self, queue: int = 0, kv: float = 0.0, active: Sequence[str] = (), waiting: Sequence[str] = (),
            max_lora: int = 0, running: int = 0) -> FakeVllmPod:
        """What the pod reports from now on (GIE's `P(idx, queue, kv, activeModels...)`)."""
        self.expected = (queue, kv, frozenset(active), frozenset(waiting), max_lora)
        self.state.waiting = queue
        self.state.running = running
        self.state.kv_usage = kv
        self.state.lora = [
            (STALE_ADAPTER, "", max_lora, OLD_LORA_TIMESTAMP),
            (",".join(active), ",".join(waiting), max_lora, NEW_LORA_TIMESTAMP),
        ]
        return self

    def render(self) -> str:
        """The page from the pod's current state (a test may also change `state` directly)."""
        return vllm_metrics_page(self.state)


async def start_pods(count: int) -> list[FakeVllmPod]:
    """`count` pods at 127.0.0.2.. on one common free port."""
    hosts = [pod_address(i) for i in range(count)]
    port = common_free_port(hosts)
    return [await FakeVllmPod(host, port).start() for host in hosts]


async def start_picker(config_text: str | None, endpoints: Sequence[EndpointSpec]) -> EppServer:
    """The real picker with the real config loader and the real `/metrics` scraper (every 50 ms)."""
    server = EppServer(ServeOptions(
        grpc_port=0, grpc_health_port=0, metrics_port=0, bind_address="127.0.0.1",
        config_text=config_text, endpoints=list(endpoints), scrape_metrics=True,
        refresh_metrics_interval_s=0.05, grace_period_s=1))
    await server.start()
    return server


def reports(endpoint: Endpoint | None, pod: FakeVllmPod) -> bool:
    """Whether the registry holds this pod's current values (scraped at least once since set())."""
    if endpoint is None or not endpoint.healthy or endpoint.metrics.update_time <= 0:
        return False
    queue, kv, active, waiting, max_lora = pod.expected
    m = endpoint.metrics
    return (m.waiting_queue_size == queue and abs(m.kv_cache_usage - kv) < 1e-9 and m.active_models == active
            and m.waiting_models == waiting and m.max_active_models == max_lora)


async def wait_for_scraped(server: EppServer, pods: Sequence[FakeVllmPod], timeout: float = 5.0) -> None:
    """Wait until the picker's registry shows every pod's current values."""
    await wait_until(lambda: all(reports(server.endpoints.get(p.hostport), p) for p in pods),
                     "the scraper to pick up " + ", ".join(p.hostport for p in pods), timeout)
