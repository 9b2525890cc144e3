"""Plugin registry: plugin types by name, filled from the `epp.plugins` entry-point group.

An entry point names a function `register(registry: PluginRegistry) -> None`. The built-in
plugins in `epp.scorers` register through that same group, exactly like an outside package.
"""

from __future__ import annotations

import builtins
import difflib
import functools
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any, overload

from epp.framework.errors import ConfigError
from epp.framework.plugin import Plugin, PluginContext

ENTRY_POINT_GROUP = "epp.plugins"

log = logging.getLogger(__name__)


class PluginParams:
    """Typed, strict access to a plugin's `parameters`: unknown keys fail at start-up."""

    def __init__(self, plugin_name: str, raw: Mapping[str, Any] | None) -> None:
        if raw is not None and not isinstance(raw, Mapping):
            raise ConfigError(f"plugin {plugin_name!r}: parameters must be a mapping, got {type(raw).__name__}")
        self._plugin = plugin_name
        self._raw = dict(raw or {})
        self._seen: set[str] = set()

    def _get(self, key: builtins.str, default: Any, kinds: tuple[type, ...], what: builtins.str) -> Any:
        self._seen.add(key)
        if key not in self._raw or self._raw[key] is None:
            return default
        value = self._raw[key]
        if isinstance(value, bool) and bool not in kinds:
            raise ConfigError(f"plugin {self._plugin!r}: parameter {key!r} must be {what}, got {value!r}")
        if not isinstance(value, kinds):
            raise ConfigError(f"plugin {self._plugin!r}: parameter {key!r} must be {what}, got {value!r}")
        return value

    # The method names shadow the builtins inside the class body, hence `builtins.` in annotations.
    @overload
    def int(self, key: builtins.str, default: builtins.int, *,
            minimum: builtins.int | None = None) -> builtins.int: ...

    @overload
    def int(self, key: builtins.str, default: builtins.int | None, *,
            minimum: builtins.int | None = None) -> builtins.int | None: ...

    def int(self, key: builtins.str, default: builtins.int | None, *,
            minimum: builtins.int | None = None) -> builtins.int | None:
        """An integer parameter; `default` (None: unset) when absent."""
        value: builtins.int | None = self._get(key, default, (builtins.int,), "an integer")
        if minimum is not None and value is not None and value < minimum:
            raise ConfigError(f"plugin {self._plugin!r}: parameter {key!r} must be >= {minimum}, got {value}")
        return value

    def float(self, key: builtins.str, default: builtins.float, *, minimum: builtins.float | None = None,
              maximum: builtins.float | None = None) -> builtins.float:
        """A number parameter (an integer is accepted), within [minimum, maximum] when given."""
        value = builtins.float(self._get(key, default, (builtins.int, builtins.float), "a number"))
        if minimum is not None and value < minimum:
            raise ConfigError(f"plugin {self._plugin!r}: parameter {key!r} must be >= {minimum}, got {value}")
        if maximum is not None and value > maximum:
            raise ConfigError(f"plugin {self._plugin!r}: parameter {key!r} must be <= {maximum}, got {value}")
        return value

    @overload
    def bool(self, key: builtins.str, default: builtins.bool) -> builtins.bool: ...

    @overload
    def bool(self, key: builtins.str, default: builtins.bool | None) -> builtins.bool | None: ...

    def bool(self, key: builtins.str, default: builtins.bool | None) -> builtins.bool | None:
        """A true/false parameter; `default` (None: unset) when absent."""
        value: builtins.bool | None = self._get(key, default, (builtins.bool,), "true or false")
        return value

    @overload
    def str(self, key: builtins.str, default: builtins.str, *,
            choices: Iterable[builtins.str] | None = None) -> builtins.str: ...

    @overload
    def str(self, key: builtins.str, default: builtins.str | None, *,
            choices: Iterable[builtins.str] | None = None) -> builtins.str | None: ...

    def str(self, key: builtins.str, default: builtins.str | None, *,
            choices: Iterable[builtins.str] | None = None) -> builtins.str | None:
        """A string parameter, one of `choices` when given; `default` (None: unset) when absent."""
        value: builtins.str | None = self._get(key, default, (builtins.str,), "a string")
        if choices is not None and value is not None and value not in set(choices):
            raise ConfigError(
                f"plugin {self._plugin!r}: parameter {key!r} must be one of {sorted(choices)}, got {value!r}"
            )
        return value

    def list(self, key: builtins.str, default: builtins.list[Any] | None) -> builtins.list[Any] | None:
        """A list parameter; `default` when absent."""
        value: builtins.list[Any] | None = self._get(key, default, (builtins.list,), "a list")
        return value

    def mapping(self, key: builtins.str,
                default: Mapping[builtins.str, Any] | None) -> Mapping[builtins.str, Any] | None:
        """A mapping parameter; `default` when absent."""
        value: Mapping[builtins.str, Any] | None = self._get(key, default, (dict,), "a mapping")
        return value

    def finish(self) -> None:
        """Fail on any parameter the plugin did not read."""
        unknown = sorted(set(self._raw) - self._seen)
        if unknown:
            raise ConfigError(
                f"plugin {self._plugin!r}: unknown parameter(s) {unknown}; allowed: {sorted(self._seen) or 'none'}"
            )


def did_you_mean(word: str, known: Iterable[str]) -> str:
    """` (did you mean 'x'?)` when a known name is close to `word` (a typo), else ``."""
    close = difflib.get_close_matches(word, list(known), n=1, cutoff=0.75)
    return f" (did you mean {close[0]!r}?)" if close else ""


PluginFactory = Callable[[str, PluginParams, PluginContext], Plugin]


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
        """Add a plugin type; registering the same name twice is an error."""
        if spec.type_name in self._specs:
            raise ValueError(f"plugin type {spec.type_name!r} registered twice")
        self._specs[spec.type_name] = spec

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
        """Let every installed package of the group register its plugins."""
        for ep in sorted(entry_points(group=group), key=lambda e: (e.name != "builtin", e.name)):
            register = ep.load()
            register(self)
            log.debug("loaded plugins from entry point %s", ep.value)


@functools.cache
def default_registry() -> PluginRegistry:
    """The registry with every plugin installed in this environment (built-ins included)."""
    registry = PluginRegistry()
    registry.load_entry_points()
    return registry


def register_plugin(registry: PluginRegistry, cls: type[Plugin], **kwargs: Any) -> None:
    """Shorthand for `registry.register_class(cls, ...)`, for entry-point functions."""
    registry.register_class(cls, **kwargs)
