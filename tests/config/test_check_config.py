"""`epp check-config FILE`: prints the resolved pipeline (exit 0) or the error (exit 1)."""

from epp.config.check import check_config_main

GOOD = """apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: queue-scorer
- type: prefix-cache-scorer
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: queue-scorer
    weight: 2
  - pluginRef: prefix-cache-scorer
    weight: 3
"""


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
