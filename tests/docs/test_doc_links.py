"""Every relative link of the README and docs/ reaches a file (and a heading), every repository path they name
exists, and every pointer from code to a docs page or a Markdown section resolves."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.docs.markdown import DOC_FILES, ROOT, anchors, fences, headings, inline_code, links, prose_lines

# Pages other branches are writing; linked from the index now. A test below fails once one exists: then
# remove it from here, and the links to it are checked like any other.
PENDING_PAGES: set[Path] = set()
# Where code and configs may point at the docs (comments, docstrings).
CODE_DIRS = ("epp", "scorers", "engine", "bench", "tests", "examples", "deploy", "proto", ".ci")
CODE_SUFFIXES = {".py", ".yaml", ".yml", ".sh", ".toml", ".proto"}
# Code that names made-up Markdown pages on purpose (test fixtures of the standing-table renderer).
FIXTURE_NAMES = {ROOT / "tests" / "bench" / "test_standing.py"}
TOP_FOLDERS = ("epp", "scorers", "engine", "bench", "tests", "examples", "deploy", "proto", "docs", ".ci")


def link_problem(source: Path, target: str) -> str | None:
    """Why a link from `source` does not resolve, or None."""
    if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...
        return None
    path_text, _, anchor = target.partition("#")
    path = (source.parent / path_text).resolve() if path_text else source
    if path in PENDING_PAGES:
        return None
    if not path.is_relative_to(ROOT):
        return f"{target}: outside the repository"
    if not path.exists():
        return f"{target}: no such file"
    if anchor and path.suffix == ".md" and anchor not in anchors(path):
        return f"{target}: {path.relative_to(ROOT)} has no heading with anchor #{anchor}"
    return None


LINKS = [(path, number, target) for path in DOC_FILES for number, target in links(path)]


def test_the_docs_link_to_each_other():
    assert len(LINKS) > 100


@pytest.mark.parametrize("source, number, target", LINKS,
                         ids=[f"{p.relative_to(ROOT)}:{n}:{t}" for p, n, t in LINKS])
def test_every_relative_link_resolves(source, number, target):
    assert link_problem(source, target) is None, f"{source.relative_to(ROOT)}:{number}: {link_problem(source, target)}"


def test_a_broken_link_or_anchor_is_caught():
    readme = ROOT / "README.md"
    assert link_problem(readme, "docs/user-guide.md#running-the-tests") is None
    assert link_problem(readme, "docs/no-such-page.md") == "docs/no-such-page.md: no such file"
    assert "no heading with anchor #no-such-heading" in link_problem(readme, "docs/user-guide.md#no-such-heading")
    assert link_problem(readme, "#layout") is None


def test_pending_pages_are_only_those_not_written_yet():
    written = sorted(str(p.relative_to(ROOT)) for p in PENDING_PAGES if p.exists())
    assert written == [], f"now written, so remove from PENDING_PAGES (their links get checked): {written}"


_REPO_PATH = re.compile(rf"(?<![\w/.-])(?:{'|'.join(map(re.escape, TOP_FOLDERS))})/[\w./-]*[\w/]")


def named_paths() -> list[tuple[str, str]]:
    """(where, path) for every repository path the docs name in inline code (`epp/server/extproc.py`) or in
    code blocks (commands, the request-path picture)."""
    named = []
    for source in DOC_FILES:
        name = source.relative_to(ROOT)
        for number, line in prose_lines(source):
            named += [(f"{name}:{number}", code) for code in inline_code(line) if _REPO_PATH.fullmatch(code)]
        for fence in fences(source):
            named += [(f"{name}:{fence.line}", m.group(0)) for m in _REPO_PATH.finditer(fence.text)]
    return named


NAMED = named_paths()


@pytest.mark.parametrize("where, path", NAMED, ids=[f"{w}:{p}" for w, p in NAMED])
def test_every_repository_path_named_exists(where, path):
    assert (ROOT / path).exists(), f"{where}: `{path}` does not exist (moved? say where it is now)"


def code_files() -> list[Path]:
    here = Path(__file__).parent  # these tests spell out broken pointers on purpose
    files = [p for d in CODE_DIRS for p in (ROOT / d).rglob("*")
             if p.suffix in CODE_SUFFIXES and p.is_file() and "results" not in p.relative_to(ROOT).parts
             and p.parent != here and p not in FIXTURE_NAMES]
    return sorted(files)


# `folder/page.md#anchor` (from the repository root or the file's folder), or `some/README.md, "Heading"` /
# `README "Heading"`: a section named by the start of its heading.
_DOC_REF = re.compile(r"(?<![\w/.-])((?:[\w.-]+/)+[\w.-]+\.md)(?:#([\w-]+))?")
_SECTION_REF = re.compile(r"(?<![\w/.-])((?:[\w.-]+/)*[\w.-]+\.md|README),? \"([^\"]+)\"")


def reference_problems(path: Path, text: str) -> list[str]:
    """Pointers in one code file to docs pages and Markdown sections that do not resolve."""
    found = []
    for m in _DOC_REF.finditer(text):
        page, anchor = ROOT / m.group(1), m.group(2)
        if not page.exists() and (path.parent / m.group(1)).exists():
            page = path.parent / m.group(1)
        if page in PENDING_PAGES:
            continue
        if not page.exists():
            found.append(f"{m.group(0)}: no such page")
        elif anchor and anchor not in anchors(page):
            found.append(f"{m.group(0)}: no heading with that anchor")
    for m in _SECTION_REF.finditer(text):
        page = ROOT / ("README.md" if m.group(1) == "README" else m.group(1))
        if not page.exists():
            found.append(f"{m.group(0)}: no such file")
        elif not any(h.lower().startswith(m.group(2).lower()) for h in headings(page)):
            found.append(f"{m.group(0)}: {m.group(1)} has no heading that starts so")
    return found


def test_a_stale_pointer_from_code_is_caught():
    assert reference_problems(ROOT / "README.md", 'see README "Limits" and docs/operations.md#limits') == [
        'README "Limits": README has no heading that starts so']
    assert reference_problems(ROOT / "README.md", "docs/operations.md#no-such-part") == [
        "docs/operations.md#no-such-part: no heading with that anchor"]


def test_every_pointer_from_code_to_the_docs_resolves():
    found = [f"{p.relative_to(ROOT)}: {problem}" for p in code_files()
             for problem in reference_problems(p, p.read_text(encoding="utf-8", errors="replace"))]
    assert found == []
