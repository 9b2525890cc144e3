"""The runtime pipeline the director runs, with its plugins' lifecycle; `epp.config` builds it from a config."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from epp.flowcontrol.config import FEATURE_GATE as FLOW_CONTROL_GATE
from epp.flowcontrol.config import FlowControlConfig
from epp.framework.parsing import Parser
from epp.framework.plugin import (
                                  Admitter,
                                  CapacityGate,
                                  DataProducer,
                                  Filter,
                                  FirstTokenHook,
                                  Picker,
                                  Plugin,
                                  PreRequestHook,
                                  ProfileHandler,
                                  RequestPreprocessor,
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
    # For an llm-d plugin type: what it maps to here, the parameters taken and the differences.
    mapping: str | None = None
    path: str = ""  # where the config defines it (`plugins[2]`), or what made the loader add it


@dataclass(frozen=True)
class DataSourceConfig:
    """A `dataLayer.sources[]` entry: a source plugin and its extractor plugins."""

    source: Plugin
    extractors: tuple[Plugin, ...]


@dataclass(frozen=True)
class ScrapeSettings:
    """How model-server metrics are scraped: the `metrics-data-source` of the `dataLayer` section."""

    scheme: str = "http"
    path: str = "/metrics"
    # llm-d's default: pods serve self-signed certificates, so https is not verified unless asked.
    insecure_skip_verify: bool = True
    ca_cert_path: str | None = None
    client_cert_path: str | None = None
    client_key_path: str | None = None
    interval_s: float | None = None  # None: every --refresh-metrics-interval
    families: frozenset[str] | None = None  # the metric families kept (None: all this picker reads)

    def describe(self) -> str:
        """One line for `epp check-config`."""
        text = f"{self.scheme}://<endpoint>{self.path}"
        if self.scheme == "https":
            text += (" (certificate not verified: insecureSkipVerify)" if self.insecure_skip_verify
                     else f" (verified against {self.ca_cert_path or 'the system CAs'})")
            if self.client_cert_path:
                text += f", client certificate {self.client_cert_path}"
        if self.interval_s is not None:
            text += f", every {self.interval_s:g}s"
        return text


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
    # How endpoints' metrics are scraped; None: no metrics source (`dataLayer.injectDefaults: false`).
    scrape: ScrapeSettings | None = ScrapeSettings()
    # The request parsers in the order they are asked (`requestHandler.parsers`, or llm-d's default chain).
    parsers: tuple[Parser, ...] = ()
    # The `flowControl` section, validated even when the feature gate is off; used only with the gate.
    flow_control_section: FlowControlConfig | None = None
    capacity_gates: tuple[CapacityGate, ...] = ()
    # With the `flowControl` gate: queues requests while the pool is saturated (replaces shedding, as in GIE).
    flow_controller: FlowController | None = None
    # Deprecations, fields accepted with no effect here, differences from llm-d (`epp check-config`).
    notes: tuple[str, ...] = ()
    # The notes that say something is served differently from llm-d (a subset of `notes`).
    notices: tuple[str, ...] = ()
    # The config's endpoint discovery plugin (`dataLayer.discovery.endpoints.pluginRef`); None: the command
    # line's discovery flags.
    discovery: Plugin | None = None

    @property
    def parser(self) -> Parser | None:
        """The first configured request parser (`requestHandler.parsers`), if any."""
        return self.parsers[0] if self.parsers else None

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
    kinds = [("parser", Parser),
             ("filter", Filter), ("scorer", Scorer), ("picker", Picker), ("profile-handler", ProfileHandler),
             ("data-producer", DataProducer), ("admitter", Admitter), ("pre-request", PreRequestHook),
             ("first-token", FirstTokenHook), ("response-headers", ResponseHeadersHook),
             ("response-complete", ResponseCompleteHook),
             ("capacity-gate", CapacityGate), ("saturation-detector", SaturationDetector),
             ("preprocessor", RequestPreprocessor)]
    return [label for label, cls in kinds if isinstance(plugin, cls)]
