"""Builds the request pipeline from the EndpointPickerConfig and starts the data layer."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from epp.config.loader import LoadedConfig, load_config, load_config_text, load_default_config
from epp.datalayer.discovery import Discovery, FileDiscovery, StaticDiscovery
from epp.datalayer.registry import EndpointRegistry
from epp.datalayer.scraper import MetricsScraper
from epp.director import AdmissionPolicy, Pipeline
from epp.framework.plugin import CapacityGate, PluginContext
from epp.metrics import EppMetrics

if TYPE_CHECKING:
    from epp.flowcontrol.controller import FlowController


class Stoppable(Protocol):
    async def stop(self) -> None: ...


def load_config_for(options: Any, context: PluginContext) -> LoadedConfig:
    """The config of `options` (file or text), or GIE's system defaults when none is given."""
    if options.config_file:
        return load_config(options.config_file, context=context)
    if options.config_text:
        return load_config_text(options.config_text, context=context)
    return load_default_config(context=context)


def pipeline_of(loaded: LoadedConfig) -> Pipeline:
    """The request-path view of a loaded config."""
    return Pipeline(
        scheduler=loaded.scheduler,
        producers=loaded.data_producers,
        admitters=loaded.admitters,
        pre_request_hooks=loaded.pre_request_hooks,
        response_headers_hooks=loaded.response_headers_hooks,
        response_complete_hooks=loaded.response_complete_hooks,
        capacity_gates=tuple(p for p in loaded.plugin_instances if isinstance(p, CapacityGate)),
        plugins=loaded.plugin_instances,
    )


def load_pipeline(options: Any, context: PluginContext) -> tuple[Pipeline, AdmissionPolicy | None, dict[str, int]]:
    """The configured pipeline, its admission policy and the objective → priority map."""
    loaded = load_config_for(options, context)
    pipeline = pipeline_of(loaded)
    if loaded.flow_control is not None:
        pipeline.flow_control = flow_controller_of(loaded, context)
        return pipeline, None, dict(loaded.objectives)  # flow control replaces shedding, as in GIE
    admission = None
    if loaded.saturation_detector is not None:
        from epp.admission import AdmissionController

        admission = AdmissionController(loaded.saturation_detector, metrics_registry=context.metrics_registry)
    return pipeline, admission, dict(loaded.objectives)


def flow_controller_of(loaded: LoadedConfig, context: PluginContext) -> FlowController:
    """The flow controller of a config with the `flowControl` gate, woken by the endpoint registry."""
    from epp.flowcontrol.controller import FlowController
    from epp.flowcontrol.metrics import FlowControlMetrics

    assert loaded.flow_control is not None and context.endpoints is not None
    controller = FlowController(loaded.flow_control, loaded.saturation_detector,  # type: ignore[arg-type]
                                context.endpoints, FlowControlMetrics(context.metrics_registry))
    context.endpoints.add_metrics_listener(controller.on_metrics_update)
    context.endpoints.add_listener(controller.forget_endpoints)
    return controller


async def start_data_layer(options: Any, registry: EndpointRegistry, metrics: EppMetrics,
                           objectives: Any = None) -> list[Stoppable]:
    """Start discovery and metrics scraping; returns what must be stopped on shutdown."""
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
                                 metrics_registry=metrics.registry)
        await scraper.start()
        running.append(scraper)
    return running
