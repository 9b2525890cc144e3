"""GPU validation of KV offload tiers (issue 7): TTFT cold / from CPU / from disk, and multi-turn throughput.

For a machine with one NVIDIA GPU and a CUDA build of vLLM (>= 0.32, TieringOffloadingSpec with
an `fs` tier). Everything is local: the model is a random-weight Llama-3.1-8B-shaped config
(`--load-format dummy`: vLLM initialises random weights, so nothing is downloaded or written
but a config and a small tokenizer); prompts are token ids.

Phases (one replica each, started by our launcher, `epp.engine.vllm.launcher`):
1. offload replica: GPU KV capped at --gpu-kv-gib (about one long prompt), CPU tier, disk tier.
   - cold: TTFT of prompt P1 (~64K tokens), computed from scratch;
   - CPU: send P2 (evicts P1 from the GPU cache; P1 stays in the CPU tier), then P1 again;
   - disk: send P3..Pn until P1 has left the CPU tier (LRU), then P1 again (found on disk).
   Every TTFT is the time to the first streamed token of a 1-token completion.
2. multi-turn throughput: N conversations x T turns (a long shared-per-conversation context,
   growing each turn), all conversations in flight, once on the offload replica and once on a
   replica without offload but the same GPU KV cap: output tokens/s each.
Compared with the seeds' figures: 12.8x faster TTFT from the CPU tier at ~65K tokens, 1.85x
tokens/s with offload. The table goes to stdout and, with --note, into a dated note under bench/notes/.
3. P/D (`--phases pd`, or `offload,pd`): two vLLM processes on the one GPU, a prefiller and a
   decoder, both with vLLM's NixlConnector (launcher `--pd-role`, each a share of GPU memory), and
   `epp engine pd-sidecar` in front of the decoder (needs this repo importable: `pip install -e .`).
   - correctness: a greedy completion through the sidecar with `x-prefiller-host-port` (prefill on
     the prefiller, KV over NIXL, decode on the decoder) equals the same completion computed
     entirely on the prefiller;
   - the decoder computed almost none of those prompts itself (`vllm:request_prefill_kv_computed_tokens`);
   - TTFT of fresh --pd-prompt-tokens prompts, disaggregated vs prefilled on the decoder itself.

`--dry-run` prints the plan and the exact vLLM commands, starting nothing (runs anywhere).
`--check` runs only the preflight (GPU, a CUDA build of vLLM >= 0.32 in --python, disk and memory for
the tiers) and says what is missing; a real run starts with the same preflight and stops (exit 2)
before starting anything when it fails.
Budget: under 8 minutes on an H200 (two server starts ~1.5 min each, ~20 long prefills, two
throughput runs of --throughput-seconds at most); a global deadline stops what is left.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
GIB = 1 << 30
SEED_TTFT_SPEEDUP_CPU = 12.8
SEED_THROUGHPUT_GAIN = 1.85

# Llama-3.1-8B shape: 128 KiB of KV per token in bf16 (2 x 32 layers x 8 KV heads x 128 x 2 B).
MODEL_SHAPES = {
    "llama-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=128256),
    "llama-3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
                     num_key_value_heads=8, head_dim=128, vocab_size=128256),
}


def _bare_checkout_imports() -> None:
    """Map this checkout's folders onto the `epp` namespace (as the install does) when it is not installed.

    A GPU machine may hold only its CUDA vLLM and this checkout: the launcher and the tiny-model
    writer use nothing outside the standard library, so they run from the tree itself.
    """
    if importlib.util.find_spec("epp") is not None:
        return
    for name, folder in (("epp", "epp"), ("epp.engine", "engine")):
        spec = importlib.util.spec_from_file_location(name, REPO / folder / "__init__.py",
                                                      submodule_search_locations=[str(REPO / folder)])
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)


_bare_checkout_imports()
launcher = importlib.import_module("epp.engine.vllm.launcher")


def kv_bytes_per_token(shape: dict) -> int:
    """bf16 K and V for every layer and KV head."""
    return 2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * shape["head_dim"] * 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_model_dir(dest: Path, shape_name: str, max_len: int) -> Path:
    """config.json of the realistic shape + the tiny model's tokenizer (ids are sent directly anyway)."""
    dest.mkdir(parents=True, exist_ok=True)
    try:
        tinymodel = importlib.import_module("epp.engine.tinymodel")
        tinymodel.write_tiny_model(dest, weights=False)
    except ImportError as exc:  # tokenizers missing: vLLM can run with --skip-tokenizer-init
        print(f"no tokenizer written ({exc}); using --skip-tokenizer-init")
    shape = MODEL_SHAPES[shape_name]
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", **shape,
        "hidden_act": "silu", "max_position_embeddings": max(131072, max_len), "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "bos_token_id": 0, "eos_token_id": 1, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    (dest / "config.json").write_text(json.dumps(config, indent=1))
    return dest


@dataclass
class Settings:
    """Everything the run depends on, from the command line."""

    python: str
    shape: str
    prompt_tokens: int
    gpu_kv_gib: float
    cpu_gib: float
    disk_gib: float
    disk_path: Path
    block_size: int
    conversations: int
    turns: int
    context_tokens: int
    turn_tokens: int
    output_tokens: int
    throughput_seconds: float
    deadline_s: float
    enforce_eager: bool
    phases: tuple[str, ...] = ("offload",)
    pd_prompt_tokens: int = 8192
    pd_requests: int = 6
    pd_gpu_share: float = 0.4

    @property
    def prompt_gib(self) -> float:
        return self.prompt_tokens * kv_bytes_per_token(MODEL_SHAPES[self.shape]) / GIB

    @property
    def disk_fill_prompts(self) -> int:
        """Distinct long prompts that push P1 out of the CPU tier (LRU) after P2."""
        return int(self.cpu_gib // self.prompt_gib) + 1


def dummy_weights_args(model_dir: Path, max_num_seqs: int, has_tokenizer: bool | None) -> tuple[str, ...]:
    """vLLM flags of a replica with dummy weights; no tokenizer init where `model_dir` has none (None: look)."""
    if has_tokenizer is None:
        has_tokenizer = (model_dir / "tokenizer.json").exists()
    args = ("--load-format", "dummy", "--max-num-seqs", str(max_num_seqs), "--seed", "0")
    return args if has_tokenizer else (*args, "--skip-tokenizer-init")


def launch_options(s: Settings, model_dir: Path, port: int, events_port: int, offload: bool,
                   has_tokenizer: bool | None = None):
    """Launcher options of one replica of the run."""
    return launcher.LaunchOptions(
        model=str(model_dir), served_model_name="bench", python=s.python, host="127.0.0.1", port=port,
        block_size=s.block_size, max_model_len=s.prompt_tokens + 1024, dtype="bfloat16",
        enforce_eager=s.enforce_eager, kv_cache_bytes=int(s.gpu_kv_gib * GIB),
        cpu_offload_bytes=int(s.cpu_gib * GIB) if offload else None,
        disk_path=str(s.disk_path) if offload else None,
        disk_bytes=int(s.disk_gib * GIB) if offload else None,
        kv_events_port=events_port, kv_replay_port=None,
        extra_args=dummy_weights_args(model_dir, max(s.conversations, 8), has_tokenizer),
    )


def plan_for(opts, assume_h200_host: bool = False) -> launcher.LaunchPlan:
    """The launcher's plan on this host (or, for a dry run elsewhere, on the H200 box: 128 GiB RAM)."""
    host = launcher.host_resources("gpu")
    mem = 128 * GIB if assume_h200_host else host.mem_available_bytes
    return launcher.build_plan(opts, launcher.HostResources(mem, host.disk_free_bytes, "gpu"))


def pd_launch_options(s: Settings, model_dir: Path, role: str, port: int, events_port: int, side_port: int,
                      sidecar_port: int | None = None, has_tokenizer: bool | None = None):
    """Launcher options of the P/D run's prefiller or decoder (one GPU shared by both)."""
    return launcher.LaunchOptions(
        model=str(model_dir), served_model_name="bench", python=s.python, host="127.0.0.1", port=port,
        block_size=s.block_size, max_model_len=s.pd_prompt_tokens + 1024, dtype="bfloat16",
        enforce_eager=s.enforce_eager, gpu_memory_utilization=s.pd_gpu_share, kv_events_port=events_port,
        kv_replay_port=None, pd_role=role, nixl_side_channel_port=side_port, pd_sidecar_port=sidecar_port,
        extra_args=dummy_weights_args(model_dir, 16, has_tokenizer),
    )


class Server:
    """A vLLM process group with its log; stopped as a group."""

    def __init__(self, plan, log: Path, port: int):
        env = dict(os.environ)
        env.update(plan.env)
        self.url = f"http://127.0.0.1:{port}"
        self.log = log
        self._fh = open(log, "ab")
        self.proc = subprocess.Popen(plan.argv, env=env, stdout=self._fh, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def wait_healthy(self, timeout_s: float) -> float:
        start = time.monotonic()
        while time.monotonic() - start < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited ({self.proc.returncode}):\n{self.log.read_text()[-4000:]}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return time.monotonic() - start
            except OSError:
                pass
            time.sleep(1)
        raise TimeoutError(f"vLLM not healthy in {timeout_s:.0f} s:\n{self.log.read_text()[-4000:]}")

    def metrics(self) -> str:
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            return r.read().decode()

    def stop(self) -> None:
        for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(wait)
                break
            except subprocess.TimeoutExpired:
                continue
        self._fh.close()


def prompt_ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 2000) for _ in range(n)]


async def ttft(session, url: str, ids: list[int]) -> float:
    """Seconds to the first streamed token of a 1-token completion."""
    body = {"model": "bench", "prompt": ids, "max_tokens": 1, "stream": True, "temperature": 0.0}
    start = time.perf_counter()
    async with session.post(url + "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.content:
            if line.startswith(b"data: ") and not line.startswith(b"data: [DONE]"):
                elapsed = time.perf_counter() - start
                async for _ in resp.content:
                    pass
                return elapsed
    raise RuntimeError("no token streamed")


def counter(metrics: str, name: str) -> float:
    """Sum of a counter's samples in Prometheus text (0 when absent)."""
    total = 0.0
    for line in metrics.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def measured(session, server: Server, ids: list[int], label: str) -> dict:
    """TTFT of `ids` and where its prompt tokens came from (GPU prefix hits, connector hits)."""
    names = {"gpu_hit_tokens": "vllm:prefix_cache_hits_total",
             "external_hit_tokens": "vllm:external_prefix_cache_hits_total"}
    before = server.metrics()
    elapsed = await ttft(session, server.url, ids)
    after = server.metrics()
    out = {f"{label}_s": elapsed}
    for key, name in names.items():
        out[f"{label}_{key}"] = counter(after, name) - counter(before, name)
    return out


async def ttft_phase(s: Settings, server: Server, deadline: float) -> dict:
    """Cold, CPU-tier and disk-tier TTFT of one ~64K-token prompt."""
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=600)
    out: dict = {}
    async with aiohttp.ClientSession(timeout=timeout) as session:
        p1 = prompt_ids(1, s.prompt_tokens)
        await ttft(session, server.url, prompt_ids(99, 512))  # warm-up (kernels, allocator)
        out["cold_s"] = await ttft(session, server.url, p1)
        await ttft(session, server.url, prompt_ids(2, s.prompt_tokens))  # evicts P1 from the GPU
        await asyncio.sleep(1.0)  # let the offload stores of P1/P2 complete
        out.update(await measured(session, server, p1, "cpu"))
        for i in range(s.disk_fill_prompts):
            if time.monotonic() > deadline:
                out["disk_s"] = None
                return out
            await ttft(session, server.url, prompt_ids(10 + i, s.prompt_tokens))
        await asyncio.sleep(2.0)
        out.update(await measured(session, server, p1, "disk"))
        by_source = [line for line in server.metrics().splitlines()
                     if line.startswith("vllm:prompt_tokens_cached_by_source_total{")]
        out["cached_by_source"] = by_source
    return out


async def throughput_phase(s: Settings, server: Server) -> dict:
    """Output tokens/s of N multi-turn conversations run concurrently for a bounded time."""
    import aiohttp

    stop_at = time.monotonic() + s.throughput_seconds
    totals = {"output_tokens": 0, "requests": 0}

    async def conversation(session, c: int) -> None:
        history = prompt_ids(1000 + c, s.context_tokens)
        for t in range(s.turns):
            if time.monotonic() > stop_at:
                return
            history = history + prompt_ids(5000 + 100 * c + t, s.turn_tokens)
            body = {"model": "bench", "prompt": history, "max_tokens": s.output_tokens, "temperature": 0.0,
                    "ignore_eos": True}
            async with session.post(server.url + "/v1/completions", json=body) as resp:
                data = await resp.json()
            totals["output_tokens"] += data["usage"]["completion_tokens"]
            totals["requests"] += 1
            history = history + prompt_ids(9000 + 100 * c + t, s.output_tokens)  # the reply, as ids

    start = time.perf_counter()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as session:
        await asyncio.gather(*(conversation(session, c) for c in range(s.conversations)))
    elapsed = time.perf_counter() - start
    return {**totals, "seconds": elapsed, "tokens_per_s": totals["output_tokens"] / elapsed}


async def _completion(session, url: str, ids: list[int], headers: dict | None = None, max_tokens: int = 16):
    body = {"model": "bench", "prompt": ids, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    async with session.post(url + "/v1/completions", json=body, headers=headers or {}) as resp:
        resp.raise_for_status()
        return dict(resp.headers), await resp.json()


async def _ttft_via(session, url: str, ids: list[int], headers: dict | None = None) -> float:
    body = {"model": "bench", "prompt": ids, "max_tokens": 2, "stream": True, "temperature": 0.0}
    start = time.perf_counter()
    async with session.post(url + "/v1/completions", json=body, headers=headers or {}) as resp:
        resp.raise_for_status()
        elapsed = None
        async for line in resp.content:
            if elapsed is None and line.startswith(b"data: ") and not line.startswith(b"data: [DONE]"):
                elapsed = time.perf_counter() - start
    if elapsed is None:
        raise RuntimeError("no token streamed")
    return elapsed


async def pd_requests(s: Settings, prefiller: Server, decoder: Server, sidecar_url: str, prefiller_hp: str) -> dict:
    """Correctness, locally computed prompt tokens, and TTFT of the P/D pair."""
    import aiohttp

    header = {"x-prefiller-host-port": prefiller_hp}
    out: dict = {}
    computed = "vllm:request_prefill_kv_computed_tokens_sum"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        await _completion(session, prefiller.url, prompt_ids(98, 256))  # warm-up both engines
        await _completion(session, decoder.url, prompt_ids(99, 256))
        probe = prompt_ids(7, s.pd_prompt_tokens)
        before = counter(decoder.metrics(), computed)
        headers, split = await _completion(session, sidecar_url, probe, header)
        out["decoder_computed_tokens"] = counter(decoder.metrics(), computed) - before
        out["used_prefiller"] = headers.get("x-pd-prefiller")
        out["fallback"] = headers.get("x-pd-fallback")
        _, whole = await _completion(session, prefiller.url, probe)
        out["output_matches"] = split["choices"][0]["text"] == whole["choices"][0]["text"]
        out["disaggregated_ttft_s"] = [await _ttft_via(session, sidecar_url, prompt_ids(300 + i, s.pd_prompt_tokens),
                                                       header) for i in range(s.pd_requests)]
        out["local_ttft_s"] = [await _ttft_via(session, sidecar_url, prompt_ids(400 + i, s.pd_prompt_tokens))
                               for i in range(s.pd_requests)]
        out["nixl_metrics"] = [line for line in decoder.metrics().splitlines() if line.startswith("vllm:nixl")]
    return out


def pd_phase(s: Settings, model_dir: Path, workdir: Path, deadline: float) -> dict:
    """Prefiller + decoder on one GPU with NIXL, the sidecar in front of the decoder."""
    if importlib.util.find_spec("epp") is None:
        raise RuntimeError("the P/D phase runs `epp engine pd-sidecar`: pip install -e . first")
    p_port, p_events, p_side, d_port, d_events, d_side, sidecar_port = (free_port() for _ in range(7))
    servers = []
    sidecar = None
    try:
        for role, port, events, side, front in (("prefill", p_port, p_events, p_side, None),
                                                ("decode", d_port, d_events, d_side, sidecar_port)):
            plan = plan_for(pd_launch_options(s, model_dir, role, port, events, side, front))
            servers.append(Server(plan, workdir / f"vllm-{role}.log", port))
        started = {role: server.wait_healthy(max(60.0, deadline - time.monotonic() - 60))
                   for role, server in zip(("prefill", "decode"), servers)}
        log = open(workdir / "sidecar.log", "ab")
        sidecar = subprocess.Popen([sys.executable, "-m", "epp.engine.pd_sidecar", "--host", "127.0.0.1", "--port",
                                    str(sidecar_port), "--vllm-port", str(d_port)], stdout=log,
                                   stderr=subprocess.STDOUT, start_new_session=True)
        Server.wait_healthy(_Probe(f"http://127.0.0.1:{sidecar_port}", sidecar, workdir / "sidecar.log"), 30)
        out = asyncio.run(pd_requests(s, servers[0], servers[1], f"http://127.0.0.1:{sidecar_port}",
                                      f"127.0.0.1:{p_port}"))
        out["startup_s"] = started
        return out
    finally:
        if sidecar is not None:
            sidecar.terminate()
            sidecar.wait(10)
        for server in servers:
            server.stop()


@dataclass
class _Probe:
    """Just enough of a Server for `Server.wait_healthy` on the sidecar."""

    url: str
    proc: subprocess.Popen
    log: Path


def pd_table(pd: dict) -> str:
    """The P/D rows: correctness and TTFT, disaggregated vs local."""
    def median(values):
        return None if not values else sorted(values)[len(values) // 2]

    dis, loc = median(pd.get("disaggregated_ttft_s")), median(pd.get("local_ttft_s"))
    def fmt(x):
        return "n/a" if x is None else f"{x:.3f} s"

    return "\n".join([
        "| P/D measure | value |",
        "|---|---|",
        f"| greedy output, P/D = prefiller alone | {pd.get('output_matches', 'n/a')} |",
        f"| prompt tokens the decoder computed (P/D request) | {pd.get('decoder_computed_tokens', 'n/a')} |",
        f"| TTFT median, disaggregated (prefill on the prefiller) | {fmt(dis)} |",
        f"| TTFT median, prefilled on the decoder | {fmt(loc)} |",
    ])


def table(results: dict, s: Settings) -> str:
    t = results.get("ttft", {})
    cold, cpu, disk = t.get("cold_s"), t.get("cpu_s"), t.get("disk_s")
    with_off = results.get("throughput_offload", {}).get("tokens_per_s")
    without = results.get("throughput_no_offload", {}).get("tokens_per_s")

    def fmt(x, unit=""):
        return "n/a" if x is None else f"{x:.3f}{unit}"

    def ratio(a, b):
        return None if not a or not b else a / b

    rows = [
        "| measure | value | speed-up | seeds' figure |",
        "|---|---|---|---|",
        f"| TTFT cold, {s.prompt_tokens} tokens | {fmt(cold, ' s')} | 1.0x | |",
        f"| TTFT from CPU tier | {fmt(cpu, ' s')} | {fmt(ratio(cold, cpu), 'x')} | {SEED_TTFT_SPEEDUP_CPU}x |",
        f"| TTFT from disk tier | {fmt(disk, ' s')} | {fmt(ratio(cold, disk), 'x')} | |",
        f"| multi-turn output tok/s, no offload | {fmt(without)} | 1.0x | |",
        f"| multi-turn output tok/s, CPU+disk offload | {fmt(with_off)} | {fmt(ratio(with_off, without), 'x')} "
        f"| {SEED_THROUGHPUT_GAIN}x |",
    ]
    return "\n".join(rows)


MIN_VLLM = (0, 32)
# What --python reports about itself: one JSON line, whatever is missing.
_PROBE = r"""
import json, sys
out = {"python": sys.version.split()[0]}
try:
    import torch
    out.update(torch=torch.__version__, cuda=torch.version.cuda, gpus=torch.cuda.device_count())
    if out["gpus"]:
        out["gpu"] = torch.cuda.get_device_name(0)
        out["gpu_gib"] = torch.cuda.get_device_properties(0).total_memory / 2**30
except Exception as exc:
    out["torch_error"] = f"{type(exc).__name__}: {exc}"
try:
    import vllm
    out["vllm"] = vllm.__version__
except Exception as exc:
    out["vllm_error"] = f"{type(exc).__name__}: {exc}"
print(json.dumps(out))
"""


def _version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("+")[0].split(".")[:2] if part.isdigit())


def preflight(s: Settings) -> list[tuple[str, bool, str]]:
    """(check, passed, detail) for everything a real run needs, found without starting vLLM."""
    checks: list[tuple[str, bool, str]] = []
    try:
        probe = subprocess.run([s.python, "-c", _PROBE], capture_output=True, text=True, timeout=300)
        info = json.loads(probe.stdout.strip().splitlines()[-1]) if probe.stdout.strip() else {}
        if not info:
            info = {"torch_error": (probe.stderr.strip().splitlines() or ["no output"])[-1]}
    except (OSError, subprocess.TimeoutExpired, ValueError) as exc:
        info = {"torch_error": f"{s.python}: {exc}"}
    gpus = info.get("gpus", 0)
    checks.append(("GPU visible to torch", bool(gpus),
                   f"{gpus} x {info.get('gpu', '?')} ({info.get('gpu_gib', 0):.0f} GiB), torch {info.get('torch')}, "
                   f"CUDA {info.get('cuda')}" if "torch" in info else info.get("torch_error", "torch missing")))
    vllm_version = info.get("vllm")
    vllm_ok = vllm_version is not None and _version_tuple(vllm_version) >= MIN_VLLM and info.get("cuda") is not None
    checks.append((f"CUDA build of vLLM >= {'.'.join(map(str, MIN_VLLM))} in {s.python}", vllm_ok,
                   f"vllm {vllm_version}" if vllm_version else info.get("vllm_error", "vllm missing")))
    disk_root = s.disk_path if s.disk_path.exists() else Path(tempfile.gettempdir())
    free = shutil.disk_usage(disk_root).free / GIB
    checks.append((f"{s.disk_gib:.0f} GiB free for the disk tier", free >= s.disk_gib, f"{free:.0f} GiB free at {disk_root}"))
    try:
        available = int(Path("/proc/meminfo").read_text().split("MemAvailable:")[1].split()[0]) / 2**20
    except (OSError, IndexError, ValueError):
        available = float("nan")
    checks.append((f"{s.cpu_gib:.0f} GiB of host memory for the CPU tier", not available < s.cpu_gib + 4,
                   f"{available:.0f} GiB available"))
    return checks


def print_preflight(checks: list[tuple[str, bool, str]]) -> bool:
    """Print the preflight as a table; True when every check passed."""
    for name, passed, detail in checks:
        print(f"{'ok  ' if passed else 'MISSING'}  {name}: {detail}")
    return all(passed for _, passed, _ in checks)


def print_plan(s: Settings) -> None:
    model_dir = Path("<workdir>/model")
    print(__doc__.split("\n\n")[0])
    print(f"model: {s.shape} random weights, {kv_bytes_per_token(MODEL_SHAPES[s.shape])} B of KV per token; "
          f"prompt {s.prompt_tokens} tokens = {s.prompt_gib:.2f} GiB of KV")
    print(f"GPU KV cap {s.gpu_kv_gib} GiB, CPU tier {s.cpu_gib} GiB, disk tier {s.disk_gib} GiB at {s.disk_path}; "
          f"{s.disk_fill_prompts} filler prompts push P1 from CPU to disk")
    print(f"multi-turn: {s.conversations} conversations x {s.turns} turns, context {s.context_tokens}, "
          f"+{s.turn_tokens} per turn, {s.output_tokens} output tokens, at most {s.throughput_seconds} s per run")
    if "offload" in s.phases:
        for offload in (True, False):
            plan = plan_for(launch_options(s, model_dir, 8000, 5557, offload, True), assume_h200_host=True)
            print(f"\n# replica {'with' if offload else 'without'} offload")
            print(plan.render())
    if "pd" in s.phases:
        print(f"\nP/D: prefiller and decoder on one GPU, {s.pd_gpu_share} of its memory each, "
              f"{s.pd_requests} prompts of {s.pd_prompt_tokens} tokens each way")
        for role, port, events, side, front in (("prefill", 8100, 5560, 5600, None),
                                                ("decode", 8201, 5561, 5601, 8200)):
            plan = plan_for(pd_launch_options(s, model_dir, role, port, events, side, front, True),
                            assume_h200_host=True)
            print(f"\n# P/D {role} replica")
            print(plan.render())


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--python", default=sys.executable, help="python with a CUDA build of vLLM")
    p.add_argument("--shape", choices=sorted(MODEL_SHAPES), default="llama-8b")
    p.add_argument("--prompt-tokens", type=int, default=65536)
    p.add_argument("--gpu-kv-gib", type=float, default=9.0, help="GPU KV cap: a bit more than one long prompt")
    p.add_argument("--cpu-gib", type=float, default=18.0, help="CPU tier: more than two long prompts")
    p.add_argument("--disk-gib", type=float, default=44.0,
                   help="disk tier budget; the run writes about (3 + fillers) prompts of KV there")
    p.add_argument("--disk-path", type=Path, default=None, help="disk tier root (default: a temp dir)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--conversations", type=int, default=32)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--context-tokens", type=int, default=8192)
    p.add_argument("--turn-tokens", type=int, default=256)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--throughput-seconds", type=float, default=75.0)
    p.add_argument("--deadline", type=float, default=470.0, help="seconds for the whole run")
    p.add_argument("--enforce-eager", action="store_true", help="skip CUDA graph capture (faster start)")
    p.add_argument("--phases", default="offload",
                   help="comma list: offload (TTFT from tiers, multi-turn), pd (prefill/decode with NIXL)")
    p.add_argument("--pd-prompt-tokens", type=int, default=8192, help="P/D run: prompt length")
    p.add_argument("--pd-requests", type=int, default=6, help="P/D run: prompts timed each way")
    p.add_argument("--pd-gpu-share", type=float, default=0.4, help="P/D run: GPU memory share of each process")
    p.add_argument("--out", type=Path, default=None, help="write results JSON here")
    p.add_argument("--note", action="store_true",
                   help="write the table and the results into bench/notes/<date>-gpu-offload.md")
    p.add_argument("--dry-run", action="store_true", help="print the plan and commands, start nothing")
    p.add_argument("--check", action="store_true", help="run only the preflight: what this machine lacks for a run")
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="gpu-offload-"))
    s = Settings(a.python, a.shape, a.prompt_tokens, a.gpu_kv_gib, a.cpu_gib, a.disk_gib,
                 a.disk_path or workdir / "kv-disk", a.block_size, a.conversations, a.turns, a.context_tokens,
                 a.turn_tokens, a.output_tokens, a.throughput_seconds, a.deadline, a.enforce_eager,
                 tuple(p.strip() for p in a.phases.split(",")), a.pd_prompt_tokens, a.pd_requests, a.pd_gpu_share)
    unknown = [p for p in s.phases if p not in ("offload", "pd")]
    if unknown:
        print(f"--phases: unknown {unknown}; use offload and/or pd", file=sys.stderr)
        return 2
    if a.dry_run:
        print_plan(s)
        shutil.rmtree(workdir, ignore_errors=True)
        return 0
    ready = print_preflight(preflight(s))
    if a.check or not ready:
        shutil.rmtree(workdir, ignore_errors=True)
        if not ready:
            print("gpu_offload_validation: this machine cannot run the validation (see MISSING above)", file=sys.stderr)
        return 0 if ready else 2
    t0 = time.monotonic()
    deadline = t0 + s.deadline_s
    model_dir = write_model_dir(workdir / "model", s.shape, s.prompt_tokens + 1024)
    results: dict = {"settings": {k: str(v) for k, v in vars(s).items()}}
    try:
        for offload in ((True, False) if "offload" in s.phases else ()):
            if time.monotonic() > deadline - 60:
                results["stopped"] = "deadline"
                break
            port = free_port()
            plan = plan_for(launch_options(s, model_dir, port, free_port(), offload))
            server = Server(plan, workdir / f"vllm-{'offload' if offload else 'plain'}.log", port)
            try:
                results[f"startup_s_{'offload' if offload else 'no_offload'}"] = server.wait_healthy(
                    max(60.0, deadline - time.monotonic() - 60))
                if offload:
                    results["ttft"] = asyncio.run(ttft_phase(s, server, deadline - 120))
                    results["throughput_offload"] = asyncio.run(throughput_phase(s, server))
                else:
                    results["throughput_no_offload"] = asyncio.run(throughput_phase(s, server))
            finally:
                server.stop()
        if "pd" in s.phases and time.monotonic() < deadline - 120:
            results["pd"] = pd_phase(s, model_dir, workdir, deadline)
    finally:
        results["total_s"] = time.monotonic() - t0
        text = table(results, s) if "offload" in s.phases else ""
        if "pd" in results:
            text = (text + "\n\n" if text else "") + pd_table(results["pd"])
        print(text)
        print(json.dumps(results, indent=1, default=str))
        if a.out:
            a.out.write_text(json.dumps(results, indent=1, default=str))
        if a.note:
            note = REPO / "bench" / "notes" / f"{time.strftime('%Y-%m-%d')}-gpu-offload.md"
            note.write_text(f"# GPU offload validation ({time.strftime('%Y-%m-%d')})\n\n"
                            f"`python bench/gpu_offload_validation.py {' '.join(argv or sys.argv[1:])}`\n\n{text}\n\n"
                            f"```json\n{json.dumps(results, indent=1, default=str)}\n```\n")
            print(f"wrote {note}; add its standing row in bench/standing.py")
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
