"""MetricsScraper against real loopback HTTP servers serving vLLM-shaped `/metrics` pages."""

from __future__ import annotations

import asyncio
import time

import pytest
from prometheus_client import CollectorRegistry

from epp.datalayer.registry import EndpointRegistry, EndpointSpec
from epp.datalayer.scraper import MetricsScraper
from tests.support.vllm_metrics import VllmState, vllm_metrics_page
from tests.support.wait import wait_until


def spec_for(server, **labels) -> EndpointSpec:
    return EndpointSpec("127.0.0.1", server.port, labels)


def errors(metrics: CollectorRegistry, endpoint: str, reason: str) -> float:
    return metrics.get_sample_value(
        "epp_metrics_scrape_errors_total", {"endpoint": endpoint, "reason": reason}) or 0.0


async def test_scraped_values_land_in_the_registry(metrics_servers):
    server = await metrics_servers(vllm_metrics_page(VllmState(
        waiting=4, running=2, kv_usage=0.5, block_size=32, num_gpu_blocks=2048,
        lora=[("a,b", "c", 4, 1.7e9)], prefix_queries=64, prefix_hits=32)))
    registry = EndpointRegistry()
    registry.set_endpoints([spec_for(server)])
    name = f"127.0.0.1:{server.port}"
    async with MetricsScraper(registry, interval=0.02):
        await wait_until(lambda: registry.get(name).metrics.update_time > 0)
        m = registry.get(name).metrics
        assert (m.waiting_queue_size, m.running_requests_size, m.kv_cache_usage) == (4, 2, 0.5)
        assert m.active_models == {"a", "b"} and m.waiting_models == {"c"}
        assert m.max_active_models == 4
        assert (m.cache_block_size, m.cache_num_blocks) == (32, 2048)
        assert (m.prefix_cache_queries, m.prefix_cache_hits) == (64, 32)
        assert abs(m.update_time - time.monotonic()) < 1.0

        # the next scrape swaps in a new immutable snapshot with the new values
        server.page = vllm_metrics_page(VllmState(waiting=9, kv_usage=0.9))
        await wait_until(lambda: registry.get(name).metrics.waiting_queue_size == 9)
        assert m.waiting_queue_size == 4  # the old snapshot did not change
        newer = registry.get(name).metrics
        assert newer.active_models == frozenset()  # LoRA series gone → default
        assert newer.update_time > m.update_time


async def test_interval_is_roughly_honoured(metrics_servers):
    server = await metrics_servers(vllm_metrics_page(VllmState()))
    registry = EndpointRegistry()
    registry.set_endpoints([spec_for(server)])
    async with MetricsScraper(registry, interval=0.05):
        await asyncio.sleep(0.6)
    # 0.6 s at 50 ms is ~12 scrapes (the first phase is random); be lenient for a busy machine
    assert 6 <= server.hits <= 15, server.hits
    gaps = [b - a for a, b in zip(server.hit_times[1:], server.hit_times[2:])]
    assert sorted(gaps)[len(gaps) // 2] >= 0.04


async def test_slow_server_times_out_and_is_counted(metrics_servers):
    server = await metrics_servers(vllm_metrics_page(VllmState(waiting=1)))
    server.delay = 0.5
    registry = EndpointRegistry()
    registry.set_endpoints([spec_for(server)])
    name = f"127.0.0.1:{server.port}"
    metrics = CollectorRegistry()
    async with MetricsScraper(registry, interval=0.02, timeout=0.1, failure_threshold=2,
                              metrics_registry=metrics):
        await wait_until(lambda: errors(metrics, name, "timeout") >= 2)
        await wait_until(lambda: not registry.get(name).healthy)
        assert registry.get(name).metrics.update_time == 0.0
        assert metrics.get_sample_value("epp_metrics_scrape_duration_seconds_count") >= 2


async def test_non_200_is_a_failure(metrics_servers):
    server = await metrics_servers("internal error")
    server.status = 503
    registry = EndpointRegistry()
    registry.set_endpoints([spec_for(server)])
    name = f"127.0.0.1:{server.port}"
    metrics = CollectorRegistry()
    async with MetricsScraper(registry, interval=0.02, failure_threshold=2, metrics_registry=metrics):
        await wait_until(lambda: not registry.get(name).healthy)
        assert errors(metrics, name, "http_status") >= 2


async def test_page_without_vllm_series_is_a_failure(metrics_servers):
    server = await metrics_servers("# just a comment\nprocess_cpu_seconds_total 1.0\n")
    registry = EndpointRegistry()
    registry.set_endpoints([spec_for(server)])
    name = f"127.0.0.1:{server.port}"
    metrics = CollectorRegistry()
    async with MetricsScraper(registry, interval=0.02, metrics_registry=metrics):
        await wait_until(lambda: errors(metrics, name, "no_metrics") >= 1)
        assert registry.get(name).metrics.update_time == 0.0


async def test_oversized_page_is_refused(metrics_servers):
    server = await metrics_servers(vllm_metrics_page(VllmState(engines=4)))
    registry = EndpointRegistry()
    registry.set_endpoints([spec_for(server)])
    name = f"127.0.0.1:{server.port}"
    metrics = CollectorRegistry()
    async with MetricsScraper(registry, interval=0.02, max_body_bytes=10_000, metrics_registry=metrics):
        await wait_until(lambda: errors(metrics, name, "too_large") >= 1)


async def test_dead_endpoint_goes_unhealthy_and_recovers(metrics_servers):
    server = await metrics_servers(vllm_metrics_page(VllmState(waiting=1)))
    other = await metrics_servers(vllm_metrics_page(VllmState(waiting=2)))
    registry = EndpointRegistry()
    registry.set_endpoints([spec_for(server), spec_for(other)])
    name, other_name = f"127.0.0.1:{server.port}", f"127.0.0.1:{other.port}"
    metrics = CollectorRegistry()
    async with MetricsScraper(registry, interval=0.02, failure_threshold=3,
                              metrics_registry=metrics) as scraper:
        await wait_until(lambda: registry.get(name).metrics.waiting_queue_size == 1)
        await server.stop()
        await wait_until(lambda: not registry.get(name).healthy)
        assert errors(metrics, name, "connect") >= 3
        assert registry.get(other_name).healthy  # one dead endpoint does not affect another
        assert registry.get(name).metrics.waiting_queue_size == 1  # last known values kept

        server.page = vllm_metrics_page(VllmState(waiting=5))
        await server.start()  # same port
        await wait_until(lambda: registry.get(name).healthy)
        assert registry.get(name).metrics.waiting_queue_size == 5
        assert name in scraper.scraping


async def test_tasks_follow_the_registry(metrics_servers):
    a = await metrics_servers(vllm_metrics_page(VllmState(waiting=1)))
    b = await metrics_servers(vllm_metrics_page(VllmState(waiting=2)))
    registry = EndpointRegistry()
    registry.set_endpoints([spec_for(a)])
    metrics = CollectorRegistry()
    scraper = MetricsScraper(registry, interval=0.02, metrics_registry=metrics)
    await scraper.start()
    try:
        assert set(scraper.scraping) == {a.hostport}
        registry.set_endpoints([spec_for(a), spec_for(b)])  # added → scraped
        await wait_until(lambda: registry.get(b.hostport).metrics.waiting_queue_size == 2)
        registry.set_endpoints([spec_for(b)])  # removed → its task stops
        await asyncio.sleep(0.05)
        hits = a.hits
        await asyncio.sleep(0.15)
        assert a.hits == hits
        assert set(scraper.scraping) == {b.hostport}
    finally:
        await scraper.stop()
    assert scraper.scraping == ()
    hits = b.hits
    await asyncio.sleep(0.1)
    assert b.hits == hits  # stopped cleanly: no more requests


async def test_metrics_port_is_used_when_given(metrics_servers):
    server = await metrics_servers(vllm_metrics_page(VllmState(running=6)))
    registry = EndpointRegistry()
    # serving port 1 is never contacted; only the metrics port is scraped
    registry.set_endpoints([EndpointSpec("127.0.0.1", 1, {}, metrics_port=server.port)])
    async with MetricsScraper(registry, interval=0.02):
        await wait_until(lambda: registry.get("127.0.0.1:1").metrics.running_requests_size == 6)


async def test_staleness_is_tracked(metrics_servers):
    server = await metrics_servers(vllm_metrics_page(VllmState()))
    registry = EndpointRegistry()
    registry.set_endpoints([spec_for(server)])
    name = server.hostport
    metrics = CollectorRegistry()
    scraper = MetricsScraper(registry, interval=0.02, staleness_threshold=0.15,
                             metrics_registry=metrics)
    assert scraper.stale_endpoints() == [name]  # never scraped
    assert metrics.get_sample_value("epp_metrics_stale_endpoints") == 1
    async with scraper:
        await wait_until(lambda: not scraper.stale_endpoints())
        assert metrics.get_sample_value("epp_metrics_stale_endpoints") == 0
        await server.stop()
        await wait_until(lambda: scraper.stale_endpoints() == [name])
        assert scraper.is_stale(registry.get(name))
        assert metrics.get_sample_value("epp_metrics_stale_endpoints") == 1


async def test_scrape_budget_stretches_the_interval(metrics_servers):
    servers = [await metrics_servers(vllm_metrics_page(VllmState())) for _ in range(2)]
    registry = EndpointRegistry()
    registry.set_endpoints([spec_for(s) for s in servers[:1]])
    metrics = CollectorRegistry()
    # 2 endpoints at 10 ms would be 200 scrapes/s; a budget of 20/s stretches it to 100 ms each
    async with MetricsScraper(registry, interval=0.01, max_scrapes_per_second=20,
                              metrics_registry=metrics) as scraper:
        assert scraper.effective_interval() == 0.05
        registry.set_endpoints([spec_for(s) for s in servers])
        assert scraper.effective_interval() == pytest.approx(0.1)
        assert metrics.get_sample_value("epp_metrics_scrape_interval_seconds") == pytest.approx(0.1)
        hits = [s.hits for s in servers]
        await asyncio.sleep(0.6)
    for server, before in zip(servers, hits):
        assert 3 <= server.hits - before <= 8, server.hits - before
    unlimited = MetricsScraper(registry, interval=0.01, max_scrapes_per_second=None)
    assert unlimited.effective_interval() == 0.01


async def test_an_unexpected_error_does_not_end_polling(metrics_servers, monkeypatch):
    from epp.datalayer import scraper as scraper_module

    server = await metrics_servers(vllm_metrics_page(VllmState(waiting=3)))
    registry = EndpointRegistry()
    registry.set_endpoints([spec_for(server)])
    metrics = CollectorRegistry()
    real_parse = scraper_module.parse_vllm_metrics
    calls = []

    def flaky_parse(page):
        calls.append(1)
        if len(calls) <= 2:
            raise RuntimeError("bug")
        return real_parse(page)

    monkeypatch.setattr(scraper_module, "parse_vllm_metrics", flaky_parse)
    async with MetricsScraper(registry, interval=0.02, metrics_registry=metrics):
        await wait_until(lambda: registry.get(server.hostport).metrics.waiting_queue_size == 3)
    assert errors(metrics, server.hostport, "internal") == 2
