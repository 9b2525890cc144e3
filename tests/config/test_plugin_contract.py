"""The plugin contract of `epp.framework`: constructor, declared capabilities and the shared helpers."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter

from epp.config import load_config_text
from epp.framework import (
    ConfigError,
    Plugin,
    PluginContext,
    PluginParams,
    PluginRegistry,
    ProfileHandler,
    Scorer,
    once_per_registry,
)
from epp.scorers import register_builtin_plugins
from tests.support.configs import endpoint_picker_config


class ConstantScorer(Scorer):
    """A scorer with no parameters needs no constructor."""

    type_name = "constant-scorer"

    def score(self, state, request, endpoints):
        return {ep.name: 0.5 for ep in endpoints}


def registry_with(*classes: type[Plugin]) -> PluginRegistry:
    registry = PluginRegistry()
    register_builtin_plugins(registry)
    for cls in classes:
        registry.register_class(cls)
    return registry


def test_a_plugin_without_a_constructor_is_built_and_refuses_parameters():
    registry = registry_with(ConstantScorer)
    loaded = load_config_text(endpoint_picker_config(["constant-scorer"]), registry=registry)
    scorer = loaded.plugin("constant-scorer")
    assert isinstance(scorer, ConstantScorer) and scorer.name == "constant-scorer"
    assert scorer.consumes() == frozenset() and scorer.describe() == ""
    with pytest.raises(ConfigError, match=r"unknown parameter\(s\) \['weight'\]; allowed: none"):
        load_config_text(endpoint_picker_config([{"type": "constant-scorer", "parameters": {"weight": 2}}]),
                         registry=registry)


def test_a_profile_handler_declares_which_profiles_it_accepts():
    class OnlyDecode(ProfileHandler):
        type_name = "only-decode-handler"

        def check_profiles(self, names):
            if list(names) != ["decode"]:
                raise ConfigError(f"needs exactly the profile 'decode', got {list(names)}")

    with pytest.raises(ConfigError, match="schedulingProfiles: profile handler 'only-decode-handler': needs exactly"):
        load_config_text(endpoint_picker_config(["only-decode-handler", "queue-scorer"], ["queue-scorer"]),
                         registry=registry_with(OnlyDecode))


@pytest.mark.parametrize("raw, seconds", [("250ms", 0.25), ("1m30s", 90.0), (2, 2.0), (0.5, 0.5), (None, 7.0)])
def test_duration_parameters_take_go_strings_or_seconds(raw, seconds):
    params = PluginParams("p", {"timeout": raw})
    assert params.duration("timeout", 7.0) == seconds
    params.finish()


@pytest.mark.parametrize("raw, message", [
    ("soon", "'soon' is not a duration"),
    (True, "must be a duration such as 30s or a number of seconds, got True"),
    (-1, "must be >= 0.0s, got -1"),
])
def test_bad_duration_parameters_name_the_plugin_and_the_key(raw, message):
    with pytest.raises(ConfigError) as info:
        PluginParams("p", {"timeout": raw}).duration("timeout", 1.0)
    assert "plugin 'p'" in str(info.value) and "'timeout'" in str(info.value) and message in str(info.value)


def counter(registry):
    return Counter("plugin_things", "Things a plugin counted.", registry=registry)


def test_metrics_are_created_once_per_registry():
    registry = CollectorRegistry()
    first = once_per_registry(registry, "plugin_things", counter)
    assert once_per_registry(registry, "plugin_things", counter) is first  # no duplicate-series error
    assert once_per_registry(CollectorRegistry(), "plugin_things", counter) is not first
    first.inc()
    own = once_per_registry(registry, "plugin_things", counter, shared=False)  # a second instance: unexported
    own.inc(5)
    assert registry.get_sample_value("plugin_things_total") == 1.0
    assert once_per_registry(None, "plugin_things", counter) is not once_per_registry(None, "plugin_things", counter)


def test_the_context_has_a_sharing_link_without_peers_by_default():
    sharing = PluginContext().sharing
    assert not sharing.has_peers
    sharing.publish_prefix("10.0.0.1:8000", [1, 2], 16)  # no peers: nothing happens, nothing fails
