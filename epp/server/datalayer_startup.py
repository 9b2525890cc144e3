"""Starts the data layer: the discovery plugin (the config's, else the command line's) and metrics scraping."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any, Protocol

from epp.datalayer.discovery_plugins import (
    DiscoveryEnvironment,
    EndpointDiscoveryPlugin,
    default_discovery,
    discovery_flags,
)
from epp.datalayer.registry import EndpointRegistry
from epp.datalayer.scraper import MetricsScraper
from epp.framework.plugin import Plugin
from epp.framework.sharing import DecisionSharing
from epp.metrics import EppMetrics

if TYPE_CHECKING:
    from epp.requestcontrol.pipeline import ScrapeSettings

log = logging.getLogger(__name__)


class Stoppable(Protocol):
    """What the start-up hands back to be stopped at shutdown (discovery, scrapers)."""

    async def stop(self) -> None: ...


def scrape_interval(base_s: float, configured_s: float | None) -> float:
    """The scrape period: the config's `interval` rounded to a multiple of the base tick (llm-d), else the tick."""
    if not configured_s:
        return base_s
    return max(1, round(configured_s / base_s)) * base_s


def chosen_discovery(options: Any, configured: EndpointDiscoveryPlugin | None) -> EndpointDiscoveryPlugin:
    """The config's discovery plugin (the command line's discovery flags then yield to it, as in llm-d,
    with a warning), else the one the flags make."""
    if configured is None:
        return default_discovery(options)
    flags = discovery_flags(options)
    if flags:
        log.warning("the config names discovery plugin %r (%s); %s not used for discovery", configured.name,
                    configured.source(), ", ".join(flags) + (" is" if len(flags) == 1 else " are"))
    return configured


async def start_data_layer(options: Any, registry: EndpointRegistry, metrics: EppMetrics,
                           objectives: Any = None, sharing: DecisionSharing | None = None,
                           scrape: ScrapeSettings | None = None,
                           discovery_plugin: Plugin | None = None) -> list[Stoppable]:
    """Start discovery (the config's `discovery_plugin`, else the command line's) and metrics scraping as
    `scrape` says (shared with the peers through `sharing`); returns what to stop."""
    if discovery_plugin is not None and not isinstance(discovery_plugin, EndpointDiscoveryPlugin):
        raise TypeError(f"plugin {discovery_plugin.name!r} is no endpoint discovery plugin")
    plugin = chosen_discovery(options, discovery_plugin)
    env = DiscoveryEnvironment(metrics_registry=metrics.registry, objectives=objectives,
                               namespace=getattr(options, "pool_namespace", None) or os.environ.get("NAMESPACE")
                               or "default", kubeconfig=getattr(options, "kubeconfig", None))
    discovery = plugin.discovery(registry, env)
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
