"""The user guide's test figures come from a run's JUnit report through `.ci/test-figures`, never typed.

The guide's marked section is what the script renders from docs/test-figures.json; the script
reads a real pytest JUnit report (made here from three tests: one passes, one is skipped, one
fails) into counts and writes both files.
"""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.machinery import SourceFileLoader
from importlib.util import module_from_spec, spec_from_loader
from types import ModuleType

import pytest

from tests.docs.markdown import ROOT

SCRIPT = ROOT / ".ci" / "test-figures"


@pytest.fixture(scope="module")
def figures_script() -> ModuleType:
    loader = SourceFileLoader("test_figures_script", str(SCRIPT))
    spec = spec_from_loader(loader.name, loader)
    assert spec is not None
    module = module_from_spec(spec)
    loader.exec_module(module)
    return module


def test_the_guide_shows_what_the_figures_file_holds(figures_script):
    figures = json.loads(figures_script.FIGURES.read_text())
    guide = figures_script.GUIDE.read_text()
    assert figures_script.guide_with(guide, figures_script.render(figures)) == guide
    for run in figures["runs"]:
        assert run["passed"] == run["tests"] - run["failed"] - run["errors"] - run["skipped"]


def test_the_script_writes_a_real_runs_counts_into_the_file_and_the_guide(figures_script, tmp_path, monkeypatch):
    (tmp_path / "test_three.py").write_text(
        "import pytest\n\ndef test_ok():\n    pass\n\ndef test_skipped():\n    pytest.skip('no')\n\n"
        "def test_fails():\n    assert False\n")
    junit = tmp_path / "junit.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}",
                    "test_three.py"], cwd=tmp_path, capture_output=True, timeout=120)
    guide = tmp_path / "guide.md"
    guide.write_text(f"before\n{figures_script.START}\nold figures\n{figures_script.END}\nafter\n")
    monkeypatch.setattr(figures_script, "GUIDE", guide)
    monkeypatch.setattr(figures_script, "FIGURES", tmp_path / "figures.json")
    monkeypatch.setattr(figures_script, "ROOT", tmp_path)
    assert figures_script.main([str(junit), "--label", "a small run", "--wall-seconds", "75"]) == 0
    [run] = json.loads((tmp_path / "figures.json").read_text())["runs"]
    assert (run["tests"], run["passed"], run["failed"], run["skipped"], run["errors"]) == (3, 1, 1, 1, 0)
    assert run["source"] == "JUnit report junit.xml" and run["wall_seconds"] == 75
    text = guide.read_text()
    assert text.startswith("before\n") and text.endswith("after\n") and "old figures" not in text
    assert "A small run (" in text and "3 tests, 1 passed, 1 failed, 1 skipped; 1 min 15 s in all, of which pytest" in text
    # Another label is added beside it; the same label replaces it.
    figures_script.main([str(junit), "--label", "another run"])
    figures_script.main([str(junit), "--label", "a small run"])
    labels = [r["label"] for r in json.loads((tmp_path / "figures.json").read_text())["runs"]]
    assert labels == ["another run", "a small run"]


def test_a_guide_without_the_markers_is_an_error(figures_script):
    with pytest.raises(ValueError, match="no <!-- test-figures:start -->"):
        figures_script.guide_with("no markers here\n", "figures\n")
