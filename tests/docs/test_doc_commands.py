"""Every `epp ...` command line the README and docs/ show names a real command and real flags.

Checked against the commands' own argparse help (`epp COMMAND [TOOL] --help`), run in this process:
nothing is served or started.
"""

from __future__ import annotations

import contextlib
import functools
import io
import re
import shlex

import pytest

from epp.cli import ENGINE_TOOLS, build_parser, main
from tests.docs.markdown import DOC_FILES, ROOT, fences, inline_code, prose_lines

SHELL_LANGS = ("bash", "sh", "shell", "console")
COMMAND_ENDS = {"|", "||", "&&", ";", ">", ">>", "<", "2>", "&"}
# Commands whose next word is a tool with its own parser.
WITH_TOOLS = ("engine", "sim")


def _joined(text: str) -> list[tuple[int, str]]:
    """Shell lines (numbered from 0 by where they start) with backslash continuations joined and
    ` # comments` dropped."""
    out: list[tuple[int, str]] = []
    pending, start = "", 0
    for number, line in enumerate(text.splitlines()):
        line = re.sub(r"(^|\s)#\s.*$", "", line) if not line.lstrip().startswith("#") else ""
        if not pending:
            start = number
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        out.append((start, pending + line))
        pending = ""
    return out


def _commands(line: str) -> list[list[str]]:
    """The `epp` invocations on one shell line, each as its words after `epp`."""
    words = shlex.split(line)
    found: list[list[str]] = []
    current: list[str] | None = None
    for word in words:
        if current is not None and (word in COMMAND_ENDS or word.endswith(";")):
            found.append(current + ([word[:-1]] if word.endswith(";") and word != ";" else []))
            current = None
        elif current is not None:
            current.append(word)
        elif word == "epp" or word.endswith("/epp"):
            current = []
    if current is not None:
        found.append(current)
    return [words for words in found if words]  # the bare name `epp` in prose invokes nothing


def shown_commands() -> list[tuple[str, list[str]]]:
    """(where, words after `epp`) for every command in shell blocks and inline code of the docs."""
    shown = []
    for path in DOC_FILES:
        name = path.relative_to(ROOT)
        for fence in fences(path):
            if fence.lang in SHELL_LANGS:
                for offset, line in _joined(fence.text):
                    shown += [(f"{name}:{fence.line + 1 + offset}", words) for words in _commands(line)]
        for number, line in prose_lines(path):
            for code in inline_code(line):
                if re.match(r"^(\S*/)?epp(\s|$)", code):
                    shown += [(f"{name}:{number}", words) for words in _commands(code)]
    return shown


SHOWN = shown_commands()


@functools.cache
def help_text(*path: str) -> tuple[bool, str]:
    """`epp PATH --help`: (True, the help printed), or (False, the complaint) when PATH is not a command."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main([*path, "--help"])
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
    return (True, out.getvalue()) if code == 0 else (False, err.getvalue().strip())


def command_path(words: list[str]) -> tuple[str, ...]:
    """The command (and tool) a line invokes: `serve`, `engine serve`, `sim fleet`; () for `epp --version`."""
    if not words or words[0].startswith("-"):
        return ()
    if words[0] in WITH_TOOLS and len(words) > 1 and not words[1].startswith("-"):
        return (words[0], words[1])
    return (words[0],)


def test_the_docs_show_commands_of_every_kind():
    paths = {command_path(words) for _, words in SHOWN}
    assert {("serve",), ("check-config",), ("envoy-config",), ("cost",), ("engine", "serve"),
            ("engine", "disk-manager"), ("sim", "fleet")} <= paths


def problems(words: list[str]) -> list[str]:
    """What is wrong with `epp WORDS` as a command line: an unknown command or tool, a flag it lacks."""
    path = command_path(words)
    commands = next(a for a in build_parser()._actions if a.dest == "command").choices
    if path and path[0] not in commands:
        return [f"`epp {path[0]}` is not a command (commands: {', '.join(commands)})"]
    if path[:1] == ("engine",) and (len(path) < 2 or path[1] not in ENGINE_TOOLS):
        return [f"`epp engine` needs a tool: {', '.join(ENGINE_TOOLS)}"]
    known, usage = help_text(*path)
    if not known:
        return [f"`epp {' '.join(path)}` is not a command: {usage}"]
    found = []
    for word in words[len(path):]:
        flag = word.strip("[]").split("=")[0]
        if re.fullmatch(r"--?[A-Za-z][\w-]*", flag) and flag not in ("-h", "--help") and \
                not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", usage):
            found.append(f"`epp {' '.join(path)}` has no flag {flag}")
    return found


@pytest.mark.parametrize("line, wrong", [
    ("epp serve --endpoints 10.0.0.5:8000 --refresh-metric-interval 0.5", ["`epp serve` has no flag --refresh-metric-interval"]),
    ("epp engine serv --dry-run", ["`epp engine` needs a tool: serve, disk-manager, pd-sidecar"]),
    ("epp sim fleat", ["`epp sim fleat` is not a command: "]),
    ("epp serv", ["`epp serv` is not a command (commands: "]),
])
def test_a_wrong_command_line_is_caught(line, wrong):
    [words] = _commands(line)
    found = problems(words)
    assert len(found) == len(wrong) and all(f.startswith(w) for f, w in zip(found, wrong)), found


def test_command_lines_are_cut_at_shell_operators_and_continuations_joined():
    lines = _joined("epp envoy-config --epp-port 9002 > envoy.yaml && .venv/bin/envoy -c envoy.yaml  # Envoy\n"
                    "epp engine serve --model m \\\n  --dry-run\n")
    assert [(start, _commands(line)) for start, line in lines] == [
        (0, [["envoy-config", "--epp-port", "9002"]]), (1, [["engine", "serve", "--model", "m", "--dry-run"]])]


@pytest.mark.parametrize("where, words", SHOWN, ids=[f"{w} epp {' '.join(c)[:60]}" for w, c in SHOWN])
def test_every_command_shown_is_real(where, words):
    assert problems(words) == [], where
