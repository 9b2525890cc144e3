"""Scheduling profiles: filters, weighted scorers and one picker each, and the profile handler over them."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from epp.config.defaults import (
                                 DEFAULT_PICKER_TYPE,
                                 DEFAULT_PROFILE_HANDLER_TYPE,
                                 DEFAULT_PROFILE_NAME,
                                 DEFAULT_SCORER_WEIGHT,
)
from epp.config.plugins import PluginSet
from epp.config.schema import PROFILE_FIELDS, PROFILE_PLUGIN_FIELDS, Document, is_number
from epp.framework.errors import ConfigError
from epp.framework.plugin import Filter, Picker, ProfileHandler, Scorer
from epp.framework.scheduler import SchedulerProfile, WeightedScorer
from epp.requestcontrol.pipeline import PluginEntry, plugin_kinds


class ProfileBuilder:
    """Builds the profiles of one document from its plugins, adding a default picker and handler where GIE does."""

    def __init__(self, doc: Document, plugins: PluginSet) -> None:
        self.doc = doc
        self.plugins = plugins

    def default_picker(self) -> Picker:
        for entry in self.plugins.entries:
            if entry.auto_created and entry.type_name == DEFAULT_PICKER_TYPE and isinstance(entry.plugin, Picker):
                return entry.plugin
        entry = self.plugins.add(DEFAULT_PICKER_TYPE, self.plugins.free_name(DEFAULT_PICKER_TYPE), None,
                                 "schedulingProfiles", auto_created="profile without a picker")
        if not isinstance(entry.plugin, Picker):
            raise self.doc.fail("schedulingProfiles", f"the default picker type {DEFAULT_PICKER_TYPE} is no picker")
        return entry.plugin

    def build_profile(self, name: str, refs: list[tuple[PluginEntry, Any, str]], path: str) -> SchedulerProfile:
        filters: list[Filter] = []
        scorers: list[WeightedScorer] = []
        pickers: list[tuple[Picker, str]] = []
        seen: set[str] = set()
        for entry, weight, ref_path in refs:
            plugin = entry.plugin
            if entry.name in seen:
                raise self.doc.fail(f"{ref_path}.pluginRef", f"plugin {entry.name!r} is listed twice in this profile")
            seen.add(entry.name)
            if not isinstance(plugin, (Filter, Scorer, Picker)):
                # llm-d puts a profile's plugins into its filter, scorer and picker slots and passes over
                # the others (guides list their producers there); they run in their own stage.
                kinds = ", ".join(plugin_kinds(plugin)) or "config only"
                self.doc.note(f"{ref_path}.pluginRef", f"{entry.name!r} (type {entry.type_name}: {kinds}) is no "
                              "filter, scorer or picker; it has no place in a profile and runs in its own stage for "
                              "every request (llm-d passes over it too)")
                continue
            if weight is not None and not isinstance(plugin, Scorer):
                self.doc.note(f"{ref_path}.weight", f"no effect: only scorers take a weight; {entry.name!r} (type "
                              f"{entry.type_name}) is a {'/'.join(plugin_kinds(plugin))} (llm-d ignores it too)")
                weight = None
            if weight is not None and (not is_number(weight) or not math.isfinite(weight) or weight < 0):
                raise self.doc.fail(f"{ref_path}.weight", f"must be a non-negative number, got {weight!r}")
            if isinstance(plugin, Filter):
                filters.append(plugin)
            if isinstance(plugin, Scorer):
                scorers.append(WeightedScorer(plugin, float(weight) if weight is not None else DEFAULT_SCORER_WEIGHT))
            if isinstance(plugin, Picker):
                pickers.append((plugin, ref_path))
        if len(pickers) > 1:
            raise self.doc.fail(f"{pickers[1][1]}.pluginRef",
                                f"profile {name!r} has several pickers ({', '.join(p.name for p, _ in pickers)}); "
                                "allowed: exactly one picker per profile")
        picker = pickers[0][0] if pickers else self.default_picker()
        return SchedulerProfile(name, tuple(filters), tuple(scorers), picker)

    def build_profiles(self, doc: Mapping[str, Any]) -> dict[str, SchedulerProfile]:
        """The `schedulingProfiles` (none: GIE's one profile of every filter, scorer and picker)."""
        raw_profiles = self.doc.sequence(doc.get("schedulingProfiles"), "schedulingProfiles", "profiles")
        profiles: dict[str, SchedulerProfile] = {}
        if not raw_profiles:
            # GIE default: one profile with every configured filter, scorer and picker.
            refs = [(e, None, f"plugins[{i}]") for i, e in enumerate(self.plugins.entries)
                    if isinstance(e.plugin, (Filter, Scorer, Picker))]
            profiles[DEFAULT_PROFILE_NAME] = self.build_profile(DEFAULT_PROFILE_NAME, refs, "schedulingProfiles")
            return profiles
        for i, raw in enumerate(raw_profiles):
            path = f"schedulingProfiles[{i}]"
            item = self.doc.mapping(raw, path, PROFILE_FIELDS, required=("name",))
            name = self.doc.string(item["name"], f"{path}.name")
            if name in profiles:
                raise self.doc.fail(f"{path}.name", f"duplicate profile name {name!r}; profile names must be unique")
            refs = []
            for j, raw_ref in enumerate(self.doc.sequence(item.get("plugins"), f"{path}.plugins", "plugin references")):
                ref_path = f"{path}.plugins[{j}]"
                ref_item = self.doc.mapping(raw_ref, ref_path, PROFILE_PLUGIN_FIELDS, required=("pluginRef",))
                if "weight" in ref_item and ref_item["weight"] is None:
                    raise self.doc.fail(f"{ref_path}.weight", f"is empty; give a non-negative number, or leave the "
                                        f"field out for the default {DEFAULT_SCORER_WEIGHT:g}")
                refs.append((self.plugins.ref(ref_item["pluginRef"], f"{ref_path}.pluginRef"), ref_item.get("weight"),
                             ref_path))
            profiles[name] = self.build_profile(name, refs, path)
        return profiles

    def profile_handler(self, profiles: Mapping[str, SchedulerProfile]) -> ProfileHandler:
        """The one profile handler (auto-created for a single profile), checked against the profile names."""
        handlers = [e for e in self.plugins.entries if isinstance(e.plugin, ProfileHandler)]
        if len(handlers) > 1:
            raise self.doc.fail("plugins", f"several profile handlers ({', '.join(e.name for e in handlers)}); "
                                "allowed: at most one")
        if handlers:
            entry = handlers[0]
        elif len(profiles) == 1:
            entry = self.plugins.add(DEFAULT_PROFILE_HANDLER_TYPE, self.plugins.free_name(DEFAULT_PROFILE_HANDLER_TYPE), None,
                                     "plugins", auto_created="one profile and no profile handler")
        else:
            raise self.doc.fail("plugins", f"{len(profiles)} scheduling profiles need a profile handler plugin; "
                                f"registered types: {', '.join(self.plugins.registry.types())}")
        if not isinstance(entry.plugin, ProfileHandler):
            raise self.doc.fail("plugins", f"the default profile handler type {entry.type_name} is no profile handler")
        try:
            entry.plugin.check_profiles(list(profiles))
        except ConfigError as exc:
            raise self.doc.fail("schedulingProfiles", f"profile handler {entry.name!r}: {exc}") from None
        return entry.plugin
