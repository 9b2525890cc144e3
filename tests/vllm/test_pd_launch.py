"""Golden commands of P/D replicas (NIXL) from the launcher, and the combinations it refuses."""

from __future__ import annotations

import json

import pytest

from epp.engine.vllm import cli
from epp.engine.vllm.launcher import HostResources, LaunchError, LaunchOptions, build_plan

GIB = 1 << 30
GPU = HostResources(mem_available_bytes=256 * GIB, disk_free_bytes=lambda p: 2048 * GIB, platform="gpu")
CPU = HostResources(mem_available_bytes=16 * GIB, disk_free_bytes=lambda p: 100 * GIB, platform="cpu")
NIXL = '{"kv_connector":"NixlConnector","kv_role":"kv_both","kv_load_failure_policy":"recompute"}'
BASE = ["/py", "-m", "vllm.entrypoints.openai.api_server", "--model", "/models/llama", "--served-model-name", "llama",
        "--host", "0.0.0.0"]


def events(port: int) -> list[str]:
    return ["--kv-events-config",
            '{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:5557",'
            f'"topic":"kv@10.0.0.7:{port}@llama","buffer_steps":10000,"replay_endpoint":"tcp://*:5558"}}']


def options(**kw) -> LaunchOptions:
    return LaunchOptions(model="/models/llama", served_model_name="llama", python="/py", pod_ip="10.0.0.7",
                         block_size=16, **kw)


def test_prefill_replica_golden():
    plan = build_plan(options(pd_role="prefill"), GPU)
    assert plan.argv == [*BASE, "--port", "8000", "--block-size", "16", "--enable-prefix-caching",
                         "--prefix-caching-hash-algo", "sha256", "--enable-prompt-tokens-details", *events(8000),
                         "--kv-transfer-config", NIXL]
    assert plan.env == {"PYTHONHASHSEED": "0", "VLLM_NIXL_SIDE_CHANNEL_HOST": "10.0.0.7",
                        "VLLM_NIXL_SIDE_CHANNEL_PORT": "5600"}
    assert plan.pd_sidecar_argv is None
    assert plan.render().splitlines()[0] == "# P/D role prefill: label the pod llm-d.ai/role=prefill"


def test_decode_replica_golden_runs_vllm_behind_the_sidecar():
    plan = build_plan(options(pd_role="decode", port=8001, pd_sidecar_port=8000, nixl_side_channel_port=5601), GPU)
    # The topic names the pod's port (the sidecar's): that is the endpoint the picker knows.
    assert plan.argv == [*BASE, "--port", "8001", "--block-size", "16", "--enable-prefix-caching",
                         "--prefix-caching-hash-algo", "sha256", "--enable-prompt-tokens-details", *events(8000),
                         "--kv-transfer-config", NIXL]
    assert plan.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5601"
    assert plan.pd_sidecar_argv == ["epp", "engine", "pd-sidecar", "--port", "8000", "--vllm-port", "8001",
                                    "--connector", "nixl"]
    assert plan.topic == "kv@10.0.0.7:8000@llama"


def test_both_role_without_sidecar_and_with_a_cpu_tier_uses_multiconnector():
    plan = build_plan(options(pd_role="both", cpu_offload_bytes=16 * GIB), GPU)
    transfer = json.loads(plan.argv[plan.argv.index("--kv-transfer-config") + 1])
    assert transfer == {
        "kv_connector": "MultiConnector", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"connectors": [
            {"kv_connector": "NixlConnector", "kv_role": "kv_both"},
            {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
             "kv_connector_extra_config": {"cpu_bytes_to_use": 16 * GIB, "eviction_policy": "lru",
                                           "self_describing_kv_events": True}},
        ]},
    }
    assert plan.pd_sidecar_argv is None


def test_without_a_role_nothing_changes():
    plan = build_plan(options(), GPU)
    assert "--kv-transfer-config" not in plan.argv and "VLLM_NIXL_SIDE_CHANNEL_HOST" not in plan.env
    assert not plan.render().startswith("# P/D")


@pytest.mark.parametrize("kw, host, message", [
    ({"pd_role": "decode"}, GPU, "a decode replica needs --pd-sidecar-port"),
    ({"pd_role": "prefill", "pd_sidecar_port": 9000}, GPU, "a prefill replica runs no sidecar"),
    ({"pd_sidecar_port": 9000}, GPU, "--pd-sidecar-port needs --pd-role decode or both"),
    ({"pd_role": "prefill"}, CPU, "does not run on the CPU platform"),
    ({"pd_role": "mixed"}, GPU, "--pd-role must be one of prefill, decode, both"),
    ({"pd_role": "prefill", "kv_connector": "lmcache"}, GPU, "--kv-connector must be one of nixl"),
    ({"pd_role": "decode", "pd_sidecar_port": 8000}, GPU, "P/D ports must all differ"),
    ({"pd_role": "prefill", "nixl_side_channel_port": 5557}, GPU, "P/D ports must all differ"),
    ({"pd_role": "prefill", "pod_ip": None}, GPU, "NIXL's side channel needs the pod's IP"),
])
def test_impossible_combinations_are_refused(kw, host, message):
    with pytest.raises(LaunchError) as info:
        build_plan(LaunchOptions(**{"model": "/m", "python": "/py", "pod_ip": "10.0.0.7", **kw}), host)
    assert any(message in problem for problem in info.value.problems), info.value.problems


def test_cli_dry_run_shows_the_transfer_config_and_the_sidecar(capsys):
    rc = cli.main(["--model", "/m", "--python", "/py", "--pod-ip", "10.0.0.9", "--platform", "gpu", "--port", "8001",
                   "--pd-role", "decode", "--pd-sidecar-port", "8000", "--dry-run"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "--kv-transfer-config " + "'" + NIXL + "'" in out
    assert "export VLLM_NIXL_SIDE_CHANNEL_HOST=10.0.0.9" in out
    assert "epp engine pd-sidecar --port 8000 --vllm-port 8001 --connector nixl" in out
    assert cli.main(["--model", "/m", "--python", "/py", "--pod-ip", "10.0.0.9", "--platform", "gpu",
                     "--pd-role", "decode", "--dry-run"]) == 2
    assert "needs --pd-sidecar-port" in capsys.readouterr().err
