"""The plugin registry refuses type names a config could not use, and the data keys are public, typed API."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from epp.framework import (
    INFLIGHT_LOAD,
    PREFIX_MATCH_INFO,
    ConfigError,
    CycleState,
    DataKey,
    PluginRegistry,
    PluginSpec,
    PrefixMatchInfo,
    Scorer,
)
from epp.scorers import register_builtin_plugins

REPO = Path(__file__).resolve().parents[2]


class Unnamed(Scorer):
    """A scorer whose author forgot `type_name`."""

    def score(self, state, request, endpoints):
        return {}


class QueueLookalike(Scorer):
    type_name = "queue-scorer"

    def score(self, state, request, endpoints):
        return {}


def test_a_plugin_class_without_a_type_name_is_refused_naming_the_class():
    with pytest.raises(ValueError, match=r"Unnamed has no usable plugin type name \(''\): set its `type_name`"):
        PluginRegistry().register_class(Unnamed)


@pytest.mark.parametrize("name", ["", " ", "queue-scorer ", "\tx"])
def test_an_empty_or_padded_type_name_is_refused(name):
    with pytest.raises(ValueError, match="no usable plugin type name"):
        PluginRegistry().register(PluginSpec(name, Unnamed))


def test_a_type_name_registered_twice_is_refused_naming_both_factories():
    registry = PluginRegistry()
    register_builtin_plugins(registry)
    with pytest.raises(ValueError, match=r"plugin type 'queue-scorer' registered twice: by epp\.scorers\.\S+ and by "
                                         r"\S+QueueLookalike"):
        registry.register_class(QueueLookalike)
    assert registry.get("queue-scorer").factory is not QueueLookalike  # the first registration stands


def installed_plugin_package(root: Path, group: str) -> Path:
    """A package installed on `root` (a dist-info with an entry point) that registers `queue-scorer` again."""
    (root / "dup_plugins.py").write_text(textwrap.dedent('''
        from epp.framework import Scorer

        class Dup(Scorer):
            type_name = "queue-scorer"

        def register(registry):
            registry.register_class(Dup)
    '''))
    dist = root / "dup_plugins-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: dup-plugins\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(f"[{group}]\ndup = dup_plugins:register\n")
    return root


def test_an_installed_package_registering_a_taken_name_is_a_config_error_naming_it(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(installed_plugin_package(tmp_path, "epp-test.plugins")))
    registry = PluginRegistry()
    register_builtin_plugins(registry)
    with pytest.raises(ConfigError, match=r"the plugins of entry point 'dup' \(dup_plugins:register\) cannot be "
                                          r"registered: plugin type 'queue-scorer' registered twice"):
        registry.load_entry_points("epp-test.plugins")


def test_check_config_names_the_package_that_registers_a_taken_name(tmp_path):
    (tmp_path / "site").mkdir()
    site = installed_plugin_package(tmp_path / "site", "epp.plugins")
    config = tmp_path / "picker.yaml"
    config.write_text("apiVersion: inference.networking.x-k8s.io/v1alpha1\nkind: EndpointPickerConfig\n")
    result = subprocess.run([sys.executable, "-m", "epp.cli", "check-config", str(config)], capture_output=True,
                            text=True, timeout=120, env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"})
    assert result.returncode == 1, result.stderr
    assert result.stderr.strip().splitlines() == [
        "error: the plugins of entry point 'dup' (dup_plugins:register) cannot be registered: plugin type "
        "'queue-scorer' registered twice: by epp.scorers.load.QueueScorer and by dup_plugins.Dup"]


def test_the_data_keys_are_the_names_configs_and_producers_use():
    assert isinstance(PREFIX_MATCH_INFO, DataKey) and isinstance(PREFIX_MATCH_INFO, str)
    assert PREFIX_MATCH_INFO == "prefix-cache-match-info" and INFLIGHT_LOAD == "inflight-load"
    state = CycleState()
    state.put_endpoint_data(PREFIX_MATCH_INFO, "10.0.0.1:8000", PrefixMatchInfo(2, 4, 16))
    assert state.endpoint_data("prefix-cache-match-info", "10.0.0.1:8000") == PrefixMatchInfo(2, 4, 16)


@pytest.mark.slow
def test_a_type_checker_reads_each_key_as_its_value_type(tmp_path):
    plugin = tmp_path / "reader.py"
    plugin.write_text(textwrap.dedent('''
        from epp.framework import INFLIGHT_LOAD, PREFIX_MATCH_INFO, CycleState

        state = CycleState()
        reveal_type(state.endpoint_data(PREFIX_MATCH_INFO, "10.0.0.1:8000"))
        reveal_type(state.all_endpoint_data(INFLIGHT_LOAD))
    '''))
    from mypy import api

    stdout, _stderr, _status = api.run(["--strict", "--cache-dir", str(tmp_path / "cache"), str(plugin)])
    assert 'Revealed type is "epp.framework.datakeys.PrefixMatchInfo | None"' in stdout
    assert 'Revealed type is "typing.Mapping[str, epp.framework.datakeys.InflightLoad]"' in stdout
