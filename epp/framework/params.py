"""`PluginParams`: typed, strict access to a plugin's `parameters` from the config."""

from __future__ import annotations

import builtins
from collections.abc import Iterable, Mapping
from typing import Any, overload

from epp.framework.durations import parse_duration
from epp.framework.errors import ConfigError


class PluginParams:
    """Typed, strict access to a plugin's `parameters`: unknown keys fail at start-up."""

    def __init__(self, plugin_name: str, raw: Mapping[str, Any] | None) -> None:
        if raw is not None and not isinstance(raw, Mapping):
            raise ConfigError(f"plugin {plugin_name!r}: parameters must be a mapping, got {type(raw).__name__}")
        self._plugin = plugin_name
        self._raw = dict(raw or {})
        self._seen: set[str] = set()

    @property
    def plugin_name(self) -> builtins.str:
        """The name of the plugin these parameters belong to (for error messages)."""
        return self._plugin

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

    def duration(self, key: builtins.str, default: builtins.float, *,
                 minimum: builtins.float = 0.0) -> builtins.float:
        """A duration in seconds: a number, or a Go-style string (`500ms`, `30s`, `2m`); at least `minimum`."""
        self._seen.add(key)
        value = self._raw.get(key)
        if value is None:
            return default
        if isinstance(value, builtins.str):
            seconds = parse_duration(value, what=f"plugin {self._plugin!r}: parameter {key!r}")
        elif isinstance(value, (builtins.int, builtins.float)) and not isinstance(value, builtins.bool):
            seconds = builtins.float(value)
        else:
            raise ConfigError(f"plugin {self._plugin!r}: parameter {key!r} must be a duration such as 30s or "
                              f"a number of seconds, got {value!r}")
        if seconds < minimum:
            raise ConfigError(f"plugin {self._plugin!r}: parameter {key!r} must be >= {minimum}s, got {value!r}")
        return seconds

    def list(self, key: builtins.str, default: builtins.list[Any] | None) -> builtins.list[Any] | None:
        """A list parameter; `default` when absent."""
        value: builtins.list[Any] | None = self._get(key, default, (builtins.list,), "a list")
        return value

    def mapping(self, key: builtins.str,
                default: Mapping[builtins.str, Any] | None) -> Mapping[builtins.str, Any] | None:
        """A mapping parameter; `default` when absent."""
        value: Mapping[builtins.str, Any] | None = self._get(key, default, (dict,), "a mapping")
        return value

    def unread(self) -> builtins.list[builtins.str]:
        """The parameters the plugin did not read (after it was built), sorted."""
        return sorted(set(self._raw) - self._seen)

    def finish(self) -> None:
        """Fail on any parameter the plugin did not read."""
        unknown = self.unread()
        if unknown:
            raise ConfigError(
                f"plugin {self._plugin!r}: unknown parameter(s) {unknown}; allowed: {sorted(self._seen) or 'none'}"
            )
