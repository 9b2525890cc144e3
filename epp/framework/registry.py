"""Plugin registry: plugin types by name, filled from the `epp.plugins` entry-point group.

An entry point names a function `register(registry: PluginRegistry) -> None`. The built-in
plugins in `epp.scorers` register through that same group, exactly like an outside package.
"""

from __future__ import annotations

import difflib
import functools
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any

from epp.framework.errors import ConfigError
from epp.framework.params import PluginParams
from epp.framework.plugin import Plugin, PluginContext

ENTRY_POINT_GROUP = "epp.plugins"

log = logging.getLogger(__name__)


def did_you_mean(word: str, known: Iterable[str]) -> str:
    """` (did you mean 'x'?)` when a known name is close to `word` (a typo), else ``."""
    close = difflib.get_close_matches(word, list(known), n=1, cutoff=0.75)
    return f" (did you mean {close[0]!r}?)" if close else ""


PluginFactory = Callable[[str, PluginParams, PluginContext], Plugin]


def _origin(factory: PluginFactory) -> str:
    """`module.Name` of a factory (a plugin class or a function), for registration errors."""
    return f"{getattr(factory, '__module__', '?')}.{getattr(factory, '__qualname__', repr(factory))}"


@dataclass(frozen=True)
class PluginSpec:
    """A registered plugin type: how to build it, and the data keys it produces by default."""

    type_name: str
    factory: PluginFactory
    description: str = ""
    default_producer_for: frozenset[str] = field(default_factory=frozenset)


class PluginRegistry:
    """Plugin types by `type` name."""

    def __init__(self) -> None:
        self._specs: dict[str, PluginSpec] = {}

    def register(self, spec: PluginSpec) -> None:
        """Add a plugin type; ValueError for an empty type name or one already registered."""
        name = spec.type_name
        if not isinstance(name, str) or not name or name != name.strip():
            raise ValueError(f"{_origin(spec.factory)} has no usable plugin type name ({name!r}): set its "
                             "`type_name` to the name configs use in `type:`")
        registered = self._specs.get(name)
        if registered is not None:
            raise ValueError(f"plugin type {name!r} registered twice: by {_origin(registered.factory)} and by "
                             f"{_origin(spec.factory)}")
        self._specs[name] = spec

    def register_class(self, cls: type[Plugin], description: str = "",
                       default_producer_for: Iterable[str] = ()) -> None:
        """Register a class whose constructor is `cls(name, params, context)`."""
        self.register(PluginSpec(cls.type_name, cls, description or (cls.__doc__ or "").strip().split("\n")[0],
                                 frozenset(default_producer_for)))

    def get(self, type_name: str) -> PluginSpec:
        try:
            return self._specs[type_name]
        except KeyError:
            raise ConfigError(
                f"unknown plugin type {type_name!r}{did_you_mean(type_name, self._specs)}; "
                f"registered types: {', '.join(sorted(self._specs))}"
            ) from None

    def types(self) -> list[str]:
        return sorted(self._specs)

    def default_producer(self, data_key: str) -> PluginSpec | None:
        """The plugin type auto-created when a consumed data key has no configured producer."""
        for spec in self._specs.values():
            if data_key in spec.default_producer_for:
                return spec
        return None

    def build(self, type_name: str, name: str, parameters: Mapping[str, Any] | None,
              context: PluginContext) -> Plugin:
        """Instantiate a plugin; its parameters are validated strictly."""
        spec = self.get(type_name)
        params = PluginParams(name, parameters)
        plugin = spec.factory(name, params, context)
        params.finish()
        return plugin

    def load_entry_points(self, group: str = ENTRY_POINT_GROUP) -> None:
        """Let every installed package of the group register its plugins (ConfigError naming a package that fails)."""
        for ep in sorted(entry_points(group=group), key=lambda e: (e.name != "builtin", e.name)):
            register = ep.load()
            try:
                register(self)
            except ValueError as exc:
                raise ConfigError(f"the plugins of entry point {ep.name!r} ({ep.value}) cannot be registered: "
                                  f"{exc}") from exc
            log.debug("loaded plugins from entry point %s", ep.value)


@functools.cache
def default_registry() -> PluginRegistry:
    """The registry with every plugin installed in this environment (built-ins included)."""
    registry = PluginRegistry()
    registry.load_entry_points()
    return registry
