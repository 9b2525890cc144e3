"""Prometheus view of the in-flight ledger: the picker's own work per endpoint of the pool."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from epp.datalayer.registry import EndpointRegistry
from epp.framework.load import InflightLedger
from epp.framework.types import Endpoint


class LedgerCollector(Collector):
    """Collects the ledger at scrape time; series exist only for endpoints of the pool (bounded)."""

    def __init__(self, ledger: InflightLedger, endpoints: EndpointRegistry) -> None:
        self.ledger = ledger
        self.endpoints = endpoints

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        inflight = GaugeMetricFamily("epp_inflight_requests",
                                     "Requests this picker sent to an endpoint and has not seen end.",
                                     labels=["endpoint"])
        prefill = GaugeMetricFamily("epp_inflight_prefill_tokens",
                                    "Uncached prompt tokens of requests whose first token was not seen yet.",
                                    labels=["endpoint"])
        unseen = GaugeMetricFamily("epp_inflight_unseen_requests",
                                   "Requests sent after the endpoint's last /metrics scrape.",
                                   labels=["endpoint"])
        backlog = GaugeMetricFamily("epp_inflight_prefill_backlog_tokens",
                                    "Of those, the tokens still to prefill now (the ledger's backlog model).",
                                    labels=["endpoint"])
        speed = GaugeMetricFamily("epp_prefill_seconds_per_token",
                                  "Prefill speed the backlog model uses (learned from uncontended first tokens, "
                                  "else the prior).", labels=["endpoint"])
        age = GaugeMetricFamily("epp_endpoint_scrape_age_seconds",
                                "Seconds since the endpoint's metrics were scraped (absent if never).",
                                labels=["endpoint"])
        for ep in self.endpoints.snapshot():
            load = self.ledger.load(ep)
            inflight.add_metric([ep.name], load.inflight_requests)
            prefill.add_metric([ep.name], load.prefill_tokens)
            unseen.add_metric([ep.name], load.unseen_requests)
            backlog.add_metric([ep.name], load.prefill_backlog_tokens)
            speed.add_metric([ep.name], self.ledger.prefill_seconds_per_token(ep.name))
            if load.scrape_age_s != float("inf"):
                age.add_metric([ep.name], load.scrape_age_s)
        yield from (inflight, prefill, backlog, speed, unseen, age)
        tracked = GaugeMetricFamily("epp_inflight_tracked_requests", "Bookings the in-flight ledger holds.")
        tracked.add_metric([], len(self.ledger))
        yield tracked
        dropped = CounterMetricFamily("epp_inflight_dropped",
                                      "Bookings dropped at capacity or timeout (their end was never seen).")
        dropped.add_metric([], self.ledger.dropped)
        yield dropped


def register_ledger_metrics(ledger: InflightLedger, endpoints: EndpointRegistry,
                            registry: CollectorRegistry) -> None:
    """Export the ledger on `registry` and forget endpoints that leave the pool."""
    registry.register(LedgerCollector(ledger, endpoints))

    def on_change(added: tuple[Endpoint, ...], removed: tuple[Endpoint, ...]) -> None:
        for ep in removed:
            ledger.remove_endpoint(ep.name)

    endpoints.add_listener(on_change)
