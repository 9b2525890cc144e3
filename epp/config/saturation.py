"""The saturation detector and what acts on it: GIE's shedding admitter, or the flow controller."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from epp.config.defaults import DEFAULT_SATURATION_DETECTOR_TYPE
from epp.config.plugins import PluginSet
from epp.config.schema import Document
from epp.flowcontrol.config import FlowControlConfig
from epp.framework.errors import ConfigError
from epp.framework.plugin import SaturationDetector
from epp.requestcontrol.pipeline import PluginEntry

if TYPE_CHECKING:
    from epp.flowcontrol.controller import FlowController


def saturation_detector(document: Document, plugins: PluginSet, raw: Any,
                        where: str) -> SaturationDetector | None:
    """The detector `raw` (`{pluginRef}` at `where`) names, or the default one (auto-created when registered)."""
    entry: PluginEntry | None = None
    path = where
    if raw is not None:
        item = document.mapping(raw, where, ("pluginRef",), required=("pluginRef",))
        path = f"{where}.pluginRef"
        entry = plugins.ref(item["pluginRef"], path)
    else:
        entry = next((e for e in plugins.entries if e.type_name == DEFAULT_SATURATION_DETECTOR_TYPE), None)
    if entry is None:
        try:
            plugins.registry.get(DEFAULT_SATURATION_DETECTOR_TYPE)
        except ConfigError:
            return None
        entry = plugins.add(DEFAULT_SATURATION_DETECTOR_TYPE, plugins.free_name(DEFAULT_SATURATION_DETECTOR_TYPE),
                            None, where, auto_created="default saturation detector")
    if not isinstance(entry.plugin, SaturationDetector):
        raise document.fail(path, f"plugin {entry.name!r} (type {entry.type_name}) is no saturation detector; "
                            f"allowed: a saturation detector, e.g. {DEFAULT_SATURATION_DETECTOR_TYPE}")
    return entry.plugin


def add_shedding_admitter(plugins: PluginSet, detector: SaturationDetector) -> None:
    """GIE's default admission: the admitter that sheds sheddable requests while `detector` says saturated."""
    from epp.requestcontrol.admission import TYPE_NAME, SaturationAdmitter

    name = plugins.free_name(TYPE_NAME)
    plugins.append(PluginEntry(name, TYPE_NAME, SaturationAdmitter(name, detector, plugins.context), {},
                               auto_created=f"sheds requests of priority < 0 while {detector.name} rates the pool >= 1"))


def flow_controller(plugins: PluginSet, config: FlowControlConfig, detector: SaturationDetector) -> FlowController:
    """The flow controller over the context's endpoints, woken by their metric updates."""
    from epp.flowcontrol.controller import FlowController
    from epp.flowcontrol.metrics import FlowControlMetrics

    endpoints = plugins.context.endpoints
    assert endpoints is not None  # the caller builds a flow controller only for a pool
    controller = FlowController(config, detector, endpoints, plugins.context.load,
                                FlowControlMetrics(plugins.context.metrics_registry))
    endpoints.add_metrics_listener(controller.on_metrics_update)
    endpoints.add_listener(controller.on_endpoints_changed)
    return controller
