"""Plugin metrics: one set of collectors per Prometheus registry, however many plugins share it."""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry

T = TypeVar("T")

log = logging.getLogger(__name__)

_built: weakref.WeakKeyDictionary[CollectorRegistry, dict[str, Any]] = weakref.WeakKeyDictionary()


def once_per_registry(registry: CollectorRegistry | None, key: str,
                      build: Callable[[CollectorRegistry | None], T], *, shared: bool = True) -> T:
    """What `build(registry)` made the first time `key` was asked for on `registry`.

    Several plugins on one registry share the collectors instead of failing on a duplicate
    series. `shared=False` is for series of one instance (an index's size): a later caller gets
    its own unexported collectors. With no registry, each call builds fresh, unexported ones.
    """
    if registry is None:
        return build(None)
    built = _built.setdefault(registry, {})
    if key not in built:
        built[key] = build(registry)
    elif not shared:
        log.warning("another plugin already exports the %s metrics on this registry; this one does not", key)
        return build(None)
    value: T = built[key]
    return value
