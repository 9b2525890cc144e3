"""Starts the data layer: discovery (static, file or Kubernetes) and metrics scraping."""

from __future__ import annotations

from typing import Any, Protocol

from epp.datalayer.discovery import Discovery, FileDiscovery, StaticDiscovery
from epp.datalayer.registry import EndpointRegistry
from epp.datalayer.scraper import MetricsScraper
from epp.framework.sharing import DecisionSharing
from epp.metrics import EppMetrics


class Stoppable(Protocol):
    async def stop(self) -> None: ...


async def start_data_layer(options: Any, registry: EndpointRegistry, metrics: EppMetrics,
                           objectives: Any = None, sharing: DecisionSharing | None = None) -> list[Stoppable]:
    """Start discovery and metrics scraping (shared with the peers through `sharing`); returns what to stop."""
    discovery: Discovery
    if getattr(options, "pool_name", None) or getattr(options, "endpoint_selector", None):
        from epp.datalayer.kubernetes import KubernetesDiscovery

        discovery = KubernetesDiscovery(
            registry, namespace=options.pool_namespace, pool_name=options.pool_name,
            pool_group=options.pool_group, selector=options.endpoint_selector,
            target_ports=options.endpoint_target_ports, kubeconfig=options.kubeconfig,
            objectives=objectives, metrics_registry=metrics.registry)
    elif options.endpoints_file:
        discovery = FileDiscovery(registry, options.endpoints_file)
    else:
        discovery = StaticDiscovery(registry, options.endpoints)
    await discovery.start()
    running: list[Stoppable] = [discovery]
    if options.scrape_metrics:
        scraper = MetricsScraper(registry, interval=options.refresh_metrics_interval_s,
                                 metrics_registry=metrics.registry, sharing=sharing)
        await scraper.start()
        running.append(scraper)
    return running
