"""`epp calibration`: the learned predicted-TTFT costs, read back from a picker's /metrics page."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest, start_http_server

from epp.calibration_cli import calibration_main, format_table, read_calibration
from epp.framework import PluginContext
from tests.support.scheduling import make_plugin


def learned_registry() -> tuple[CollectorRegistry, object]:
    """A registry whose predicted-ttft-scorer has learned 0.5 ms per token on one endpoint, and the scorer.

    The registry holds its scorers weakly (a picker's pipeline owns them), so the caller keeps it alive.
    """
    registry = CollectorRegistry()
    context = PluginContext(metrics_registry=registry)
    scorer = make_plugin("predicted-ttft-scorer", context=context)
    for i in range(60):
        tokens = 500 + 100 * (i % 7)
        booking = context.load.pick("10.0.0.1:8000", model="m", prompt_tokens=tokens, now=100.0 + i)
        context.load.first_token(booking, now=100.0 + i + 0.02 + 5e-4 * tokens)
        context.load.complete(booking)
    return registry, scorer


def test_reads_the_learned_costs_from_the_metrics_page():
    registry, _scorer = learned_registry()
    rows = read_calibration(generate_latest(registry).decode())
    [(key, values)] = rows.items()
    assert key == ("predicted-ttft-scorer", "10.0.0.1:8000", "m")
    assert values["prefill_seconds_per_token"] == pytest.approx(5e-4, rel=0.05)
    assert values["observations"] == 60
    table = format_table(rows)
    assert "prefill µs/token" in table.splitlines()[0]
    assert "10.0.0.1:8000" in table
    assert f"{values['prefill_seconds_per_token'] * 1e6:.3g}" in table.splitlines()[1]


def test_cli_prints_the_table_of_a_running_picker(capsys):
    registry, _scorer = learned_registry()
    server, thread = start_http_server(0, "127.0.0.1", registry=registry)
    try:
        assert calibration_main(f"127.0.0.1:{server.server_port}") == 0
    finally:
        server.shutdown()
        server.server_close()
    out = capsys.readouterr().out
    assert "10.0.0.1:8000" in out and "predicted-ttft-scorer" in out


def test_cli_says_why_when_there_is_nothing_to_show(capsys):
    server, thread = start_http_server(0, "127.0.0.1", registry=CollectorRegistry())
    try:
        assert calibration_main(f"http://127.0.0.1:{server.server_port}/metrics") == 1
    finally:
        server.shutdown()
        server.server_close()
    assert "no predicted-TTFT calibration yet" in capsys.readouterr().err
    assert calibration_main("http://127.0.0.1:1/metrics", timeout=2) == 1
    assert "cannot read" in capsys.readouterr().err
