"""`epp engine serve`: start one vLLM replica with prefix caching, KV events and offload tiers."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from epp.engine.vllm.env import VllmEnvNotFound, find_vllm_python
from epp.engine.vllm.launcher import (
    HASH_ALGOS,
    HostResources,
    LaunchError,
    LaunchOptions,
    build_plan,
    host_resources,
    parse_size,
)


def build_parser() -> argparse.ArgumentParser:
    """The argparse of `epp engine serve`."""
    p = argparse.ArgumentParser(
        prog="epp engine serve",
        description="Start a vLLM replica wired to the picker: prefix caching, KV events "
        "(topic kv@<pod ip>:<port>@<model>), optional CPU and disk KV offload tiers.",
    )
    p.add_argument("--model", required=True, help="model directory (or name vLLM can load)")
    p.add_argument("--served-model-name", help="name clients and KV-event topics use (default: --model)")
    p.add_argument("--python", help="python that has vLLM (default: the venv of .ci/setup-vllm-env, else python3)")
    p.add_argument("--host", default="0.0.0.0", help="address vLLM's HTTP server binds (default 0.0.0.0)")
    p.add_argument("--port", type=int, default=8000, help="vLLM's HTTP port (default 8000)")
    p.add_argument("--pod-ip", default=os.environ.get("POD_IP"),
                   help="IP the picker knows this pod by, for the KV-events topic (default: $POD_IP)")
    p.add_argument("--block-size", type=int, default=32, help="tokens per KV block (CPU needs a multiple of 32)")
    p.add_argument("--max-model-len", type=int, help="longest prompt + output in tokens (default: the model's)")
    p.add_argument("--dtype", help="weights and activations type, e.g. bfloat16 (default: vLLM's choice)")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs: faster start, slower decode")
    p.add_argument("--gpu-memory-utilization", type=float,
                   help="share of device memory vLLM may use, in (0, 1] (default: vLLM's 0.9)")
    p.add_argument("--gpu-kv-bytes", type=parse_size,
                   help="KV cache size on the device, e.g. 8GiB (on CPU: VLLM_CPU_KVCACHE_SPACE)")
    p.add_argument("--num-gpu-blocks-override", type=int, help="fixed number of device KV blocks")
    p.add_argument("--cpu-offload-bytes", type=parse_size, help="CPU tier size, e.g. 32GiB (needs a GPU)")
    p.add_argument("--offload-block-size", type=int, help="tokens per offloaded chunk (multiple of --block-size)")
    p.add_argument("--cpu-eviction-policy", default="lru", choices=["lru", "arc"],
                   help="which blocks the CPU tier drops when full (default lru)")
    p.add_argument("--disk-path", help="root directory of the disk (fs) tier, behind the CPU tier")
    p.add_argument("--disk-bytes", type=parse_size, help="disk tier budget, e.g. 200GiB")
    p.add_argument("--disk-manager-events-port", type=int,
                   help="port of the disk manager's BlockRemoved publisher (shown in the dry run)")
    p.add_argument("--no-kv-events", dest="kv_events", action="store_false",
                   help="publish no KV events (the picker then cannot route by precise prefix)")
    p.add_argument("--kv-events-port", type=int, default=5557, help="ZMQ PUB port (bound on all interfaces)")
    p.add_argument("--kv-replay-port", type=int, default=5558, help="ZMQ replay ROUTER port")
    p.add_argument("--sleep-mode", action="store_true", help="--enable-sleep-mode and the /sleep dev routes")
    p.add_argument("--hash-seed", type=int, default=0, help="PYTHONHASHSEED, the same on every replica")
    p.add_argument("--hash-algo", default="sha256", choices=HASH_ALGOS,
                   help="vLLM's prefix-cache block hash (default sha256)")
    p.add_argument("--platform", default="auto", choices=["auto", "gpu", "cpu"],
                   help="auto: this machine's; with --dry-run, gpu or cpu previews the command for a machine of "
                        "that kind (this machine's RAM and disk are not checked)")
    p.add_argument("--force", action="store_true",
                   help="build the command even where the platform refuses offload or sleep mode")
    p.add_argument("--dry-run", action="store_true", help="print the exact command and environment, start nothing")
    p.add_argument("extra", nargs=argparse.REMAINDER,
                   help="after --: more vLLM arguments, passed through unchanged")
    return p


def options_from_args(args: argparse.Namespace, python: str) -> LaunchOptions:
    """LaunchOptions from parsed arguments."""
    extra = list(args.extra)
    if extra and extra[0] == "--":
        extra = extra[1:]
    return LaunchOptions(
        model=args.model, served_model_name=args.served_model_name, python=python,
        host=args.host, port=args.port, pod_ip=args.pod_ip, block_size=args.block_size,
        max_model_len=args.max_model_len, dtype=args.dtype, enforce_eager=args.enforce_eager,
        gpu_memory_utilization=args.gpu_memory_utilization, kv_cache_bytes=args.gpu_kv_bytes,
        num_gpu_blocks_override=args.num_gpu_blocks_override,
        cpu_offload_bytes=args.cpu_offload_bytes, offload_block_size=args.offload_block_size,
        cpu_eviction_policy=args.cpu_eviction_policy, disk_path=args.disk_path,
        disk_bytes=args.disk_bytes,
        disk_manager_events_port=args.disk_manager_events_port, kv_events=args.kv_events, kv_events_port=args.kv_events_port,
        kv_replay_port=args.kv_replay_port, sleep_mode=args.sleep_mode, hash_seed=args.hash_seed,
        hash_algo=args.hash_algo, extra_args=tuple(extra), force=args.force,
    )


def _default_python() -> str:
    try:
        return str(find_vllm_python())
    except VllmEnvNotFound:
        return "python3"  # in a vLLM container image the system python has vLLM


def _host(args: argparse.Namespace) -> HostResources:
    """This machine; but a dry run for a named platform previews another machine's command (a GPU pod's,
    from a laptop), so this machine's RAM and free disk are not the limits then."""
    if args.dry_run and args.platform != "auto":
        return HostResources(mem_available_bytes=sys.maxsize, disk_free_bytes=lambda _path: sys.maxsize,
                             platform=args.platform)
    return host_resources(args.platform)


def main(argv: Sequence[str] | None = None) -> int:
    """Validate, then print (--dry-run) or exec the vLLM server; 2 on invalid options."""
    args = build_parser().parse_args(argv)
    opts = options_from_args(args, args.python or _default_python())
    try:
        plan = build_plan(opts, _host(args))
    except LaunchError as exc:
        print("epp engine serve: cannot start this replica:", file=sys.stderr)
        for problem in exc.problems:
            print(f"  - {problem}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(plan.render())
        return 0
    print(plan.render(), file=sys.stderr, flush=True)
    env = dict(os.environ)
    env.update(plan.env)
    # exec, so vLLM receives the pod's signals directly and its exit code is the pod's.
    os.execvpe(plan.argv[0], plan.argv, env)
    return 0  # unreachable


if __name__ == "__main__":
    sys.exit(main())
