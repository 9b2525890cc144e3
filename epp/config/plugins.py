"""The plugin instances of one load: built through the registry, named uniquely, found by reference."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from epp.config.llmd import ALIASES, PARAMETERLESS_TYPES, mapping_line, refused
from epp.config.llmd_mapped import MAPPED_TYPES, PARAMETER_ADAPTERS, Absorbed
from epp.config.llmd_mapped import adapt as adapt_mapped
from epp.config.llmd_precise import is_llmd_shape, precise_parameters
from epp.config.schema import PLUGIN_FIELDS, Document
from epp.framework.errors import ConfigError
from epp.framework.params import PluginParams
from epp.framework.plugin import Plugin, PluginContext
from epp.framework.registry import PluginRegistry, did_you_mean
from epp.requestcontrol.pipeline import PluginEntry

PRECISE_PRODUCER_TYPE = "precise-prefix-cache-producer"
APPROX_PRODUCER_TYPE = "approx-prefix-cache-producer"
# llm-d types mapped onto predicted-ttft-scorer, which reads PREFIX_TIER_MATCH.
TIER_MATCH_MAPPINGS = ("latency-scorer", "predicted-latency-producer")
PRECISE_WRAPPER_TYPE = "precise-prefix-cache-scorer"
TOKEN_PRODUCER_TYPE = "token-producer"


class PluginSet:
    """The plugins of one document in the order they were added (configured first, then auto-created)."""

    def __init__(self, document: Document, registry: PluginRegistry, context: PluginContext) -> None:
        self.document = document
        self.registry = registry
        self.context = context
        self.entries: list[PluginEntry] = []
        self.by_name: dict[str, PluginEntry] = {}
        # The deprecated precise-prefix-cache-scorer's name -> its producer half (llm-d's older configs
        # name the wrapper where a producer is meant: a data source's extractor).
        self.wrapper_producers: dict[str, str] = {}
        # The one model the document's token-producer renders for (None: none, or several).
        self.token_model: str | None = None

    def add_configured(self, doc: Mapping[str, Any]) -> None:
        """The configured `plugins[]`, in order (llm-d's deprecated names and wrapper resolved)."""
        items = []
        for i, raw in enumerate(self.document.sequence(doc.get("plugins"), "plugins", "plugin definitions")):
            path = f"plugins[{i}]"
            item = self.document.mapping(raw, path, PLUGIN_FIELDS, required=("type",))
            type_name = self.document.string(item["type"], f"{path}.type")
            name = self.document.string(item["name"], f"{path}.name") if item.get("name") is not None else type_name
            params = item.get("parameters")
            if params is not None and not isinstance(params, dict):
                raise self.document.fail(f"{path}.parameters", f"must be a mapping, got {type(params).__name__}")
            items.append((path, type_name, name, params))
        token_models = {str((p or {}).get("modelName")) for _, t, _, p in items
                        if ALIASES.get(t, t) == TOKEN_PRODUCER_TYPE and (p or {}).get("modelName")}
        token_producer = any(ALIASES.get(t, t) == TOKEN_PRODUCER_TYPE for _, t, _, _ in items)
        # The model of KV events whose topic names none (llm-d's precise producer in the shape llm-d deploys).
        self.token_model = next(iter(token_models)) if len(token_models) == 1 else None
        # llm-d's latency plugins read the prefix match; here predicted-ttft-scorer reads it in tokens by
        # tier, which the approximate producer publishes when asked (publishTierMatch).
        tier_match = any(t in TIER_MATCH_MAPPINGS and not self._registered(t) for _, t, _, _ in items)
        for path, configured_as, name, params in items:
            if name in self.by_name:
                raise self.document.fail(f"{path}.name", f"duplicate plugin name {name!r}; plugin names must be unique "
                                         "(name defaults to type)")
            type_name = ALIASES.get(configured_as, configured_as)
            if type_name != configured_as:
                self.document.note(f"{path}.type", f"{configured_as} is deprecated in llm-d; loaded as {type_name}")
            if type_name == PRECISE_WRAPPER_TYPE:
                self._add_precise_wrapper(name, params or {}, path, token_producer)
                continue
            if type_name in MAPPED_TYPES and not self._registered(type_name):
                self._add_mapped(type_name, name, params, path)
                continue
            reason = refused(type_name, self._registered(type_name))
            if reason:
                raise self.document.fail(f"{path}.type", reason)
            if type_name in PARAMETER_ADAPTERS and params:
                params = self._adapted(type_name, name, params, path)
            if tier_match and type_name == APPROX_PRODUCER_TYPE and "publishTierMatch" not in (params or {}):
                params = {**(params or {}), "publishTierMatch": True}
                self.document.note(f"{path}.parameters", "publishTierMatch: true added: predicted-ttft-scorer "
                                   "(serving llm-d's latency plugins) reads the match in tokens by tier")
            taken = notes = None
            if type_name == PRECISE_PRODUCER_TYPE and is_llmd_shape(params):
                params, taken, notes = self._precise(name, params or {}, path, token_producer)
            self.add(type_name, name, params, path,
                     mapping=mapping_line(type_name, configured_as, params or {}, taken, notes),
                     lenient=configured_as in PARAMETERLESS_TYPES)
        if tier_match and not any(e.type_name in (APPROX_PRODUCER_TYPE, PRECISE_PRODUCER_TYPE) for e in self.entries):
            # llm-d's latency producer works from the approximate producer it auto-creates; so here.
            self.add(APPROX_PRODUCER_TYPE, self.free_name(APPROX_PRODUCER_TYPE), {"publishTierMatch": True}, "plugins",
                     auto_created="the prefix match in tokens by tier for predicted-ttft-scorer (llm-d's latency "
                                  "plugins auto-create an approximate producer too)")

    def _add_mapped(self, llmd_type: str, name: str, params: Mapping[str, Any] | None, path: str) -> None:
        """An llm-d type served by our nearest equivalent (or by no plugin), with its notices."""
        try:
            mapped, ours, notes = adapt_mapped(llmd_type, name, params)
        except ConfigError as exc:
            raise self.document.fail(f"{path}.parameters", str(exc)) from None
        target = mapped.target or "no plugin"
        self.document.notice(f"{path}.type", f"llm-d {llmd_type} -> {target}: {mapped.notice}")
        for note in notes:
            key, _, message = note.partition(": ")
            self.document.notice(f"{path}.parameters.{key}", message)
        line = f"llm-d {llmd_type} -> {target}: {mapped.notice}"
        if mapped.target is not None:
            self.add(mapped.target, name, ours, path, mapping=line)
        else:
            self.append(PluginEntry(name, llmd_type, Absorbed(name, llmd_type, mapped.notice), dict(params or {}),
                                    mapping=line, path=path))

    def _adapted(self, type_name: str, name: str, params: Mapping[str, Any], path: str) -> dict[str, Any]:
        """`params` with llm-d's older or sidecar-bound forms adapted (each adaptation a notice)."""
        try:
            ours, notes = PARAMETER_ADAPTERS[type_name](name, params)
        except ConfigError as exc:
            raise self.document.fail(f"{path}.parameters", str(exc)) from None
        for note in notes:
            key, _, message = note.partition(": ")
            self.document.notice(f"{path}.parameters.{key}", message)
        return ours

    def _registered(self, type_name: str) -> bool:
        try:
            self.registry.get(type_name)
        except ConfigError:
            return False
        return True

    def _precise(self, name: str, params: Mapping[str, Any], path: str,
                 token_producer: bool) -> tuple[dict[str, Any], list[str], list[str]]:
        try:
            ours, taken, notes, notices = precise_parameters(name, params, token_producer=token_producer,
                                                             token_model=self.token_model)
        except ConfigError as exc:
            raise self.document.fail(f"{path}.parameters", str(exc)) from None
        for notice in notices:
            key, _, message = notice.partition(": ")
            self.document.notice(f"{path}.parameters.{key}", message)
        return ours, taken, notes

    def _add_precise_wrapper(self, name: str, params: Mapping[str, Any], path: str, token_producer: bool) -> None:
        """llm-d's deprecated `precise-prefix-cache-scorer`: a precise producer and a prefix scorer reading it."""
        self.document.note(f"{path}.type", f"{PRECISE_WRAPPER_TYPE} is deprecated in llm-d; loaded as a "
                           f"{PRECISE_PRODUCER_TYPE} and a prefix-cache-scorer named {name!r} that reads it")
        producer_params, taken, notes = self._precise(name, params, path, token_producer)
        producer = self.free_name(f"{name}-producer")
        self.wrapper_producers[name] = producer
        self.add(PRECISE_PRODUCER_TYPE, producer, producer_params, path,
                 auto_created=f"the producer half of the deprecated {PRECISE_WRAPPER_TYPE} {name!r}",
                 mapping=mapping_line(PRECISE_PRODUCER_TYPE, PRECISE_WRAPPER_TYPE, params, taken, notes))
        self.add("prefix-cache-scorer", name, {"prefixMatchInfoProducerName": producer}, path,
                 auto_created=f"the scorer half of the deprecated {PRECISE_WRAPPER_TYPE} {name!r}")

    def add(self, type_name: str, name: str, parameters: Mapping[str, Any] | None, path: str,
            auto_created: str | None = None, mapping: str | None = None, lenient: bool = False) -> PluginEntry:
        """Build a plugin of a registered type; errors name `path` (its `type` or `parameters`).

        `lenient`: parameters the plugin does not read are ignored with a note instead of failing (llm-d
        types whose factory reads none)."""
        fail = self.document.fail
        try:
            spec = self.registry.get(type_name)
        except ConfigError as exc:
            raise fail(f"{path}.type" if not auto_created else path, str(exc)) from None
        try:
            if lenient and parameters:
                params = PluginParams(name, parameters)
                plugin = spec.factory(name, params, self.context)
                ignored = params.unread()
                if ignored:
                    self.document.note(f"{path}.parameters", f"{', '.join(ignored)}: no effect (llm-d's "
                                       f"{type_name} reads no parameters and ignores them too)")
                    parameters = {k: v for k, v in parameters.items() if k not in ignored}
            else:
                plugin = self.registry.build(type_name, name, parameters, self.context)
        except ConfigError as exc:
            raise fail(f"{path}.parameters" if not auto_created else path, str(exc)) from None
        return self.append(PluginEntry(name, type_name, plugin, dict(parameters or {}), auto_created, mapping, path))

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

    def extractor_ref(self, value: Any, path: str, allowed_types: tuple[str, ...]) -> Plugin:
        """The extractor a `pluginRef` names; the deprecated precise wrapper's name means its producer half."""
        if isinstance(value, str) and value in self.wrapper_producers:
            producer = self.wrapper_producers[value]
            self.document.note(path, f"{value!r} is the deprecated {PRECISE_WRAPPER_TYPE}; its producer half "
                               f"{producer!r} is the extractor (as in llm-d)")
            value = producer
        return self.typed_ref(value, path, allowed_types)

    def typed_ref(self, value: Any, path: str, allowed_types: tuple[str, ...]) -> Plugin:
        """The plugin a `pluginRef` names, which must be of one of `allowed_types`."""
        entry = self.ref(value, path)
        if entry.type_name not in allowed_types:
            raise self.document.fail(path, f"plugin {entry.name!r} has type {entry.type_name}; allowed types: "
                                     f"{', '.join(allowed_types)}")
        return entry.plugin

    def types_of(self, kind: type) -> list[str]:
        """The registered types whose plugins are of class `kind` (for messages naming what is allowed)."""
        found = []
        for type_name in self.registry.types():
            factory = self.registry.get(type_name).factory
            if isinstance(factory, type) and issubclass(factory, kind):
                found.append(type_name)
        return found

    def position(self, plugin: Plugin) -> int:
        """Index of `plugin` among the entries (its `plugins[i]` when configured)."""
        for i, entry in enumerate(self.entries):
            if entry.plugin is plugin:
                return i
        return -1

    def plugins(self) -> list[Plugin]:
        """Every plugin instance so far."""
        return [entry.plugin for entry in self.entries]
