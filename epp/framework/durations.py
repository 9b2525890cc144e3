"""Go-style duration strings (`2m`, `1h30m`, `500ms`) as used in GIE and llm-d plugin parameters."""

from __future__ import annotations

import re

from epp.framework.errors import ConfigError

# time.ParseDuration's units, in seconds (both spellings of the micro sign, as Go accepts).
_UNITS = {"ns": 1e-9, "us": 1e-6, "\u00b5s": 1e-6, "\u03bcs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|\u00b5s|\u03bcs|ms|s|m|h)")


def unit_duration(value: str) -> float | None:
    """Seconds of unsigned Go duration parts with units (`1h30m`, `500ms`); None when `value` is not that."""
    pos, total = 0, 0.0
    for match in _PART.finditer(value):
        if match.start() != pos:
            break
        total += float(match.group(1)) * _UNITS[match.group(2)]
        pos = match.end()
    return total if value and pos == len(value) else None


def parse_duration(text: str, *, what: str = "duration") -> float:
    """Seconds in a Go duration string such as `2m` or `1m30.5s`; a bare `0` is zero."""
    value = text.strip()
    if value == "0":
        return 0.0
    total = unit_duration(value)
    if total is None:
        raise ConfigError(f"{what}: {text!r} is not a duration (examples: 500ms, 30s, 2m, 1h)")
    return total
