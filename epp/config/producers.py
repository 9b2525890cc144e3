"""Producer wiring: one producer per consumed data key, auto-created from the registry when none is configured."""

from __future__ import annotations

from collections.abc import Mapping

from epp.config.ordering import dependency_order
from epp.config.plugins import PluginSet
from epp.config.schema import Document
from epp.framework.plugin import DataProducer, Filter, Picker, Plugin, Scorer
from epp.framework.scheduler import SchedulerProfile
from epp.requestcontrol.pipeline import PluginEntry


class ProducerWiring:
    """Finds a producer for every data key a used plugin consumes, auto-creating the registry's default."""

    def __init__(self, doc: Document, plugins: PluginSet) -> None:
        self.doc = doc
        self.plugins = plugins

    def consumers(self, profiles: Mapping[str, SchedulerProfile]) -> list[Plugin]:
        """The plugins whose consumed data must be produced: those in a profile, and every non-profile plugin."""
        used: dict[int, Plugin] = {}
        for profile in profiles.values():
            for plugin in (*profile.filters, *(ws.scorer for ws in profile.scorers), profile.picker):
                used[id(plugin)] = plugin
        for entry in self.plugins.entries:
            if not isinstance(entry.plugin, (Filter, Scorer, Picker)):
                used[id(entry.plugin)] = entry.plugin
        return list(used.values())

    def producers(self, profiles: Mapping[str, SchedulerProfile]) -> tuple[DataProducer, ...]:
        """Every producer, a default one auto-created for each consumed key nobody produces, in dependency order."""
        producer_of: dict[str, PluginEntry] = {}

        def index(entry: PluginEntry) -> None:
            if not isinstance(entry.plugin, DataProducer):
                return
            for key in sorted(entry.plugin.produces()):
                if key in producer_of:
                    raise self.doc.fail("plugins", f"data key {key!r} is produced by both {producer_of[key].name!r} "
                                        f"and {entry.name!r}; allowed: one producer per key")
                producer_of[key] = entry

        for entry in list(self.plugins.entries):
            index(entry)
        pending = self.consumers(profiles)
        done: set[int] = set()
        while pending:
            consumer = pending.pop(0)
            if id(consumer) in done:
                continue
            done.add(id(consumer))
            for key in sorted(consumer.consumes()):
                legacy = dict(consumer.default_producer_parameters())
                if key in producer_of:
                    if legacy and producer_of[key].auto_created is None:
                        raise self.doc.fail(f"plugins[{self.plugins.position(consumer)}].parameters",
                                            f"parameters {sorted(legacy)} of {consumer.name!r} belong to the producer; "
                                            f"set them on plugin {producer_of[key].name!r} instead")
                    continue
                spec = self.plugins.registry.default_producer(key)
                if spec is None:
                    raise self.doc.fail("plugins", f"plugin {consumer.name!r} consumes data key {key!r} but no plugin "
                                        "produces it and no default producer is registered; add a plugin "
                                        "that produces it")
                entry = self.plugins.add(spec.type_name, self.plugins.free_name(spec.type_name), legacy,
                                         f"plugins[{self.plugins.position(consumer)}]",
                                         auto_created=f"default producer of {key!r} for {consumer.name!r}")
                index(entry)
                pending.append(entry.plugin)
        producers = [e for e in self.plugins.entries if isinstance(e.plugin, DataProducer)]
        return dependency_order(producers, producer_of, self.doc)
