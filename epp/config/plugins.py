"""The plugin instances of one load: built through the registry, named uniquely, found by reference."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from epp.config.schema import PLUGIN_FIELDS, Document
from epp.framework.errors import ConfigError
from epp.framework.plugin import Plugin, PluginContext
from epp.framework.registry import PluginRegistry, did_you_mean
from epp.requestcontrol.pipeline import PluginEntry


class PluginSet:
    """The plugins of one document in the order they were added (configured first, then auto-created)."""

    def __init__(self, document: Document, registry: PluginRegistry, context: PluginContext) -> None:
        self.document = document
        self.registry = registry
        self.context = context
        self.entries: list[PluginEntry] = []
        self.by_name: dict[str, PluginEntry] = {}

    def add_configured(self, doc: Mapping[str, Any]) -> None:
        """The configured `plugins[]`, in order."""
        for i, raw in enumerate(self.document.sequence(doc.get("plugins"), "plugins", "plugin definitions")):
            path = f"plugins[{i}]"
            item = self.document.mapping(raw, path, PLUGIN_FIELDS, required=("type",))
            type_name = self.document.string(item["type"], f"{path}.type")
            name = self.document.string(item["name"], f"{path}.name") if item.get("name") is not None else type_name
            if name in self.by_name:
                raise self.document.fail(f"{path}.name", f"duplicate plugin name {name!r}; plugin names must be unique "
                                         "(name defaults to type)")
            params = item.get("parameters")
            if params is not None and not isinstance(params, dict):
                raise self.document.fail(f"{path}.parameters", f"must be a mapping, got {type(params).__name__}")
            self.add(type_name, name, params, path)

    def add(self, type_name: str, name: str, parameters: Mapping[str, Any] | None, path: str,
            auto_created: str | None = None) -> PluginEntry:
        """Build a plugin of a registered type; errors name `path` (its `type` or `parameters`)."""
        fail = self.document.fail
        try:
            self.registry.get(type_name)
        except ConfigError as exc:
            raise fail(f"{path}.type" if not auto_created else path, str(exc)) from None
        try:
            plugin = self.registry.build(type_name, name, parameters, self.context)
        except ConfigError as exc:
            raise fail(f"{path}.parameters" if not auto_created else path, str(exc)) from None
        return self.append(PluginEntry(name, type_name, plugin, dict(parameters or {}), auto_created))

    def append(self, entry: PluginEntry) -> PluginEntry:
        """Add a plugin the loader built itself (not through the registry)."""
        self.entries.append(entry)
        self.by_name[entry.name] = entry
        return entry

    def free_name(self, base: str) -> str:
        """`base`, or `base-2`, `base-3`, ... whichever no plugin has yet."""
        name, n = base, 1
        while name in self.by_name:
            n += 1
            name = f"{base}-{n}"
        return name

    def ref(self, value: Any, path: str) -> PluginEntry:
        """The plugin a `pluginRef` at `path` names."""
        name = self.document.string(value, path)
        entry = self.by_name.get(name)
        if entry is None:
            raise self.document.fail(path, f"unknown plugin {name!r}{did_you_mean(name, self.by_name)}; "
                                     f"defined plugins: {', '.join(self.by_name) or 'none'}")
        return entry

    def typed_ref(self, value: Any, path: str, allowed_types: tuple[str, ...]) -> Plugin:
        """The plugin a `pluginRef` names, which must be of one of `allowed_types`."""
        entry = self.ref(value, path)
        if entry.type_name not in allowed_types:
            raise self.document.fail(path, f"plugin {entry.name!r} has type {entry.type_name}; allowed types: "
                                     f"{', '.join(allowed_types)}")
        return entry.plugin

    def position(self, plugin: Plugin) -> int:
        """Index of `plugin` among the entries (its `plugins[i]` when configured)."""
        for i, entry in enumerate(self.entries):
            if entry.plugin is plugin:
                return i
        return -1

    def plugins(self) -> list[Plugin]:
        """Every plugin instance so far."""
        return [entry.plugin for entry in self.entries]
