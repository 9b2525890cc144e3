"""The launcher's exact vLLM command per option set, and its refusals before anything starts."""

from __future__ import annotations

import json

import pytest

from epp.engine.vllm import cli
from epp.engine.vllm.launcher import (
    HostResources,
    LaunchError,
    LaunchOptions,
    build_plan,
    parse_size,
)

GIB = 1 << 30
BIG_GPU_HOST = HostResources(mem_available_bytes=256 * GIB, disk_free_bytes=lambda p: 2048 * GIB, platform="gpu")
CPU_HOST = HostResources(mem_available_bytes=16 * GIB, disk_free_bytes=lambda p: 100 * GIB, platform="cpu")


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_gpu_replica_without_offload_has_prefix_caching_events_and_hash_seed():
    opts = LaunchOptions(model="/models/llama", served_model_name="llama", python="/venv/bin/python",
                         pod_ip="10.0.0.7", port=8000, block_size=16)
    plan = build_plan(opts, BIG_GPU_HOST)
    assert plan.argv == [
        "/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server",
        "--model", "/models/llama", "--served-model-name", "llama",
        "--host", "0.0.0.0", "--port", "8000", "--block-size", "16",
        "--enable-prefix-caching", "--prefix-caching-hash-algo", "sha256",
        "--kv-events-config",
        '{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:5557",'
        '"topic":"kv@10.0.0.7:8000@llama","buffer_steps":10000,"replay_endpoint":"tcp://*:5558"}',
    ]
    assert plan.env == {"PYTHONHASHSEED": "0"}
    assert plan.topic == "kv@10.0.0.7:8000@llama"
    assert plan.disk_manager_argv is None


def test_gpu_replica_with_cpu_tier_uses_offloading_connector_with_self_describing_events():
    opts = LaunchOptions(model="/m", served_model_name="m", pod_ip="10.0.0.7", cpu_offload_bytes=32 * GIB,
                         offload_block_size=64, kv_cache_bytes=8 * GIB, hash_seed=42)
    plan = build_plan(opts, BIG_GPU_HOST)
    assert json.loads(_flag(plan.argv, "--kv-transfer-config")) == {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "cpu_bytes_to_use": 32 * GIB,
            "eviction_policy": "lru",
            "self_describing_kv_events": True,
            "block_size": 64,
        },
    }
    assert _flag(plan.argv, "--kv-cache-memory-bytes") == str(8 * GIB)
    assert plan.env == {"PYTHONHASHSEED": "42"}


def test_disk_tier_adds_tiering_spec_with_fs_tier_sleep_mode_and_a_disk_manager(tmp_path):
    disk = tmp_path / "kv-disk"
    opts = LaunchOptions(model="/m", served_model_name="m", pod_ip="10.1.2.3", port=8100,
                         cpu_offload_bytes=16 * GIB, disk_path=str(disk), disk_bytes=100 * GIB,
                         sleep_mode=True, extra_args=("--max-num-seqs", "64"), disk_manager_events_port=5559)
    plan = build_plan(opts, BIG_GPU_HOST)
    transfer = json.loads(_flag(plan.argv, "--kv-transfer-config"))
    assert transfer["kv_connector_extra_config"] == {
        "cpu_bytes_to_use": 16 * GIB,
        "eviction_policy": "lru",
        "self_describing_kv_events": True,
        "spec_name": "TieringOffloadingSpec",
        "secondary_tiers": [{"type": "fs", "root_dir": str(disk), "enable_kv_events": True}],
    }
    assert "--enable-sleep-mode" in plan.argv
    assert plan.argv[-2:] == ["--max-num-seqs", "64"]
    assert plan.env == {"PYTHONHASHSEED": "0", "VLLM_SERVER_DEV_MODE": "1"}
    assert plan.disk_manager_argv == [
        "epp", "engine", "disk-manager", "--root", str(disk), "--budget-bytes", str(100 * GIB),
        "--topic", "kv@10.1.2.3:8100@m",
        "--vllm-events-endpoint", "tcp://127.0.0.1:5557", "--vllm-replay-endpoint", "tcp://127.0.0.1:5558",
        "--events-endpoint", "tcp://*:5559",
    ]


def test_cpu_platform_replica_sets_cpu_kv_space_and_thread_binding():
    opts = LaunchOptions(model="/tiny", served_model_name="tiny", host="127.0.0.1", port=9000,
                         block_size=32, dtype="bfloat16", max_model_len=1024, enforce_eager=True,
                         kv_cache_bytes=2 * GIB, num_gpu_blocks_override=48, kv_events_port=9001,
                         kv_replay_port=9002)
    plan = build_plan(opts, CPU_HOST)
    assert plan.argv[3:] == [
        "--model", "/tiny", "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", "9000",
        "--block-size", "32", "--enable-prefix-caching", "--prefix-caching-hash-algo", "sha256",
        "--dtype", "bfloat16", "--max-model-len", "1024", "--enforce-eager",
        "--num-gpu-blocks-override", "48",
        "--kv-events-config",
        '{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:9001",'
        '"topic":"kv@127.0.0.1:9000@tiny","buffer_steps":10000,"replay_endpoint":"tcp://*:9002"}',
    ]
    assert plan.env == {"PYTHONHASHSEED": "0", "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}


def _problems(opts: LaunchOptions, host: HostResources) -> list[str]:
    with pytest.raises(LaunchError) as info:
        build_plan(opts, host)
    return info.value.problems


def test_disk_tier_without_cpu_tier_is_refused(tmp_path):
    problems = _problems(LaunchOptions(model="/m", pod_ip="1.2.3.4", disk_path=str(tmp_path), disk_bytes=GIB),
                         BIG_GPU_HOST)
    assert any("disk tier needs a CPU tier" in p for p in problems)


def test_disk_budget_larger_than_free_space_is_refused(tmp_path):
    host = HostResources(256 * GIB, lambda p: 10 * GIB, "gpu")
    opts = LaunchOptions(model="/m", pod_ip="1.2.3.4", cpu_offload_bytes=GIB, disk_path=str(tmp_path),
                         disk_bytes=20 * GIB)
    assert any("does not fit on" in p and str(10 * GIB) in p for p in _problems(opts, host))


def test_disk_budget_is_checked_against_the_real_filesystem(tmp_path):
    from epp.engine.vllm.launcher import host_resources

    real = host_resources("gpu")
    opts = LaunchOptions(model="/m", pod_ip="1.2.3.4", cpu_offload_bytes=GIB,
                         disk_path=str(tmp_path / "not-yet-created"), disk_bytes=1 << 60)
    assert any("does not fit on" in p for p in _problems(opts, real))


def test_cpu_tier_larger_than_ram_is_refused():
    host = HostResources(64 * GIB, lambda p: GIB, "gpu")
    problems = _problems(LaunchOptions(model="/m", pod_ip="1.2.3.4", cpu_offload_bytes=60 * GIB), host)
    assert any("does not fit in RAM" in p for p in problems)


def test_block_size_not_multiple_of_32_is_refused_on_cpu_but_not_on_gpu():
    opts = LaunchOptions(model="/m", host="127.0.0.1", block_size=16)
    assert any("refused by the CPU platform" in p for p in _problems(opts, CPU_HOST))
    build_plan(opts, BIG_GPU_HOST)


def test_offload_on_cpu_platform_needs_force():
    opts = LaunchOptions(model="/m", host="127.0.0.1", cpu_offload_bytes=GIB)
    assert any("needs a GPU" in p for p in _problems(opts, CPU_HOST))
    forced = build_plan(LaunchOptions(model="/m", host="127.0.0.1", cpu_offload_bytes=GIB, force=True), CPU_HOST)
    assert "--kv-transfer-config" in forced.argv


def test_sleep_mode_on_cpu_platform_is_refused():
    assert any("sleep mode" in p for p in _problems(LaunchOptions(model="/m", host="127.0.0.1", sleep_mode=True),
                                                    CPU_HOST))


def test_topic_needs_the_pod_ip_when_serving_on_all_interfaces():
    assert any("--pod-ip" in p for p in _problems(LaunchOptions(model="/m"), BIG_GPU_HOST))


def test_offload_chunk_must_be_a_multiple_of_the_block_size():
    opts = LaunchOptions(model="/m", pod_ip="1.2.3.4", cpu_offload_bytes=GIB, block_size=32, offload_block_size=48)
    assert any("multiple of --block-size 32" in p for p in _problems(opts, BIG_GPU_HOST))


def test_managed_flags_in_extra_args_and_clashing_ports_are_refused():
    opts = LaunchOptions(model="/m", pod_ip="1.2.3.4", port=5557, extra_args=("--kv-transfer-config={}",))
    problems = _problems(opts, BIG_GPU_HOST)
    assert any("ports must differ" in p for p in problems)
    assert any("--kv-transfer-config is set by the launcher" in p for p in problems)


def test_every_problem_is_reported_at_once(tmp_path):
    opts = LaunchOptions(model="/m", block_size=48, disk_path=str(tmp_path), disk_bytes=GIB)
    assert len(_problems(opts, CPU_HOST)) >= 3


@pytest.mark.parametrize("text,expected", [("4GiB", 4 * GIB), ("500MB", 500_000_000), ("1.5G", 1_500_000_000),
                                           ("1073741824", GIB), ("64 KiB", 65536)])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


def test_parse_size_rejects_garbage():
    with pytest.raises(ValueError):
        parse_size("lots")


def test_cli_dry_run_prints_command_and_environment(capsys, tmp_path):
    rc = cli.main(["--model", "/m", "--served-model-name", "m", "--python", "/py", "--pod-ip", "10.0.0.9",
                   "--platform", "gpu", "--cpu-offload-bytes", "1GiB", "--disk-path", str(tmp_path / "d"),
                   "--disk-bytes", "1MiB", "--dry-run", "--", "--max-num-seqs", "8"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "export PYTHONHASHSEED=0" in out
    assert "/py -m vllm.entrypoints.openai.api_server --model /m" in out
    assert "TieringOffloadingSpec" in out and "--max-num-seqs 8" in out
    assert "epp engine disk-manager --root" in out


def test_cli_refuses_invalid_options_with_exit_code_2(capsys, tmp_path):
    rc = cli.main(["--model", "/m", "--python", "/py", "--host", "127.0.0.1", "--platform", "cpu",
                   "--block-size", "16", "--disk-path", str(tmp_path), "--disk-bytes", "1GiB", "--dry-run"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "refused by the CPU platform" in err and "needs a CPU tier" in err


def test_cli_dry_run_for_a_gpu_pod_does_not_hold_it_to_this_machines_ram(capsys):
    # A 64 TiB CPU tier fits no machine this test runs on: the dry run previews another machine's command.
    gpu_pod = ["--model", "/m", "--python", "/py", "--pod-ip", "10.0.0.9", "--cpu-offload-bytes", "64TiB",
              "--dry-run"]
    assert cli.main([*gpu_pod, "--platform", "gpu"]) == 0
    assert "OffloadingConnector" in capsys.readouterr().out
    # Without a named platform the dry run is for this machine, and its RAM is the limit.
    assert cli.main(gpu_pod) == 2
    assert "does not fit in RAM" in capsys.readouterr().err
