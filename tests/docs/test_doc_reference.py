"""The reference parts of the docs are what the code has: the flag tables of the user guide against the
parsers, the built-in plugin catalogue against the registry, every metric named against the code, the
architecture page's layers against the import contracts, the README's layout against the package folders."""

from __future__ import annotations

import argparse
import re
import tomllib
from pathlib import Path

import pytest

from epp.cli import build_parser
from epp.framework import default_registry
from tests.docs.markdown import DOC_FILES, ROOT, inline_code, prose_lines

USER_GUIDE = ROOT / "docs" / "user-guide.md"
PLUGINS = ROOT / "docs" / "plugins.md"
NO_DEFAULT = "—"


def table_cells(path: Path, heading: str) -> list[list[str]]:
    """The cells of every table row under a `## heading` section, the header and rule rows included."""
    rows, inside = [], False
    for _, line in prose_lines(path):
        if line.startswith("## "):
            inside = line[3:].strip() == heading
        elif inside and line.startswith("|") and not re.match(r"^\|[-| ]+\|$", line):
            rows.append([cell.strip() for cell in line.strip().strip("|").split(" | ")])
    return rows


def section_rows(path: Path, heading: str) -> list[list[str]]:
    """The table rows (cells, header and rule rows left out) of one `## heading` section of a page."""
    rows = [row for row in table_cells(path, heading) if row[0] not in ("flag", "type")]  # header rows
    assert rows, f"{path.relative_to(ROOT)} has no table under '## {heading}'"
    return rows


def subcommand(name: str) -> argparse.ArgumentParser:
    action = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[name]


def shown_default(action: argparse.Action) -> str:
    """How the user guide shows a flag's default: `value`, or a dash for none (unset, off, a counter)."""
    if isinstance(action, argparse._CountAction) or action.default is None or action.default is False \
            or action.default == "":
        return NO_DEFAULT
    return f"`{action.default}`"


def flag_table_problems(rows: list[list[str]], parser: argparse.ArgumentParser) -> list[str]:
    """Differences between a flag table (flag, default, what) and a parser's options."""
    actions = {flag: a for a in parser._actions for flag in a.option_strings if flag not in ("-h", "--help")}
    documented: dict[str, str] = {}
    for row in rows:
        for flag in inline_code(row[0]):
            documented[flag] = row[1]
    problems = [f"{flag}: not in the table" for flag in sorted(set(actions) - set(documented))]
    problems += [f"{flag}: no such flag" for flag in sorted(set(documented) - set(actions))]
    problems += [f"{flag}: default shown {documented[flag]!r}, the parser's is {shown_default(a)!r}"
                 for flag, a in sorted(actions.items()) if flag in documented and documented[flag] != shown_default(a)]
    return problems


@pytest.mark.parametrize("command", ["serve", "envoy-config"])
def test_the_flag_table_is_the_parsers(command):
    rows = section_rows(USER_GUIDE, f"`epp {command}` flags")
    assert flag_table_problems(rows, subcommand(command)) == []


def test_a_flag_table_that_drifted_is_caught():
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=9002)
    parser.add_argument("--tls", action="store_true")
    rows = [["`--port`", "`9003`", "port"], ["`--old`", NO_DEFAULT, "gone"]]
    assert flag_table_problems(rows, parser) == [
        "--tls: not in the table", "--old: no such flag", "--port: default shown '`9003`', the parser's is '`9002`'"]


def test_the_plugin_catalogue_lists_every_built_in_type():
    registry = default_registry()
    built_in = {t for t in registry.types() if getattr(registry.get(t).factory, "__module__", "").startswith("epp.")}
    listed = [inline_code(row[0])[0] for row in section_rows(PLUGINS, "Built-in plugins")]
    assert len(listed) == len(set(listed)), "a type listed twice"
    assert sorted(built_in - set(listed)) == [], "add a row to the table of docs/plugins.md, '## Built-in plugins'"
    assert sorted(set(listed) - built_in) == [], "no such plugin type: remove its row"


# Metric names as the docs write them: a family prefix (`epp_kv_index_*`) or a whole name.
_METRIC = re.compile(
    r"(?<![\w])((?:epp|inference_objective|inference_extension|inference_pool)_[a-z0-9_]*[a-z0-9])(_\*)?(?![\w/.:])")
_SOURCE = "\n".join(p.read_text(encoding="utf-8") for d in ("epp", "scorers", "engine") for p in (ROOT / d).rglob("*.py"))
_WORDS = frozenset(re.findall(r"[a-z][a-z0-9_]*", _SOURCE))  # every name the code spells out
_QUOTED = frozenset(re.findall(r"\"([a-z][a-z0-9_]*)\"", _SOURCE))  # string literals such as "epp_disk_tier"
_BUILT_SUFFIXES = frozenset(re.findall(r"\}_([a-z0-9_]+)\"", _SOURCE))  # the ends of f"{prefix}_suffix" names


def metric_defined(name: str, prefix: bool) -> bool:
    """Whether the code defines the metric (or, for a prefix, some metric of that family).

    A name counts when it is written whole in the code, or built as `f"{PREFIX}_suffix"` with PREFIX a
    string the code spells out. Prometheus adds `_total` to counters and `_bucket`/`_sum`/`_count` to histograms.
    """
    if prefix:
        return name in _QUOTED or any(word.startswith(f"{name}_") for word in _WORDS)
    for candidate in {name, re.sub(r"_(total|bucket|sum|count)$", "", name)}:
        if candidate in _WORDS:
            return True
        parts = candidate.split("_")
        if any("_".join(parts[:cut]) in _QUOTED and "_".join(parts[cut:]) in _BUILT_SUFFIXES
               for cut in range(1, len(parts))):
            return True
    return False


METRICS = sorted({(m.group(1), bool(m.group(2))) for path in DOC_FILES for _, line in prose_lines(path)
                  for code in inline_code(line) for m in _METRIC.finditer(code)})


def test_the_docs_name_metrics():
    assert len(METRICS) > 100


@pytest.mark.parametrize("name, prefix", METRICS, ids=[n + ("_*" if p else "") for n, p in METRICS])
def test_every_metric_named_is_one_the_code_defines(name, prefix):
    assert metric_defined(name, prefix), f"no metric {name}{'_*' if prefix else ''} in epp/, scorers/ or engine/"


def test_a_metric_the_code_does_not_define_is_caught():
    assert metric_defined("epp_disk_tier_access_opens_total", False)  # f"{PREFIX}_access_opens"
    assert metric_defined("epp_kv_index", True)
    assert not metric_defined("epp_kv_index_lookup_hits_total", False)
    assert not metric_defined("epp_no_such_family", True)


def test_the_bbr_flag_table_is_its_parsers():
    from epp.bbr.cli import build_parser as bbr_parser

    rows = section_rows(ROOT / "docs" / "bbr.md", "`epp bbr` flags")
    assert flag_table_problems(rows, bbr_parser()) == []


def test_the_architecture_pages_layers_are_the_import_contracts():
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    layers = next(c for c in contracts if c["id"] == "layers")["layers"]
    expected = [sorted(name.strip() for name in layer.split("|")) for layer in layers]
    rows = table_cells(ROOT / "docs" / "architecture.md", "Layering rules")[1:]  # past the header row
    # The modules' cell, its asides in parentheses left out (they name other modules).
    shown = [sorted(inline_code(re.sub(r"\([^)]*\)", "", row[1]))) for row in rows]
    assert shown == expected


def test_the_readme_layout_names_every_package_folder():
    table = " ".join(cell for row in table_cells(ROOT / "README.md", "Layout") for cell in row)
    named = {code.rstrip("/") for code in inline_code(table)}
    folders = {str(init.parent.relative_to(ROOT)) for init in (ROOT / "epp").glob("*/__init__.py")}
    folders |= {"scorers", "engine"}
    assert sorted(folders - named) == []
