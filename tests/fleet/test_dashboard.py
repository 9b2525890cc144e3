"""The Grafana dashboard queries only metrics the picker exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest

from epp.datalayer.registry import EndpointRegistry, EndpointSpec
from epp.fleet.accounting import TokenAccounting
from epp.fleet.pool_gauges import PoolGauges
from epp.fleet.sleepwake import SleepWakePolicy
from epp.framework import PluginParams
from epp.framework.plugin import PluginContext

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "epp-fleet-economics.json"


def exported_names() -> set[str]:
    registry = CollectorRegistry()
    endpoints = EndpointRegistry()
    endpoints.set_endpoints([EndpointSpec("127.0.0.1", 8000, {"model": "m"})])
    PoolGauges(endpoints, prefill_capacity_tokens_per_s=1.0).register(registry)
    accounting = TokenAccounting(registry)
    for counter in (accounting.reported, accounting.predicted, accounting.prediction_error, accounting.requests):
        counter.labels("m", "t", "x").inc()
    accounting.output.labels("m", "t").inc()
    policy = SleepWakePolicy("p", PluginParams("p", {}), PluginContext(registry, endpoints))
    policy.actions.labels("wake", "ok").inc()
    policy.held_gauge.labels("m").set(0)
    text = generate_latest(registry).decode()
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}


def test_every_dashboard_query_names_an_exported_metric():
    doc = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for panel in doc["panels"] for t in panel["targets"]]
    used = {name for expr in exprs for name in re.findall(r"\bepp_[a-z_]+", expr)}
    assert used, "the dashboard queries nothing"
    assert used <= exported_names(), f"not exported: {sorted(used - exported_names())}"
    titles = " ".join(p["title"] for p in doc["panels"]).lower()
    for topic in ("tier", "saved", "queue", "sleep"):
        assert topic in titles
