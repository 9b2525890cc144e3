"""`epp check-config FILE`: prints the resolved pipeline (exit 0) or the error (exit 1)."""

from epp.config.check import check_config_main
from tests.support.configs import endpoint_picker_config

GOOD = endpoint_picker_config(["queue-scorer", "prefix-cache-scorer"], {"queue-scorer": 2, "prefix-cache-scorer": 3})


def test_valid_config_prints_the_pipeline(tmp_path, capsys):
    path = tmp_path / "good.yaml"
    path.write_text(GOOD)
    assert check_config_main(str(path)) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"EndpointPickerConfig {path}: OK")
    assert "- queue-scorer weight 2" in out and "- prefix-cache-scorer weight 3" in out
    assert "picker: max-score-picker" in out
    assert ("approx-prefix-cache-producer (type approx-prefix-cache-producer; data-producer, pre-request) "
            "[autoTune=true blockSizeTokens=16") in out
    assert "auto-created: default producer of 'prefix-cache-match-info' for 'prefix-cache-scorer'" in out


def test_invalid_config_prints_the_error(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text(GOOD.replace("weight: 3", "weight: -3"))
    assert check_config_main(str(path)) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (f"error: {path}: schedulingProfiles[0].plugins[1].weight: "
                            "must be a non-negative number, got -3\n")


def test_parameters_are_printed_as_they_are_written_in_yaml(tmp_path, capsys):
    path = tmp_path / "legacy.yaml"
    path.write_text(GOOD.replace("- type: prefix-cache-scorer\n",
                                 "- type: prefix-cache-scorer\n  parameters: {autoTune: false, blockSize: 64}\n"))
    assert check_config_main(str(path)) == 0
    out = capsys.readouterr().out
    assert "prefix-cache-scorer (type prefix-cache-scorer; scorer) [autoTune=false, blockSize=64]" in out
    assert "False" not in out and "True" not in out


def test_a_yaml_syntax_error_names_the_file_line_and_column(tmp_path, capsys):
    path = tmp_path / "broken.yaml"
    path.write_text(GOOD.replace("- type: queue-scorer\n", "- type: queue-scorer\n - type: oops\n"))
    assert check_config_main(str(path)) == 1
    err = capsys.readouterr().err
    assert err == (f"error: {path}: invalid YAML: line 5, column 2: expected <block end>, but found "
                   "'<block sequence start>' (while parsing a block mapping at line 1, column 1)\n")
    assert "<unicode string>" not in err
