"""Starts the data layer: discovery (static, file or Kubernetes) and metrics scraping."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from epp.datalayer.discovery import Discovery, FileDiscovery, StaticDiscovery
from epp.datalayer.registry import EndpointRegistry
from epp.datalayer.scraper import MetricsScraper
from epp.framework.sharing import DecisionSharing
from epp.metrics import EppMetrics

if TYPE_CHECKING:
    from epp.requestcontrol.pipeline import ScrapeSettings


class Stoppable(Protocol):
    async def stop(self) -> None: ...


def scrape_interval(base_s: float, configured_s: float | None) -> float:
    """The scrape period: the config's `interval` rounded to a multiple of the base tick (llm-d), else the tick."""
    if not configured_s:
        return base_s
    return max(1, round(configured_s / base_s)) * base_s


async def start_data_layer(options: Any, registry: EndpointRegistry, metrics: EppMetrics,
                           objectives: Any = None, sharing: DecisionSharing | None = None,
                           scrape: ScrapeSettings | None = None) -> list[Stoppable]:
    """Start discovery and metrics scraping as `scrape` says (shared with the peers through `sharing`);
    returns what to stop."""
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
    if options.scrape_metrics and scrape is not None:
        scraper = MetricsScraper(registry, interval=scrape_interval(options.refresh_metrics_interval_s,
                                                                    scrape.interval_s),
                                 metrics_registry=metrics.registry, sharing=sharing, path=scrape.path,
                                 scheme=scrape.scheme, insecure_skip_verify=scrape.insecure_skip_verify,
                                 ca_cert_path=scrape.ca_cert_path, client_cert_path=scrape.client_cert_path,
                                 client_key_path=scrape.client_key_path, families=scrape.families)
        await scraper.start()
        running.append(scraper)
    return running
