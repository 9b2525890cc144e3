"""Plugins that name other plugins in their parameters (llm-d's `prefixMatchInfoProducerName`,
`deciders.prefill`, ...): the names are resolved once every plugin exists, auto-created producers
included, and each referring plugin checks what it was given."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol, runtime_checkable

from epp.config.plugins import PluginSet
from epp.config.schema import Document
from epp.framework.errors import ConfigError
from epp.framework.plugin import Plugin
from epp.framework.registry import did_you_mean


@runtime_checkable
class ReferencesPlugins(Protocol):
    """A plugin whose parameters name other plugins of the config."""

    def plugin_refs(self) -> Mapping[str, str]:
        """Parameter (its path inside `parameters`) -> the plugin name it gives."""

    def bind_plugins(self, plugins: Mapping[str, Plugin]) -> None:
        """Take the named plugins (same keys); `ConfigError` when one is not of a usable kind."""


def bind_references(document: Document, plugins: PluginSet) -> None:
    """Give every referring plugin the plugins its parameters name, or fail naming the parameter."""
    for entry in list(plugins.entries):
        plugin = entry.plugin
        if not isinstance(plugin, ReferencesPlugins):
            continue
        found: dict[str, Plugin] = {}
        for param, ref in plugin.plugin_refs().items():
            target = plugins.by_name.get(ref)
            if target is None:
                raise document.fail(f"{entry.path}.parameters.{param}",
                                     f"names plugin {ref!r}{did_you_mean(ref, plugins.by_name)}, which is not in "
                                     f"the config; defined plugins: {', '.join(plugins.by_name)}")
            found[param] = target.plugin
        try:
            plugin.bind_plugins(found)
        except ConfigError as exc:
            raise document.fail(f"{entry.path}.parameters", str(exc)) from None
