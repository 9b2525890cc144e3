"""Builds the request pipeline from the EndpointPickerConfig and starts the data layer."""

from __future__ import annotations

from typing import Any

from epp.datalayer.registry import EndpointRegistry
from epp.director import AdmissionPolicy, Pipeline
from epp.framework.plugin import PluginContext
from epp.metrics import EppMetrics


def load_pipeline(options: Any, context: PluginContext) -> tuple[Pipeline, AdmissionPolicy | None, dict[str, int]]:
    """The configured pipeline, its admission policy and the objective → priority map."""
    raise NotImplementedError("wired once the config loader lands")


async def start_data_layer(options: Any, registry: EndpointRegistry, metrics: EppMetrics) -> list[Any]:
    """Start discovery and metrics scraping; returns what must be stopped on shutdown."""
    registry.set_endpoints(options.endpoints)
    return []
