"""What `pip install .` installs: every package folder of the source tree, under its `epp.` name.

An editable install (the tests' own) imports any folder, so a package missing from
`[tool.setuptools] packages` shows only in a wheel, such as the container image's.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_every_package_folder_is_installed():
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders: set[str] = set()
    for name, folder in setuptools["package-dir"].items():
        for init in (REPO / folder).rglob("__init__.py"):
            relative = init.parent.relative_to(REPO / folder).parts
            folders.add(".".join((name, *relative)))
    assert set(setuptools["packages"]) == folders
