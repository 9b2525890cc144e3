"""Reading the project's Markdown as the docs tests need it: fenced blocks, inline code, links, heading anchors."""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# The pages the docs tests hold to account: the README and everything under docs/.
DOC_FILES = (ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")))

_FENCE = re.compile(r"^(?P<indent> *)(?P<mark>`{3,}|~{3,})(?P<info>[^`]*)$")
_HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
_INLINE_CODE = re.compile(r"(`+)(.+?)\1")
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


@dataclass(frozen=True)
class Fence:
    """One fenced code block: where it starts, its language and its text (dedented to the fence)."""

    path: Path
    line: int
    lang: str
    text: str

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def _split(path: Path) -> tuple[list[Fence], list[tuple[int, str]]]:
    """The fenced blocks of a Markdown file, and its other lines with their numbers."""
    fences: list[Fence] = []
    prose: list[tuple[int, str]] = []
    lines = path.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if opening is None:
            prose.append((i + 1, lines[i]))
            i += 1
            continue
        indent, mark = len(opening["indent"]), opening["mark"]
        body: list[str] = []
        j = i + 1
        while j < len(lines) and not (lines[j].strip().startswith(mark) and lines[j].strip().strip(mark[0]) == ""):
            body.append(lines[j][indent:] if lines[j][:indent].strip() == "" else lines[j])
            j += 1
        fences.append(Fence(path, i + 1, opening["info"].strip().split(" ")[0].lower(), "\n".join(body) + "\n"))
        i = j + 1
    return fences, prose


def fences(path: Path) -> list[Fence]:
    return _split(path)[0]


def prose_lines(path: Path) -> list[tuple[int, str]]:
    """The lines outside fenced blocks, numbered."""
    return _split(path)[1]


def inline_code(text: str) -> list[str]:
    """The contents of the inline code spans of a line."""
    return [m.group(2).strip() for m in _INLINE_CODE.finditer(text)]


def links(path: Path) -> list[tuple[int, str]]:
    """Link and image targets outside code, numbered by line."""
    found = []
    for number, line in prose_lines(path):
        for m in _LINK.finditer(_INLINE_CODE.sub("", line)):
            found.append((number, m.group(1)))
    return found


def heading_text(raw: str) -> str:
    """A heading's text as rendered: links reduced to their text, code and emphasis marks dropped."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", raw)
    return text.replace("`", "").replace("*", "")


def slug(text: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but `-` and `_` dropped, spaces to `-`."""
    return re.sub(r"[^\w\- ]", "", heading_text(text).strip().lower()).replace(" ", "-")


@functools.cache
def headings(path: Path) -> tuple[str, ...]:
    """The rendered text of every heading of a Markdown file, in order."""
    return tuple(heading_text(m.group(2)) for _, line in prose_lines(path) if (m := _HEADING.match(line)))


@functools.cache
def anchors(path: Path) -> frozenset[str]:
    """Every heading anchor of a Markdown file (a repeated heading gets `-1`, `-2`, ... as on GitHub)."""
    seen: dict[str, int] = {}
    out = set()
    for text in headings(path):
        base = slug(text)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return frozenset(out)
