"""The command line: `--emit-endpoint-scores` spellings, `--enable-debug-endpoint`, and `epp explain`'s usage errors."""

from __future__ import annotations

import pytest

from epp.cli import build_parser, main


@pytest.mark.parametrize("argv, expected", [
    ([], None), (["--emit-endpoint-scores"], "totals"), (["--emit-endpoint-scores=totals"], "totals"),
    (["--emit-endpoint-scores=scorers"], "scorers"), (["--emit-endpoint-scores=true"], "totals"),
    (["--emit-endpoint-scores=false"], None),
])
def test_emit_endpoint_scores_takes_llm_ds_boolean_too(argv, expected):
    assert build_parser().parse_args(["serve", *argv]).emit_endpoint_scores == expected


def test_a_wrong_scores_mode_is_refused_naming_the_choices(capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["serve", "--emit-endpoint-scores=all"])
    assert exit_.value.code == 2
    assert "'all': expected totals or scorers (or true/false)" in capsys.readouterr().err


def test_the_debug_endpoint_is_off_by_default():
    assert build_parser().parse_args(["serve"]).enable_debug_endpoint is False
    assert build_parser().parse_args(["serve", "--enable-debug-endpoint"]).enable_debug_endpoint is True


@pytest.mark.parametrize("argv, message", [
    (["explain", "/no/such/request.json"], "epp explain: cannot read the body /no/such/request.json: No such file"),
    (["explain", "-H", "no-colon", '{"model": "m"}'], "epp explain: --header 'no-colon': expected 'NAME: VALUE'"),
])
def test_explain_usage_errors_exit_2_with_one_line(capsys, argv, message):
    assert main(argv) == 2
    assert capsys.readouterr().err.startswith(message)
