"""Pickers linked as peers share the scraping: each endpoint is scraped by one of them, all see it."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

from prometheus_client import CollectorRegistry

from epp.datalayer.registry import EndpointRegistry, EndpointSpec
from epp.datalayer.scraper import MetricsScraper
from epp.netutil import free_ports
from epp.peer.node import PeerNode
from tests.support.vllm_metrics import VllmState, vllm_metrics_page
from tests.support.wait import wait_until

INTERVAL = 0.05


class Picker:
    """What a picker of the pool runs for its load view: a peer link, a registry and a scraper."""

    def __init__(self, port: int, peer_ports: list[int], specs: list[EndpointSpec], *, share: bool = True) -> None:
        self.metrics = CollectorRegistry()
        self.node = PeerNode(host="127.0.0.1", port=port, peers=[f"127.0.0.1:{p}" for p in peer_ports],
                             catch_up_timeout_s=0.5, metrics_registry=self.metrics)
        self.registry = EndpointRegistry()
        self.registry.set_endpoints(specs)
        self.scraper = MetricsScraper(self.registry, interval=INTERVAL, metrics_registry=self.metrics,
                                      sharing=self.node if share else None)

    async def start(self) -> Picker:
        await self.node.start()
        await self.scraper.start()
        return self

    async def stop(self) -> None:
        await self.scraper.stop()
        await self.node.stop()

    def counter(self, name: str, **labels: str) -> float:
        return self.metrics.get_sample_value(name, labels) or 0.0

    def following(self) -> float:
        return self.counter("epp_peer_following")

    def fresh(self, name: str, within: float) -> bool:
        return self.registry.get(name).metrics.age() < within


async def _hits_per_second(servers, seconds: float) -> float:
    before = sum(s.hits for s in servers)
    await asyncio.sleep(seconds)
    return (sum(s.hits for s in servers) - before) / seconds


@contextlib.asynccontextmanager
async def linked_pickers(specs_a: list[EndpointSpec], specs_b: list[EndpointSpec], *, share_a: bool = True,
                         share_b: bool = True) -> AsyncIterator[tuple[Picker, Picker]]:
    """Two pickers subscribed to each other, yielded once each follows the other."""
    port_a, port_b = free_ports(2)
    a = await Picker(port_a, [port_b], specs_a, share=share_a).start()
    try:
        b = await Picker(port_b, [port_a], specs_b, share=share_b).start()
        try:
            await wait_until(lambda: a.following() == b.following() == 1)
            yield a, b
        finally:
            await b.stop()
    finally:
        await a.stop()


# Enough endpoints that each of two pickers owns some: rendezvous hashing leaves all of them to one
# picker with probability 2 / 2**16 (with 6, one run in 32 did, on random ports).
SPREAD = 16


async def _pool(metrics_servers, endpoints: int):
    servers = [await metrics_servers(vllm_metrics_page(VllmState(waiting=i, kv_usage=i / 10)))
               for i in range(endpoints)]
    specs = [EndpointSpec("127.0.0.1", s.port) for s in servers]
    return servers, specs, [f"127.0.0.1:{s.port}" for s in servers]


async def test_two_linked_pickers_scrape_each_endpoint_once_and_both_see_every_endpoint(metrics_servers):
    servers, specs, names = await _pool(metrics_servers, SPREAD)
    async with linked_pickers(specs, specs) as (a, b):
        # They agree who scrapes what, and share the pool between them.
        owners = {name: (a.node.scrapes(name), b.node.scrapes(name)) for name in names}
        assert all(mine != theirs for mine, theirs in owners.values()), owners
        assert 0 < sum(mine for mine, _ in owners.values()) < len(names)

        await asyncio.sleep(3 * INTERVAL)  # past the scrapes started before the link was up
        rate = await _hits_per_second(servers, 1.0)
        # One scrape per endpoint per interval, not two (slack for a busy machine's late wake-ups).
        assert rate < 1.4 * len(names) / INTERVAL, rate

        for picker in (a, b):
            assert picker.counter("epp_metrics_peer_scrapes_total", outcome="applied") > 0
            for i, name in enumerate(names):
                assert picker.fresh(name, 3 * INTERVAL), name
                m = picker.registry.get(name).metrics
                assert (m.waiting_queue_size, m.kv_cache_usage) == (i, i / 10)
        # A replica's new load reaches the picker that does not scrape it.
        name = next(n for n, (mine, _) in owners.items() if not mine)
        servers[names.index(name)].page = vllm_metrics_page(VllmState(waiting=42))
        await wait_until(lambda: a.registry.get(name).metrics.waiting_queue_size == 42, timeout=1.0)


async def test_when_a_peer_stops_the_survivor_scrapes_its_endpoints_again(metrics_servers):
    servers, specs, names = await _pool(metrics_servers, SPREAD)
    async with linked_pickers(specs, specs) as (a, b):
        assert [name for name in names if not a.node.scrapes(name)]
        await b.stop()
        await wait_until(lambda: all(a.node.scrapes(name) for name in names))
        await asyncio.sleep(2 * INTERVAL)
        stopped_at = time.monotonic()
        await wait_until(lambda: all(a.registry.get(name).metrics.update_time > stopped_at for name in names))
        assert all(a.registry.get(name).healthy for name in names)


async def test_a_peer_that_publishes_nothing_for_its_endpoints_is_covered_by_fallback_scrapes(metrics_servers):
    servers, specs, names = await _pool(metrics_servers, SPREAD)
    # b is linked but scrapes nothing and shares nothing (a peer whose scrapes cannot get through).
    async with linked_pickers(specs, [], share_b=False) as (a, _):
        theirs = [name for name in names if not a.node.scrapes(name)]
        assert theirs
        await asyncio.sleep(5 * INTERVAL)
        since = time.monotonic()
        await wait_until(lambda: all(a.registry.get(name).metrics.update_time > since for name in theirs))
        assert a.counter("epp_metrics_scrapes_total", reason="fallback") > 0


async def test_with_shared_scrapes_off_every_picker_scrapes_every_endpoint(metrics_servers):
    servers, specs, names = await _pool(metrics_servers, 4)
    async with linked_pickers(specs, specs, share_a=False, share_b=False) as (a, _):
        await asyncio.sleep(2 * INTERVAL)
        rate = await _hits_per_second(servers, 1.0)
        assert rate > 1.3 * len(names) / INTERVAL, rate
        assert a.counter("epp_metrics_peer_scrapes_total", outcome="applied") == 0
