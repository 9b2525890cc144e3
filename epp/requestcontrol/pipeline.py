"""The runtime pipeline the director runs, with its plugins' lifecycle; `epp.config` builds it from a config."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from epp.flowcontrol.config import FEATURE_GATE as FLOW_CONTROL_GATE
from epp.flowcontrol.config import FlowControlConfig
from epp.framework.plugin import (
                                  Admitter,
                                  CapacityGate,
                                  DataProducer,
                                  Filter,
                                  Picker,
                                  Plugin,
                                  PreRequestHook,
                                  ProfileHandler,
                                  ResponseCompleteHook,
                                  ResponseHeadersHook,
                                  SaturationDetector,
                                  Scorer,
)
from epp.framework.scheduler import Scheduler

if TYPE_CHECKING:
    from epp.flowcontrol.controller import FlowController

log = logging.getLogger(__name__)

P = TypeVar("P", bound=Plugin)


@dataclass(frozen=True)
class PluginEntry:
    """One plugin instance of the pipeline and where it came from."""

    name: str
    type_name: str
    plugin: Plugin
    parameters: Mapping[str, Any]
    auto_created: str | None = None  # why the loader added it, or None when configured


@dataclass(frozen=True)
class DataSourceConfig:
    """A `dataLayer.sources[]` entry: a source plugin and its extractor plugins."""

    source: Plugin
    extractors: tuple[Plugin, ...]


@dataclass(frozen=True)
class LoadedConfig:
    """The runtime pipeline the director runs, built only by the loader.

    The scheduler, producers in dependency order, admitters, capacity gates, hooks, the flow
    controller (with the `flowControl` gate and an endpoint source in the context), and every
    plugin instance with its lifecycle.
    """

    source: str
    scheduler: Scheduler
    data_producers: tuple[DataProducer, ...]
    admitters: tuple[Admitter, ...]
    pre_request_hooks: tuple[PreRequestHook, ...]
    response_headers_hooks: tuple[ResponseHeadersHook, ...]
    response_complete_hooks: tuple[ResponseCompleteHook, ...]
    saturation_detector: SaturationDetector | None
    feature_gates: frozenset[str]
    objectives: Mapping[str, int]
    plugins: tuple[PluginEntry, ...]
    data_sources: tuple[DataSourceConfig, ...] = ()
    parser: Plugin | None = None
    # The `flowControl` section, validated even when the feature gate is off; used only with the gate.
    flow_control_section: FlowControlConfig | None = None
    capacity_gates: tuple[CapacityGate, ...] = ()
    # With the `flowControl` gate: queues requests while the pool is saturated (replaces shedding, as in GIE).
    flow_controller: FlowController | None = None

    @property
    def flow_control(self) -> FlowControlConfig | None:
        """The flow-control config when the `flowControl` feature gate is on (GIE: off by default)."""
        if FLOW_CONTROL_GATE not in self.feature_gates:
            return None
        return self.flow_control_section or FlowControlConfig()

    @property
    def saturation_detector_ref(self) -> str | None:
        """Name of the saturation detector plugin, if any."""
        return self.saturation_detector.name if self.saturation_detector is not None else None

    def plugins_of(self, kind: type[P]) -> tuple[P, ...]:
        """The plugin instances of one kind (a class), in config order."""
        return tuple(entry.plugin for entry in self.plugins if isinstance(entry.plugin, kind))

    def plugin(self, name: str) -> Plugin:
        """The plugin instance named `name`."""
        for entry in self.plugins:
            if entry.name == name:
                return entry.plugin
        raise KeyError(name)

    async def start(self) -> None:
        """Start every plugin's background work, in pipeline order."""
        for entry in self.plugins:
            await entry.plugin.start()

    async def stop(self) -> None:
        """Stop every plugin, in reverse order; one that fails to stop does not keep the others running."""
        for entry in reversed(self.plugins):
            try:
                await entry.plugin.stop()
            except Exception:
                log.exception("stopping plugin %s failed", entry.name)


def plugin_kinds(plugin: Plugin) -> list[str]:
    """What a plugin is (filter, scorer, ...), for messages and `describe`."""
    kinds = [("filter", Filter), ("scorer", Scorer), ("picker", Picker), ("profile-handler", ProfileHandler),
             ("data-producer", DataProducer), ("admitter", Admitter), ("pre-request", PreRequestHook),
             ("response-headers", ResponseHeadersHook), ("response-complete", ResponseCompleteHook),
             ("capacity-gate", CapacityGate), ("saturation-detector", SaturationDetector)]
    return [label for label, cls in kinds if isinstance(plugin, cls)]
