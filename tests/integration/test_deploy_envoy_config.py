"""The Envoy config shipped in deploy/ is the one the tests run (rendered with default ports)."""

from pathlib import Path

from epp.envoy import render_config

REPO = Path(__file__).resolve().parents[2]


def test_deploy_envoy_config_matches_the_tested_template():
    shipped = (REPO / "deploy" / "envoy" / "envoy-epp.yaml").read_text()
    assert shipped == render_config(), "regenerate with: epp envoy-config > deploy/envoy/envoy-epp.yaml"


def _processing_mode(argv, capsys) -> dict:
    import yaml

    from epp.cli import main

    assert main(["envoy-config", *argv]) == 0
    config = yaml.safe_load(capsys.readouterr().out)
    listener = config["static_resources"]["listeners"][0]
    manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
    ext_proc = next(f for f in manager["http_filters"] if f["name"] == "envoy.filters.http.ext_proc")
    return ext_proc["typed_config"]["processing_mode"]


def test_envoy_config_response_modes(capsys):
    full = _processing_mode([], capsys)
    assert (full["response_header_mode"], full["response_body_mode"]) == ("SEND", "FULL_DUPLEX_STREAMED")
    headers = _processing_mode(["--responses", "headers"], capsys)
    # Trailers stay on so that Envoy keeps the stream open until the response has ended.
    assert (headers["response_header_mode"], headers["response_body_mode"], headers["response_trailer_mode"]) == (
        "SEND", "NONE", "SEND")
    none = _processing_mode(["--responses", "none"], capsys)
    assert (none["response_header_mode"], none["response_body_mode"], none["response_trailer_mode"]) == (
        "SKIP", "NONE", "SKIP")
    assert _processing_mode(["--request-only"], capsys) == none
