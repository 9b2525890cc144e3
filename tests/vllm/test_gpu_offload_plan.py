"""The GPU validation script's dry run builds both replicas' commands through the launcher."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "gpu_offload_validation.py"


def _bench_module():
    spec = importlib.util.spec_from_file_location("gpu_offload_validation", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_dry_run_prints_offload_and_plain_replica_commands(capsys):
    bench = _bench_module()
    assert bench.main(["--dry-run", "--python", "/gpu/venv/bin/python"]) == 0
    out = capsys.readouterr().out
    offload, plain = out.split("# replica without offload")
    assert '"spec_name":"TieringOffloadingSpec"' in offload and "--load-format dummy" in offload
    assert "--kv-transfer-config" not in plain and "--kv-cache-memory-bytes 9663676416" in plain
    assert "prompt 65536 tokens = 8.00 GiB of KV" in out
    assert "3 filler prompts push P1 from CPU to disk" in out


def test_result_table_reports_speedups_against_the_seeds():
    bench = _bench_module()
    args = bench.parse_args([])
    settings = bench.Settings(args.python, args.shape, args.prompt_tokens, args.gpu_kv_gib, args.cpu_gib,
                              args.disk_gib, Path("/d"), args.block_size, args.conversations, args.turns,
                              args.context_tokens, args.turn_tokens, args.output_tokens,
                              args.throughput_seconds, args.deadline, args.enforce_eager)
    text = bench.table({"ttft": {"cold_s": 4.0, "cpu_s": 0.5, "disk_s": None},
                        "throughput_offload": {"tokens_per_s": 300.0},
                        "throughput_no_offload": {"tokens_per_s": 200.0}}, settings)
    assert "| TTFT from CPU tier | 0.500 s | 8.000x | 12.8x |" in text
    assert "| TTFT from disk tier | n/a | n/a | |" in text
    assert "| 1.500x | 1.85x |" in text


def test_pd_dry_run_prints_a_nixl_prefiller_and_a_decoder_behind_the_sidecar(capsys):
    bench = _bench_module()
    assert bench.main(["--dry-run", "--python", "/gpu/venv/bin/python", "--phases", "pd"]) == 0
    out = capsys.readouterr().out
    assert "# replica with offload" not in out
    prefill, decode = out.split("# P/D decode replica")
    for part in (prefill, decode):
        assert '"kv_connector":"NixlConnector"' in part and "--gpu-memory-utilization 0.4" in part
        assert "VLLM_NIXL_SIDE_CHANNEL_HOST=127.0.0.1" in part
    assert "VLLM_NIXL_SIDE_CHANNEL_PORT=5600" in prefill and "VLLM_NIXL_SIDE_CHANNEL_PORT=5601" in decode
    assert "epp engine pd-sidecar --port 8200 --vllm-port 8201" in decode and "pd-sidecar" not in prefill
    assert bench.main(["--dry-run", "--phases", "pd,gpus"]) == 2


def test_pd_table_reports_correctness_and_ttft():
    bench = _bench_module()
    text = bench.pd_table({"output_matches": True, "decoder_computed_tokens": 1.0,
                           "disaggregated_ttft_s": [0.3, 0.2, 0.4], "local_ttft_s": [0.5, 0.6, 0.7]})
    assert "| greedy output, P/D = prefiller alone | True |" in text
    assert "| TTFT median, disaggregated (prefill on the prefiller) | 0.300 s |" in text
    assert "| TTFT median, prefilled on the decoder | 0.600 s |" in text


def test_check_names_what_a_machine_without_a_gpu_lacks_and_fails(capsys, tmp_path):
    bench = _bench_module()
    assert bench.main(["--check", "--python", sys.executable, "--disk-path", str(tmp_path)]) == 2
    out = capsys.readouterr().out
    assert "MISSING  GPU visible to torch" in out
    assert "MISSING  CUDA build of vLLM >= 0.32" in out


def test_a_real_run_stops_at_the_preflight_before_starting_anything(capsys, tmp_path):
    bench = _bench_module()
    assert bench.main(["--python", "/nonexistent/python", "--disk-path", str(tmp_path)]) == 2
    captured = capsys.readouterr()
    assert "cannot run the validation" in captured.err
    assert "startup_s" not in captured.out
