"""Optional dependency groups (pyproject's extras): is the one a command needs installed, and the line it
says when it is not. The groups' contents are read from this package's own metadata, never listed twice."""

from __future__ import annotations

import re
from importlib.metadata import PackageNotFoundError, distribution, requires

DISTRIBUTION = "llm-epp"


class MissingExtra(Exception):
    """A command needs an extra that is not installed; the message is the one line the user sees."""


def missing_requirements(extra: str, dist: str = DISTRIBUTION) -> list[str]:
    """The distributions `extra` of `dist` requires that are not installed (none known if `dist` is not installed)."""
    try:
        requirements = requires(dist) or []
    except PackageNotFoundError:  # a source tree that was never installed: nothing to go by
        return []
    missing: list[str] = []
    for requirement in requirements:
        spec, _, marker = requirement.partition(";")
        if not re.search(rf"""\bextra\s*==\s*['"]{re.escape(extra)}['"]""", marker):
            continue
        name = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", spec)
        if name is None:
            continue
        try:
            distribution(name.group(1))
        except PackageNotFoundError:
            missing.append(name.group(1))
    return missing


def require_extra(extra: str, command: str) -> None:
    """Raise MissingExtra naming `extra` and how to install it when `command` cannot run without it."""
    missing = missing_requirements(extra)
    if missing:
        raise MissingExtra(f"{command} needs the '{extra}' extra (missing: {', '.join(missing)}): "
                           f"pip install '{DISTRIBUTION}[{extra}]' (in a checkout: pip install -e '.[{extra}]')")
