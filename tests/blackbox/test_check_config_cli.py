"""`epp check-config FILE` through the installed `epp` console script, in a subprocess."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.configs import endpoint_picker_config, objectives, plugin

EPP = Path(sys.executable).with_name("epp")

# The cases below edit this document's text: a typo, a bad value, a broken line.
VALID = endpoint_picker_config(
    ["queue-scorer", "kv-cache-utilization-scorer", plugin("prefix-cache-scorer", name="prefix"),
     "lora-affinity-scorer", plugin("max-score-picker", maxNumOfEndpoints=2)],
    {"queue-scorer": 2, "kv-cache-utilization-scorer": 2, "prefix": 3, "lora-affinity-scorer": None,
     "max-score-picker": None},
    objectives=objectives(batch=-1))


def check_config(tmp_path: Path, text: str) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "epp.yaml"
    path.write_text(text)
    return subprocess.run([str(EPP), "check-config", str(path)], capture_output=True, text=True, timeout=30,
                          cwd=tmp_path, check=False)


def test_valid_file_prints_the_resolved_pipeline_and_exits_0(tmp_path):
    done = check_config(tmp_path, VALID)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert out.startswith(f"EndpointPickerConfig {tmp_path / 'epp.yaml'}: OK\n")
    assert "      - queue-scorer weight 2\n" in out
    assert "      - kv-cache-utilization-scorer weight 2\n" in out
    assert "      - prefix weight 3\n" in out
    assert "      - lora-affinity-scorer weight 1\n" in out  # default weight
    assert "picker: max-score-picker" in out
    assert "maxNumOfEndpoints=2" in out
    # Defaults the loader filled in are shown with the reason.
    assert "auto-created: default producer of 'prefix-cache-match-info' for 'prefix'" in out
    assert "profile handler: single-profile-handler (type single-profile-handler)" in out
    assert "saturation detector: utilization-detector" in out


INVALID = [
    ("unknown plugin type",
     VALID.replace("- type: lora-affinity-scorer", "- type: lora-affinity-scorr"),
     "plugins[3].type: unknown plugin type 'lora-affinity-scorr' (did you mean 'lora-affinity-scorer'?); "
     "registered types: "),
    ("unknown field",
     VALID.replace("    weight: 3", "    wieght: 3"),
     "schedulingProfiles[0].plugins[2].wieght: unknown field (did you mean 'weight'?); "
     "allowed fields: pluginRef, weight"),
    ("empty weight",
     VALID.replace("    weight: 3", "    weight:"),
     "schedulingProfiles[0].plugins[2].weight: is empty; give a non-negative number, or leave the field out "
     "for the default 1"),
    ("YAML syntax",
     VALID.replace("    maxNumOfEndpoints: 2", "    maxNumOfEndpoints: [2"),
     "invalid YAML: line 12, column 19: expected ',' or ']', but got ':' "
     "(while parsing a flow sequence at line 11, column 24)"),
    ("bad weight",
     VALID.replace("    weight: 3", "    weight: -3"),
     "schedulingProfiles[0].plugins[2].weight: must be a non-negative number, got -3"),
    ("bad parameter",
     VALID.replace("maxNumOfEndpoints: 2", "maxNumOfEndpoints: 0"),
     "plugins[4].parameters: plugin 'max-score-picker': parameter 'maxNumOfEndpoints' must be >= 1, got 0"),
    ("unknown reference",
     VALID.replace("  - pluginRef: prefix\n", "  - pluginRef: prefx\n"),
     ("schedulingProfiles[0].plugins[2].pluginRef: unknown plugin 'prefx' (did you mean 'prefix'?); "
      "defined plugins: queue-scorer, "
      "kv-cache-utilization-scorer, prefix, lora-affinity-scorer, max-score-picker")),
    ("missing producer",
     VALID.replace("- type: lora-affinity-scorer", "- type: predicted-ttft-scorer")
          .replace("pluginRef: lora-affinity-scorer", "pluginRef: predicted-ttft-scorer"),
     ("plugins: plugin 'predicted-ttft-scorer' consumes data key 'prefix-cache-tier-match' but no plugin "
      "produces it and no default producer is registered")),
    ("objective priority",
     VALID.replace("priority: -1", "priority: low"),
     "objectives[0].priority: must be an integer (negative = sheddable), got 'low'"),
    ("apiVersion",
     VALID.replace("apiVersion: llm-d.ai/v1\n", "apiVersion: llm-d.ai/v9\n"),
     ("apiVersion: unsupported apiVersion 'llm-d.ai/v9'; "
      "allowed: llm-d.ai/v1, llm-d.ai/v1alpha1, inference.networking.x-k8s.io/v1alpha1")),
]


@pytest.mark.parametrize("case, text, message", INVALID, ids=[c[0] for c in INVALID])
def test_invalid_file_exits_1_naming_the_field(tmp_path, case, text, message):
    done = check_config(tmp_path, text)
    assert done.returncode == 1, (case, done.stdout)
    assert done.stdout == ""
    assert done.stderr.startswith(f"error: {tmp_path / 'epp.yaml'}: {message}"), done.stderr
    assert done.stderr.count("\n") == 1  # one line, no traceback


def test_missing_file_exits_1(tmp_path):
    done = subprocess.run([str(EPP), "check-config", str(tmp_path / "absent.yaml")], capture_output=True,
                          text=True, timeout=30, check=False)
    assert done.returncode == 1
    assert done.stderr.startswith(f"error: {tmp_path / 'absent.yaml'}: cannot read config file")
