"""`epp serve` refuses what it cannot use with one clear line and exit code 2, before serving anything."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys

import pytest

from epp.cli import main
from epp.netutil import free_ports
from tests.support.configs import endpoint_picker_config

EPP = [sys.executable, "-m", "epp.cli"]


def serve(capsys, *args: str) -> tuple[int, str]:
    """Run `epp serve ARGS` in this process; its exit code and what it printed on stderr."""
    code = main(["serve", "--bind-address", "127.0.0.1", "--grpc-port", "0", "--grpc-health-port", "0",
                 "--metrics-port", "0", *args])
    return code, capsys.readouterr().err


def test_a_missing_config_file_is_one_line_naming_it(capsys, tmp_path):
    code, err = serve(capsys, "--endpoints", "127.0.0.1:8000", "--config-file", str(tmp_path / "missing.yaml"))
    assert code == 2
    assert err == (f"epp serve: invalid configuration: {tmp_path / 'missing.yaml'}: cannot read config file: "
                   "No such file or directory\n")


def test_a_bad_config_file_names_the_file_and_the_field(capsys, tmp_path):
    path = tmp_path / "picker.yaml"
    path.write_text(endpoint_picker_config(["queue-scorr"]))
    code, err = serve(capsys, "--endpoints", "127.0.0.1:8000", "--config-file", str(path))
    assert code == 2
    assert err.startswith(f"epp serve: invalid configuration: {path}: plugins[0].type: unknown plugin type "
                          "'queue-scorr' (did you mean 'queue-scorer'?)")
    assert err.count("\n") == 1


def test_a_missing_endpoints_file_is_refused_instead_of_serving_no_endpoints(capsys, tmp_path):
    code, err = serve(capsys, "--endpoints-file", str(tmp_path / "pool.yaml"))
    assert code == 2
    assert err == f"epp serve: --endpoints-file {tmp_path / 'pool.yaml'}: cannot read it: No such file or directory\n"


def test_an_endpoints_file_that_does_not_parse_is_refused(capsys, tmp_path):
    path = tmp_path / "pool.yaml"
    path.write_text("endpoints:\n- address: 10.0.0.1\n  port: http\n")
    code, err = serve(capsys, "--endpoints-file", str(path))
    assert code == 2
    assert err == (f"epp serve: --endpoints-file {path}: endpoints[0].port: must be an integer port 1-65535, "
                   "got 'http'\n")


@pytest.mark.parametrize("value, message", [
    ("", "--endpoints: no endpoint in ''; expected ip:port[,ip:port...]"),
    (" , ", "--endpoints: no endpoint in ' , '; expected ip:port[,ip:port...]"),
    ("10.0.0.1:8000,10.0.0.1:8000", "--endpoints: endpoint 10.0.0.1:8000 is listed twice"),
    ("10.0.0.1:8000#kv-events-port=x",
     "--endpoints: endpoint 10.0.0.1:8000: label kv-events-port='x' must be a port 1-65535"),
    ("10.0.0.1:8000#kv-replay-port=70000",
     "--endpoints: endpoint 10.0.0.1:8000: label kv-replay-port='70000' must be a port 1-65535"),
    ("10.0.0.1", "--endpoints: endpoint '10.0.0.1': expected ip:port"),
])
def test_endpoints_values_that_cannot_be_routed_to_are_refused(capsys, value, message):
    code, err = serve(capsys, "--endpoints", value)
    assert code == 2
    assert err == f"epp serve: {message}\n"


@pytest.mark.parametrize("flag", ["--grpc-port", "--metrics-port"])
def test_a_port_in_use_is_one_line_and_everything_started_is_stopped(flag):
    # --metrics-port binds last: discovery, the /metrics scraper and the gRPC servers are already up then,
    # and must be stopped without "Unclosed client session" or a traceback.
    grpc_port, health_port, metrics_port = free_ports(3)
    ports = {"--grpc-port": grpc_port, "--grpc-health-port": health_port, "--metrics-port": metrics_port}
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", ports[flag]))
        taken.listen()
        done = subprocess.run(
            [*EPP, "serve", "--bind-address", "127.0.0.1", "--endpoints", "127.0.0.1:1",
             *(str(part) for item in ports.items() for part in item)],
            capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr == f"epp serve: cannot listen on 127.0.0.1:{ports[flag]} ({flag}): Address already in use\n"
    assert done.stdout == ""


def test_serve_says_on_one_line_where_it_listens_what_it_routes_to_and_which_config(tmp_path):
    config = tmp_path / "picker.yaml"
    config.write_text(endpoint_picker_config(["random-picker"]))
    grpc_port, health_port, metrics_port = free_ports(3)
    proc = subprocess.Popen(
        [*EPP, "serve", "--bind-address", "127.0.0.1", "--grpc-port", str(grpc_port), "--grpc-health-port",
         str(health_port), "--metrics-port", str(metrics_port), "--endpoints", "127.0.0.1:8001,127.0.0.1:8002",
         "--config-file", str(config), "--refresh-metrics-interval", "60", "--grace-period", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=15)
    assert line == (f"epp serve: ext_proc on 127.0.0.1:{grpc_port}, health on 127.0.0.1:{health_port}, "
                    f"metrics on http://127.0.0.1:{metrics_port}/metrics; 2 endpoint(s) 127.0.0.1:8001, "
                    f"127.0.0.1:8002; config: {config}\n")
    assert proc.returncode == 0
