"""The Envoy config shipped in deploy/ is the one the tests run (rendered with default ports)."""

from pathlib import Path

from epp.envoy import render_config

REPO = Path(__file__).resolve().parents[2]


def test_deploy_envoy_config_matches_the_tested_template():
    shipped = (REPO / "deploy" / "envoy" / "envoy-epp.yaml").read_text()
    assert shipped == render_config(), "regenerate with: epp envoy-config > deploy/envoy/envoy-epp.yaml"
