"""`epp serve` as a process: it serves health once endpoints are known and exits cleanly on SIGTERM."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from epp.netutil import free_ports


def test_serve_reports_ready_and_drains_on_sigterm():
    grpc_port, health_port, metrics_port = free_ports(3)
    proc = subprocess.Popen(
        [sys.executable, "-m", "epp.cli", "serve", "--grpc-port", str(grpc_port), "--grpc-health-port",
         str(health_port), "--metrics-port", str(metrics_port), "--bind-address", "127.0.0.1",
         "--endpoints", "127.0.0.1:1", "--refresh-metrics-interval", "60", "--grace-period", "2"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{health_port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            deadline = time.monotonic() + 30
            while True:
                try:
                    status = stub.Check(health_pb2.HealthCheckRequest(service="readiness"), timeout=1).status
                    if status == health_pb2.HealthCheckResponse.SERVING:
                        break
                except grpc.RpcError:
                    pass
                assert time.monotonic() < deadline, "epp serve never became ready"
                time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_serve_rejects_a_bad_config_with_a_clear_message():
    proc = subprocess.run([sys.executable, "-m", "epp.cli", "serve", "--config-text", "kind: Nope"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "invalid configuration" in proc.stderr
