"""Producer wiring: a producer for every consumed data key, auto-created from the registry when none is configured.

One producer of a key serves every consumer of it. Several producers of one key (llm-d's named
producers: a GPU-tier and a CPU-tier prefix index) follow llm-d's rule: each writes under
`<key>/<its name>` except the one named as its type (llm-d's default name) or one that cannot
share its key (at most one); a consumer names the producer it reads (`prefixMatchInfoProducerName`,
...), and one that names none reads the default, auto-created when none is configured.
"""

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

    def _share_keys(self) -> None:
        """Several configured producers of one key: all but one write under `<key>/<name>` (llm-d's named producers)."""
        entries = [e for e in self.plugins.entries if isinstance(e.plugin, DataProducer)]
        keys = sorted({key for e in entries for key in e.plugin.produces()})  # type: ignore[attr-defined]
        for key in keys:
            live = [e for e in entries if key in e.plugin.produces()]  # type: ignore[attr-defined]
            if len(live) < 2:
                continue
            # The one that keeps the plain key: a producer that cannot share it, else one named as its type.
            fixed = [e for e in live if not e.plugin.publish_under({})]  # type: ignore[attr-defined]
            if len(fixed) > 1:
                raise self.doc.fail("plugins", f"data key {key!r} is produced by both {fixed[0].name!r} and "
                                    f"{fixed[1].name!r}; allowed: one producer per key (these types cannot share one)")
            keeper = fixed[0] if fixed else next((e for e in live if e.name == e.type_name), None)
            for entry in live:
                if entry is not keeper:
                    plugin = entry.plugin
                    assert isinstance(plugin, DataProducer)
                    plugin.publish_under({k: f"{k}/{entry.name}" for k in plugin.produces() if "/" not in k})

    def _named_producers(self, consumer: Plugin) -> dict[str, PluginEntry]:
        """The producers a consumer names in its parameters (`prefixMatchInfoProducerName`, ...), by name."""
        refs = getattr(consumer, "plugin_refs", None)
        if refs is None:
            return {}
        named = {}
        for ref in refs().values():
            entry = self.plugins.by_name.get(ref)
            if entry is not None and isinstance(entry.plugin, DataProducer):
                named[ref] = entry
        return named

    def producers(self, profiles: Mapping[str, SchedulerProfile]) -> tuple[DataProducer, ...]:
        """Every producer, a default one auto-created for each consumed key nobody produces, in dependency order."""
        self._share_keys()
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
        # Consumers that name their producer depend on it whatever key it writes under.
        named_deps: dict[str, set[str]] = {}
        pending = self.consumers(profiles)
        done: set[int] = set()
        while pending:
            consumer = pending.pop(0)
            if id(consumer) in done:
                continue
            done.add(id(consumer))
            named = self._named_producers(consumer)
            for key in sorted(consumer.consumes()):
                source = next((e for e in named.values() if key in _original_keys(e)), None)
                if source is not None:
                    named_deps.setdefault(consumer.name, set()).add(source.name)
                    continue
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
            for entry in named.values():
                if any(key in _original_keys(entry) for key in consumer.consumes_optional()):
                    named_deps.setdefault(consumer.name, set()).add(entry.name)
        producers = [e for e in self.plugins.entries if isinstance(e.plugin, DataProducer)]
        return dependency_order(producers, producer_of, self.doc, named_deps)


def _original_keys(entry: PluginEntry) -> frozenset[str]:
    """The data keys a producer writes, by their plain names (before `publish_under` renamed them)."""
    plugin = entry.plugin
    assert isinstance(plugin, DataProducer)
    suffix = f"/{entry.name}"
    return frozenset(k[: -len(suffix)] if k.endswith(suffix) else k for k in plugin.produces())
