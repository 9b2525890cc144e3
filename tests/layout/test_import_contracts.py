"""The import rules of pyproject.toml ([tool.importlinter]) hold, and a break of each one fails the check.

Each case copies the sources into a scratch tree, adds one offending module, and runs the same
`.ci/lint-imports` that run-tests.sh runs.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def lint(tree: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(tree / ".ci" / "lint-imports")], capture_output=True, text=True,
                          timeout=120)


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A copy of what the import check reads: pyproject.toml, the package folders, bench/ and the script."""
    for folder in ("epp", "scorers", "engine"):
        shutil.copytree(REPO / folder, tmp_path / folder, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / "bench", tmp_path / "bench", ignore=shutil.ignore_patterns("__pycache__", "results", "notes"))
    (tmp_path / ".ci").mkdir()
    shutil.copy(REPO / ".ci" / "lint-imports", tmp_path / ".ci" / "lint-imports")
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def test_the_package_keeps_every_contract():
    result = lint(REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


def test_the_plugin_api_importing_the_service_breaks_the_layers(tree: Path):
    (tree / "epp" / "framework" / "leak.py").write_text("from epp.server.runner import EppServer\n")
    result = lint(tree)
    assert result.returncode == 1
    assert "epp.framework is not allowed to import epp.server" in result.stdout


def test_a_new_top_level_module_must_be_placed_in_a_layer(tree: Path):
    (tree / "epp" / "newthing.py").write_text("")
    result = lint(tree)
    assert result.returncode == 1
    assert "- epp.newthing" in result.stdout and "not listed as layers" in result.stdout


def test_a_scorer_reaching_into_the_framework_internals_breaks_its_contract(tree: Path):
    (tree / "scorers" / "internal.py").write_text("from epp.framework.load import prompt_characters\n")
    result = lint(tree)
    assert result.returncode == 1
    assert "epp.scorers is not allowed to import epp.framework.load" in result.stdout


def test_the_engine_importing_the_picker_breaks_its_contract(tree: Path):
    (tree / "engine" / "sim" / "picker.py").write_text("from epp.datalayer.registry import EndpointRegistry\n")
    result = lint(tree)
    assert result.returncode == 1
    assert "epp.engine is not allowed to import epp.datalayer" in result.stdout


def test_an_import_cycle_counts_even_when_one_side_is_only_for_type_checking(tree: Path):
    folder = tree / "epp" / "datalayer"
    (folder / "first.py").write_text("from epp.datalayer.second import B\n\n\nclass A:\n    pass\n")
    (folder / "second.py").write_text(
        "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from epp.datalayer.first import A\n\n\n"
        "class B:\n    def a(self) -> 'A': ...\n")
    result = lint(tree)
    assert result.returncode == 1
    assert "No cycles are allowed in epp.datalayer" in result.stdout
    assert "- .second -> .first" in result.stdout


def test_a_cycle_in_the_benchmarks_breaks_their_contract(tree: Path):
    folder = tree / "bench" / "routing"
    (folder / "loadgen.py").write_text((folder / "loadgen.py").read_text() + "\nfrom bench.routing import goodput\n")
    result = lint(tree)
    assert result.returncode == 1
    assert "No cycles are allowed in bench.routing" in result.stdout


def test_the_picker_importing_the_benchmarks_breaks_its_contract(tree: Path):
    (tree / "epp" / "netutil_bench.py").write_text("from bench.routing import workloads\n")
    result = lint(tree)
    assert result.returncode == 1
    assert "epp is not allowed to import bench" in result.stdout
    assert "epp.netutil_bench -> bench.routing.workloads" in result.stdout
