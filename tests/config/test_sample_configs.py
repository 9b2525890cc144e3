"""Every sample config in examples/configs/ passes `epp check-config` and is listed in that folder's README."""

from __future__ import annotations

from pathlib import Path

import pytest

from epp.cli import main

SAMPLES = Path(__file__).parents[2] / "examples" / "configs"
FILES = sorted(SAMPLES.glob("*.yaml"))


def test_the_samples_folder_has_configs():
    assert [f.name for f in FILES if f.name == "lora.yaml"] == ["lora.yaml"]


@pytest.mark.parametrize("path", FILES, ids=[f.name for f in FILES])
def test_sample_config_passes_check_config(path, capsys):
    code = main(["check-config", str(path)])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert out.startswith(f"EndpointPickerConfig {path}: OK\n")
    assert "DEPRECATION" not in out + err, "samples use the current apiVersion and fields (llm-d.ai/v1)"


@pytest.mark.parametrize("path", FILES, ids=[f.name for f in FILES])
def test_sample_config_is_listed_in_the_readme(path):
    assert f"[`{path.name}`]({path.name})" in (SAMPLES / "README.md").read_text(), \
        f"add a row for {path.name} to examples/configs/README.md"
