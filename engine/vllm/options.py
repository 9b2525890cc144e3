"""What one vLLM replica's launch is given: the operator's options and what the host offers."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

Platform = Literal["gpu", "cpu"]

DEFAULT_NIXL_SIDE_CHANNEL_PORT = 5600  # vLLM's default for VLLM_NIXL_SIDE_CHANNEL_PORT


@dataclass(frozen=True)
class HostResources:
    """What the host offers, injectable so validation is testable without the real machine."""

    mem_available_bytes: int
    disk_free_bytes: Callable[[Path], int]
    platform: Platform


@dataclass(frozen=True)
class LaunchOptions:
    """Operator options of one vLLM replica."""

    model: str
    served_model_name: str | None = None
    python: str = "python3"
    host: str = "0.0.0.0"
    port: int = 8000
    pod_ip: str | None = None
    block_size: int = 32
    max_model_len: int | None = None
    dtype: str | None = None
    enforce_eager: bool = False
    gpu_memory_utilization: float | None = None
    kv_cache_bytes: int | None = None
    num_gpu_blocks_override: int | None = None
    cpu_offload_bytes: int | None = None
    offload_block_size: int | None = None
    cpu_eviction_policy: str = "lru"
    disk_path: str | None = None
    disk_bytes: int | None = None
    disk_manager_events_port: int | None = None
    kv_events: bool = True
    kv_events_port: int = 5557
    kv_replay_port: int | None = 5558
    kv_events_buffer_steps: int = 10_000
    sleep_mode: bool = False
    hash_seed: int = 0
    hash_algo: str = "sha256"
    cpu_threads_bind: str = "nobind"
    extra_args: tuple[str, ...] = ()
    force: bool = False
    # P/D disaggregation (engine/vllm/pd.py): role, KV connector, NIXL side channel, decode sidecar.
    pd_role: str | None = None
    kv_connector: str = "nixl"
    nixl_side_channel_port: int = DEFAULT_NIXL_SIDE_CHANNEL_PORT
    pd_sidecar_port: int | None = None

    @property
    def model_name(self) -> str:
        """The name clients and KV-event topics use for this model."""
        return self.served_model_name or self.model

    @property
    def topic_ip(self) -> str | None:
        """The address the picker knows this pod by: --pod-ip, else a concrete --host."""
        if self.pod_ip:
            return self.pod_ip
        if self.host not in ("0.0.0.0", "::", ""):
            return self.host
        return None

    @property
    def disk_events_port(self) -> int | None:
        """Port of the disk manager's BlockRemoved publisher: explicit, else the port after the KV-event ports.

        A disk tier always announces its removals (otherwise the picker keeps routing to blocks
        the manager deleted), so with a disk tier there is always a port, 5559 by default.
        """
        if self.disk_path is None:
            return None
        if self.disk_manager_events_port is not None:
            return self.disk_manager_events_port
        return max(self.kv_events_port, self.kv_replay_port or 0) + 1

    @property
    def kv_events_topic(self) -> str:
        """`kv@<pod ip>:<pod port>@<model>`: the picker maps events to the endpoint by this topic
        (on a decode pod the pod's port is the P/D sidecar's)."""
        return f"kv@{self.topic_ip}:{self.pd_sidecar_port or self.port}@{self.model_name}"
