"""Every config, file and code block the README and docs/ show is one the picker accepts as shown."""

from __future__ import annotations

import importlib.util
import tomllib

import pytest
import yaml

from epp.cli import main
from epp.config.loader import load_config
from epp.datalayer.discovery import parse_endpoint_document
from epp.fleet.cost import load_prices
from epp.framework import PluginRegistry
from tests.docs.markdown import DOC_FILES, ROOT, Fence, fences

BLOCKS = [fence for path in DOC_FILES for fence in fences(path)]
PRICE_KEYS = {"unit_tokens", "currency", "default", "models"}
# The outside plugin package the docs teach with, and the types it adds once installed.
OUTSIDE_PACKAGE = ROOT / "examples" / "outside_scorer" / "epp_kv_headroom" / "__init__.py"
OUTSIDE_TYPES = {"kv-headroom-scorer"}


def registry_with_the_outside_package() -> PluginRegistry:
    """Every installed plugin plus the example package's, as after `pip install ./examples/outside_scorer`."""
    spec = importlib.util.spec_from_file_location("docs_epp_kv_headroom", OUTSIDE_PACKAGE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    registry = PluginRegistry()
    registry.load_entry_points()
    module.register(registry)
    return registry


def blocks(*langs: str) -> list[Fence]:
    return [fence for fence in BLOCKS if fence.lang in langs]


def test_the_docs_show_configs_to_check():
    kinds = [doc.get("kind") for fence in blocks("yaml", "yml") for doc in yaml.safe_load_all(fence.text)
             if isinstance(doc, dict)]
    assert kinds.count("EndpointPickerConfig") >= 5


@pytest.mark.parametrize("fence", blocks("yaml", "yml"), ids=lambda f: f.where)
def test_every_yaml_block_is_accepted_by_what_reads_it(fence, tmp_path, capsys):
    for n, doc in enumerate(yaml.safe_load_all(fence.text)):
        if not isinstance(doc, dict):
            continue
        if doc.get("kind") == "EndpointPickerConfig":
            config = tmp_path / f"config-{n}.yaml"
            config.write_text(yaml.safe_dump(doc), encoding="utf-8")
            if OUTSIDE_TYPES & {plugin.get("type") for plugin in doc.get("plugins") or ()}:
                # A config for the example package: the same loader, with that package's plugins registered.
                load_config(config, registry=registry_with_the_outside_package())
                continue
            code = main(["check-config", str(config)])
            out, err = capsys.readouterr()
            assert code == 0, f"{fence.where}: epp check-config refused the config: {err}"
            assert out.startswith(f"EndpointPickerConfig {config}: OK\n")
        elif set(doc) <= PRICE_KEYS and {"default", "models"} & set(doc):
            load_prices(doc, fence.where)  # raises PriceError naming the field
        elif set(doc) == {"endpoints"}:
            assert parse_endpoint_document(doc), f"{fence.where}: an endpoints file with no endpoint"


@pytest.mark.parametrize("fence", blocks("toml"), ids=lambda f: f.where)
def test_every_toml_block_parses(fence):
    tomllib.loads(fence.text)


# Pages whose Python talks to a running stack: tests/docs/test_worked_pages.py runs them against one.
WORKED_PAGES = {ROOT / "docs" / "sim-fleet-sdk.md"}


@pytest.mark.parametrize("fence", [f for f in blocks("python", "py") if f.path not in WORKED_PAGES],
                         ids=lambda f: f.where)
def test_every_python_block_runs_against_the_installed_api(fence):
    # Module-level code only (imports, classes, functions): running it checks every name it imports exists.
    exec(compile(fence.text, fence.where, "exec"), {"__name__": f"docs_block_{fence.line}"})
