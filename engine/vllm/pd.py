"""The P/D part of a replica's launch: KV connector for prefill/decode roles, its checks, the sidecar.

A P/D replica runs vLLM's NixlConnector. NIXL moves KV in whichever direction each request's
`kv_transfer_params` asks for, so every role uses `kv_role: kv_both` (as vLLM's own NIXL examples
do); the role decides the rest: the pod label `llm-d.ai/role` the picker filters on, and, on a
decode pod, the `epp engine pd-sidecar` in front of vLLM (the pod's port is the sidecar's; vLLM
listens on `--port` behind it). A replica that also has a CPU tier runs NIXL and the offloading
connector side by side under `MultiConnector`. NIXL's side channel (the handshake a decoder makes
with a prefiller) listens on `VLLM_NIXL_SIDE_CHANNEL_PORT` at `VLLM_NIXL_SIDE_CHANNEL_HOST`,
which must be the address other pods reach this one by.
"""

from __future__ import annotations

from typing import Any

from epp.engine.vllm.options import HostResources, LaunchOptions

PD_ROLES = ("prefill", "decode", "both")
KV_CONNECTORS = {"nixl": "NixlConnector"}
ROLE_LABEL = "llm-d.ai/role"


def validate_pd(opts: LaunchOptions, host: HostResources) -> list[str]:
    """Every reason the P/D options cannot run (empty when they can, or when P/D is off)."""
    problems: list[str] = []
    role = opts.pd_role
    if role is None:
        if opts.pd_sidecar_port is not None:
            problems.append("--pd-sidecar-port needs --pd-role decode or both (only decode pods run the sidecar)")
        return problems
    if role not in PD_ROLES:
        problems.append(f"--pd-role must be one of {', '.join(PD_ROLES)}, got {role!r}")
    if opts.kv_connector not in KV_CONNECTORS:
        problems.append(f"--kv-connector must be one of {', '.join(KV_CONNECTORS)}, got {opts.kv_connector!r}")
    if host.platform == "cpu" and not opts.force:
        problems.append("P/D KV transfer (NIXL) needs GPU memory registered with the NIC: it does not run on the "
                        "CPU platform (pass --force to build the command anyway, e.g. for a GPU pod)")
    if role == "decode" and opts.pd_sidecar_port is None:
        problems.append("a decode replica needs --pd-sidecar-port: the pod's port, where `epp engine pd-sidecar` "
                        "takes requests and runs the prefill leg (vLLM itself listens on --port behind it)")
    if role == "prefill" and opts.pd_sidecar_port is not None:
        problems.append("a prefill replica runs no sidecar: drop --pd-sidecar-port")
    if opts.topic_ip is None:
        problems.append("NIXL's side channel needs the pod's IP (decoders connect to it): pass --pod-ip "
                        "(or set POD_IP), or serve on a concrete --host")
    ports = {"--port": opts.port, "--nixl-side-channel-port": opts.nixl_side_channel_port}
    if opts.pd_sidecar_port is not None:
        ports["--pd-sidecar-port"] = opts.pd_sidecar_port
    if opts.kv_events:
        ports["--kv-events-port"] = opts.kv_events_port
        if opts.kv_replay_port is not None:
            ports["--kv-replay-port"] = opts.kv_replay_port
    if opts.disk_manager_events_port is not None:
        ports["--disk-manager-events-port"] = opts.disk_manager_events_port
    for name, port in ports.items():
        if not 0 < port < 65536:
            problems.append(f"{name} {port} is out of range")
    if len(set(ports.values())) != len(ports):
        problems.append(f"P/D ports must all differ, got {ports}")
    return problems


def nixl_connector(opts: LaunchOptions) -> dict[str, Any]:
    """The NixlConnector entry of --kv-transfer-config."""
    return {"kv_connector": KV_CONNECTORS[opts.kv_connector], "kv_role": "kv_both"}


def pd_transfer_config(opts: LaunchOptions, offload: dict[str, Any] | None) -> dict[str, Any]:
    """--kv-transfer-config of a P/D replica: NIXL alone, or NIXL and the CPU tier under MultiConnector."""
    nixl = nixl_connector(opts)
    # A KV block that cannot be pulled (the prefiller freed it, the link failed) is recomputed here
    # rather than failing the request: the sidecar has already committed to this decode replica.
    if offload is None:
        return {**nixl, "kv_load_failure_policy": "recompute"}
    inner = {k: v for k, v in offload.items() if k != "kv_load_failure_policy"}
    return {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"connectors": [nixl, inner]},
    }


def pd_env(opts: LaunchOptions) -> dict[str, str]:
    """NIXL side-channel address and port."""
    assert opts.topic_ip is not None
    return {"VLLM_NIXL_SIDE_CHANNEL_HOST": opts.topic_ip,
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(opts.nixl_side_channel_port)}


def sidecar_argv(opts: LaunchOptions) -> list[str] | None:
    """`epp engine pd-sidecar` for a decode pod (None when it runs none)."""
    if opts.pd_sidecar_port is None:
        return None
    return ["epp", "engine", "pd-sidecar", "--port", str(opts.pd_sidecar_port),
            "--vllm-port", str(opts.port), "--connector", opts.kv_connector]
