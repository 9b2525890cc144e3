"""The CLI explains itself: --version, --help of every command and tool, help text on every flag."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from epp.cli import build_parser, epp_version, main


def run(capsys, *argv: str) -> tuple[int, str, str]:
    """`epp ARGV` in this process: exit code, stdout, stderr (argparse exits through SystemExit)."""
    try:
        code = main(list(argv))
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


def test_version_prints_the_installed_version(capsys):
    code, out, _ = run(capsys, "--version")
    assert code == 0
    assert out == f"epp (llm-epp) {epp_version()}\n"
    assert epp_version()[0].isdigit()


def test_engine_help_lists_its_tools_and_exits_0(capsys):
    code, out, _ = run(capsys, "engine", "--help")
    assert code == 0
    assert out.startswith("usage: epp engine")
    assert "    serve " in out and "    disk-manager" in out


@pytest.mark.parametrize("argv, complaint", [
    ((), "the following arguments are required: TOOL"),
    (("bogus",), "invalid choice: 'bogus'"),
])
def test_engine_without_a_known_tool_says_which_exist_and_exits_2(capsys, argv, complaint):
    code, _, err = run(capsys, "engine", *argv)
    assert code == 2
    assert complaint in err and "usage: epp engine" in err


def test_engine_tool_help_is_the_tools_own(capsys):
    code, out, _ = run(capsys, "engine", "serve", "--help")
    assert code == 0
    assert out.startswith("usage: epp engine serve")


def test_sim_help_names_the_epp_command_and_hides_the_internal_worker():
    done = subprocess.run([sys.executable, "-m", "epp.cli", "sim", "--help"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0
    assert done.stdout.startswith("usage: epp sim")
    assert "fleet" in done.stdout
    assert "SUPPRESS" not in done.stdout and "worker" not in done.stdout and "python -m" not in done.stdout


def subcommand(name: str) -> argparse.ArgumentParser:
    parsers = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return parsers.choices[name]


@pytest.mark.parametrize("command", ["serve", "check-config", "demo", "envoy-config"])
def test_every_flag_and_argument_has_help_text(command):
    parser = subcommand(command)
    undocumented = [action.dest for action in parser._actions if not action.help]
    assert undocumented == []
    assert parser.description


def test_every_flag_of_engine_serve_has_help_text():
    from epp.engine.vllm.cli import build_parser as engine_serve_parser

    assert [action.dest for action in engine_serve_parser()._actions if not action.help] == []


@pytest.mark.parametrize("command", ["serve", "check-config", "demo", "envoy-config"])
def test_command_help_exits_0(capsys, command):
    code, out, _ = run(capsys, command, "--help")
    assert code == 0
    assert out.startswith(f"usage: epp {command}")


def test_every_option_of_sim_fleet_has_help_and_its_default(capsys):
    from epp.engine.sim.__main__ import _fleet_parser
    from epp.engine.sim.__main__ import main as sim_main

    parser = argparse.ArgumentParser()
    fleet = _fleet_parser(parser.add_subparsers())
    options = [action for action in fleet._actions if action.option_strings and action.dest != "help"]
    assert len(options) >= 30
    assert [action.dest for action in options if not action.help or "default" not in action.help] == []
    assert fleet.description
    code = None
    try:
        sim_main(["fleet", "--help"], prog="epp sim")
    except SystemExit as exc:
        code = exc.code
    out = capsys.readouterr().out
    assert code == 0 and out.startswith("usage: epp sim fleet")
    assert " ".join(out.split()).count("default: ") == len(options)
