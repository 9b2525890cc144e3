"""Topological ordering of data producers: each runs after the producers of what it consumes."""

from __future__ import annotations

from collections.abc import Mapping

from epp.config.schema import Document
from epp.framework.plugin import DataProducer
from epp.requestcontrol.pipeline import PluginEntry


def dependency_order(producers: list[PluginEntry], producer_of: Mapping[str, PluginEntry],
                     doc: Document, named: Mapping[str, set[str]] | None = None) -> tuple[DataProducer, ...]:
    """Producers ordered so each runs after the producers of what it consumes (config order otherwise).

    `named`: a producer's name -> the producers its parameters name as its sources (whatever key they write).
    """
    deps = {e.name: ({producer_of[k].name for k in e.plugin.consumes() | e.plugin.consumes_optional()
                      if k in producer_of} | (named or {}).get(e.name, set())) - {e.name}
            for e in producers}
    ordered: list[DataProducer] = []
    placed: set[str] = set()
    remaining = list(producers)
    while remaining:
        ready = [e for e in remaining if deps[e.name] <= placed]
        if not ready:
            raise doc.fail("plugins", "data producers depend on each other in a cycle: "
                           + ", ".join(e.name for e in remaining))
        for entry in ready:
            if isinstance(entry.plugin, DataProducer):
                ordered.append(entry.plugin)
            placed.add(entry.name)
        remaining = [e for e in remaining if e.name not in placed]
    return tuple(ordered)
