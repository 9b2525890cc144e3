"""Latency profiles: how long a simulated engine step takes.

A step (one forward pass of the continuous batch) costs
``step_overhead + forward_base + decode_per_seq * decoding_seqs + prefill_per_token * prefill_tokens
+ load costs of blocks promoted from the CPU / disk tiers`` seconds of simulated time, plus
``prefill_overhead`` when the step prefills and ``prefill_per_context_token`` for each token
already in the KV cache before a prefill chunk (what the chunk's attention reads: a prefix hit
is not free). Both are 0 for the GPU profiles; the vLLM-CPU one is measured.

The ``h100-llama3-8b`` numbers are a roofline derivation from public datasheets, not a
measurement: Llama-3.1-8B in bf16 has 8.03 B parameters (16.1 GB of weights) and 128 KiB of KV
per token (32 layers x 8 KV heads x 128 dims x 2 (K,V) x 2 bytes); an H100 SXM has 989 TFLOPS of
dense bf16 and 3.35 TB/s of HBM3 (NVIDIA H100 datasheet). Prefill is compute bound:
2 x 8.03e9 FLOP per token at 50 % MFU -> 32 us/token. A decode step is bandwidth bound: reading
the weights at 80 % of peak bandwidth -> 6.0 ms, plus per sequence its KV (about 1k tokens of
context, 128 MiB, 0.05 ms) and its share of compute (0.03 ms) -> 0.08 ms per running sequence.
CPU-tier loads move 128 KiB/token over PCIe Gen5 x16 at an effective 25 GB/s -> 5.2 us/token;
disk-tier loads at an effective 5 GB/s of NVMe -> 26 us/token. The KV capacity follows from
(80 GB x 0.9 - 16.1 GB weights - ~2 GB activations) / (16 tokens x 128 KiB) ~ 26,000 blocks.
P/D KV transfers (NIXL over one 400 Gb/s RDMA NIC at an effective 40 GB/s) move 128 KiB/token in
3.3 us/token, plus about 1 ms per request for the handshake and completion notice.
Waking from sleep level 1 copies the weights back from pinned CPU memory over the same PCIe link
(16.1 GB at 25 GB/s -> 0.64 s) and re-allocates the KV cache: about 0.7 s, against tens of
seconds for a cold start.
They are estimates, not measurements (no GPU was available to calibrate them); replace them with
measured numbers (``LatencyProfile(...)``) when one is.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True, slots=True)
class LatencyProfile:
    """Per-step and per-token costs of one simulated replica, in seconds of simulated time."""

    name: str
    prefill_per_token: float
    forward_base: float
    decode_per_seq: float
    step_overhead: float
    cpu_load_per_token: float
    disk_load_per_token: float
    num_gpu_blocks: int
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 8192
    # P/D: moving prompt KV from a prefill replica (NIXL); not scaled with the GPU (it is the network).
    kv_transfer_base: float = 1.0e-3
    kv_transfer_per_token: float = 3.3e-6
    prefill_overhead: float = 0.0  # added to a step that prefills any tokens
    prefill_per_context_token: float = 0.0  # per token cached or computed before a prefill chunk

    def kv_transfer_time(self, tokens: int) -> float:
        """Seconds to receive `tokens` tokens of KV from a remote prefiller (0 when nothing moves)."""
        return self.kv_transfer_base + self.kv_transfer_per_token * tokens if tokens > 0 else 0.0
    # Seconds `/wake_up` takes to bring a level-1 sleeping engine back (weights CPU -> GPU).
    wake_seconds: float = 0.0

    def step_time(self, prefill_tokens: int, decoding_seqs: int, load_time: float = 0.0,
                  context_tokens: int = 0) -> float:
        """Duration of one forward pass with this much work (`context_tokens`: before its prefill chunks)."""
        if prefill_tokens == 0 and decoding_seqs == 0:
            return 0.0
        return (self.step_overhead + self.forward_base + self.decode_per_seq * decoding_seqs
                + self.prefill_per_token * prefill_tokens + load_time
                + (self.prefill_overhead + self.prefill_per_context_token * context_tokens if prefill_tokens else 0.0))

    def scaled(self, factor: float) -> LatencyProfile:
        """The same profile with every time multiplied by `factor` (a slower or faster GPU)."""
        return replace(
            self,
            name=f"{self.name}x{factor:g}",
            prefill_per_token=self.prefill_per_token * factor,
            forward_base=self.forward_base * factor,
            decode_per_seq=self.decode_per_seq * factor,
            step_overhead=self.step_overhead * factor,
            prefill_overhead=self.prefill_overhead * factor,
            prefill_per_context_token=self.prefill_per_context_token * factor,
            cpu_load_per_token=self.cpu_load_per_token * factor,
            disk_load_per_token=self.disk_load_per_token * factor,
        )


H100_LLAMA3_8B = LatencyProfile(
    name="h100-llama3-8b",
    prefill_per_token=32e-6,
    forward_base=6.0e-3,
    decode_per_seq=0.08e-3,
    step_overhead=0.5e-3,
    cpu_load_per_token=5.2e-6,
    disk_load_per_token=26e-6,
    num_gpu_blocks=26_000,
    block_size=16,
    max_num_seqs=256,
    max_num_batched_tokens=8192,
    max_model_len=8192,
    wake_seconds=0.7,
)

# Fast enough that a test request completes in milliseconds, still shaped like a GPU:
# prefill cost per uncached token, a per-step floor that grows with the batch, tier load costs.
FAST = LatencyProfile(
    name="fast",
    prefill_per_token=2e-6,
    forward_base=0.5e-3,
    decode_per_seq=0.01e-3,
    step_overhead=0.05e-3,
    cpu_load_per_token=0.5e-6,
    disk_load_per_token=1e-6,
    num_gpu_blocks=4096,
    block_size=16,
    max_num_seqs=256,
    max_num_batched_tokens=8192,
    max_model_len=8192,
    kv_transfer_base=0.2e-3,
    kv_transfer_per_token=0.5e-6,
    wake_seconds=0.05,
)

# Measured, not derived: 2 vllm-cpu 0.32 replicas serving the random-weight tiny Llama that
# bench/routing/real_vllm.py writes (hidden 512, 6 layers, 8 heads, bfloat16, block size 32, 64 KV
# blocks), each pinned to one core of this 2-core VM under a CFS quota of 0.85 core (bench/cgroups.py),
# timed through its HTTP API with unique prompts (run 1 of bench/notes/2026-12-real-vllm.md):
# 28 / 90 / 187 / 334 ms for 64 / 256 / 576 / 896 prompt tokens and one output token (least squares:
# 363 us a token; its intercept is below a decode step, so a prefill step costs the step plus its
# tokens), 11.6 ms a decode step alone and 10.3 ms beside three others (batching adds nothing
# measurable at this size). A prefix hit is not free on CPU: attention over the cached context adds
# about 30 us per cached token (fitted on run 1's round-robin hits; later runs measure it directly).
# Token budget and batch size are vllm-cpu's API-server defaults (2048, 128).
# tests/sim/test_vllm_timing_fidelity.py checks it against a recorded real run (within 15 %);
# `python -m bench.routing.real_vllm` prints each run's own fit beside it.
VLLM_CPU_TINY_H512 = LatencyProfile(
    name="vllm-cpu-tiny-h512",
    prefill_per_token=0.363e-3,
    forward_base=11.6e-3,
    decode_per_seq=0.0,
    step_overhead=0.0,
    cpu_load_per_token=0.0,
    disk_load_per_token=0.0,
    num_gpu_blocks=64,
    block_size=32,
    max_num_seqs=128,
    max_num_batched_tokens=2048,
    max_model_len=1536,
    prefill_per_context_token=30e-6,
)

PROFILES: dict[str, LatencyProfile] = {p.name: p for p in (H100_LLAMA3_8B, FAST, VLLM_CPU_TINY_H512)}


def get_profile(name: str) -> LatencyProfile:
    """A named profile; ``name*factor`` (e.g. ``fast*2``) scales it for heterogeneous fleets."""
    base, _, factor = name.partition("*")
    if base not in PROFILES:
        raise ValueError(f"unknown latency profile {base!r}; known: {sorted(PROFILES)}")
    profile = PROFILES[base]
    return profile.scaled(float(factor)) if factor else profile
