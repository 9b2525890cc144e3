"""An example plugin package installed the way its author would: into a fresh venv that sees this environment."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path


def run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess[str]:
    """A command with pip quiet and offline-friendly, outside any activated venv."""
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1", "PYTHONNOUSERSITE": "1"}
    env.pop("VIRTUAL_ENV", None)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env, **kwargs)


def install_example(example: Path, module: str, tmp_path: Path) -> Path:
    """A copy of `example` pip-installed into a fresh venv under `tmp_path`; the venv's python."""
    source = tmp_path / example.name
    shutil.copytree(example, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    venv = tmp_path / "venv"
    made = run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)])
    assert made.returncode == 0, made.stderr
    python = venv / "bin" / "python"
    site_dir = Path(run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"])
                    .stdout.strip())
    # The fresh venv sees the picker (and pip, setuptools) of the environment running the tests.
    (site_dir / "_parent_env.pth").write_text(f"import site; site.addsitedir({sysconfig.get_paths()['purelib']!r})\n")
    installed = run([str(python), "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
                     "-q", str(source)])
    assert installed.returncode == 0, installed.stdout + installed.stderr
    assert (site_dir / module / "__init__.py").exists()
    return python


def first_python_block(page: Path, heading: str) -> str:
    """The first ```python block after `heading` in a Markdown page."""
    text = page.read_text(encoding="utf-8")
    section = text[text.index(heading):]
    code = section[section.index("```python\n") + len("```python\n"):]
    return code[:code.index("```\n")]
