"""Entry point of the `epp.plugins` group for the fleet-economics plugins."""

from __future__ import annotations

from epp.framework.registry import PluginRegistry


def register(registry: PluginRegistry) -> None:
    """Register sleep-wake-policy and served-model-filter."""
    from epp.fleet.model_filter import ServedModelFilter
    from epp.fleet.sleepwake import SleepWakePolicy

    registry.register_class(SleepWakePolicy)
    registry.register_class(ServedModelFilter)
