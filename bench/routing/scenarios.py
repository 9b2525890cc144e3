"""Named scenarios: a workload, a simulated fleet and a load schedule, at several scales.

Scales: `tiny` (the CI smoke run: seconds per contender), `small` (what a 2-core machine
sustains while every process of the stack shares it), `medium` (a bigger machine).
The simulated replicas use the `h100-llama3-8b` latency profile (a datasheet roofline of
Llama-3.1-8B on one H100, see engine/sim/profiles.py) slowed by `time_scale`, so the offered
rates in wall-clock requests/s stay within what the machine can drive; every latency in the
results is wall-clock (divide by `time_scale` for simulated-GPU seconds).
Cache sizing follows llm-d's "73-capacity" experiment: the groups' shared prefixes fill
about 73 % of the fleet's KV cache and several times one replica's.
The `trace` scenario replays a Mooncake or Bailian JSONL file (`--trace PATH`, bench/routing/traces.py)
at its own timestamps; its knobs (`TRACE_KNOBS`) shrink it to what the machine can drive.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from bench.routing.loadgen import Stage, ramp
from bench.routing.objectives import Objectives
from bench.routing.traces import TraceReplay
from bench.routing.workloads import (
    Agentic,
    MultiTurn,
    NoSharing,
    SharedPrefix,
    Workload,
)
from epp.engine.sim.fleet import FleetConfig

SCALES = ("tiny", "small", "medium")


@dataclass
class Scenario:
    """Everything one run needs besides the contenders."""

    name: str
    scale: str
    workload: Workload | TraceReplay
    fleet: FleetConfig
    stages: list[Stage]
    drain: float = 30.0
    request_timeout: float = 120.0
    notes: list[str] = field(default_factory=list)
    continuous: bool = False  # stages follow each other without draining (a continuous ramp)
    objectives: Objectives = field(default_factory=Objectives)  # latency objectives sent and measured (goodput)

    @property
    def capacity_blocks(self) -> int:
        """Usable KV blocks of the whole fleet (vLLM keeps one null block per replica)."""
        return self.fleet.replicas * ((self.fleet.num_gpu_blocks or 0) - 1)


def _fleet(scale: str, replicas: int, blocks: int, time_scale: float, **kw) -> FleetConfig:
    if scale == "tiny":
        # CI: the fast profile, replicas in the harness's own process (no worker start-up).
        return FleetConfig(replicas=replicas, profile="fast", num_gpu_blocks=blocks, processes=0, **kw)
    return FleetConfig(replicas=replicas, profile="h100-llama3-8b", num_gpu_blocks=blocks, time_scale=time_scale,
                       processes=2, **kw)


def shared_prefix(scale: str) -> Scenario:
    """llm-d's shared_prefix shape, shrunk: prefixes ~73 % of the fleet's cache, ~3x one replica's."""
    if scale == "tiny":
        w = SharedPrefix(groups=4, users=2, system_tokens=256, question_tokens=32, output_tokens=8)
        return Scenario("shared-prefix", scale, w, _fleet(scale, 2, 48, 1.0), [Stage(3.0, 4.0, "constant")],
                        drain=10.0, request_timeout=20.0)
    if scale == "small":
        w = SharedPrefix(groups=12, users=5, system_tokens=4096, question_tokens=512, output_tokens=32)
        replicas, ts = 4, 5.0
        blocks = int(w.shared_tokens() / 16 / 0.73 / replicas) + 1  # 73 % of the fleet, ~2.9x one replica
        return Scenario("shared-prefix", scale, w, _fleet(scale, replicas, blocks, ts),
                        [Stage(15.0, rate) for rate in (2.0, 4.0, 8.0, 12.0)], drain=30.0)
    w = SharedPrefix(groups=48, users=5, system_tokens=6000, question_tokens=1200, output_tokens=64)
    replicas, ts = 8, 2.0
    blocks = int(w.shared_tokens() / 16 / 0.73 / replicas) + 1
    return Scenario("shared-prefix", scale, w, _fleet(scale, replicas, blocks, ts, max_model_len=16384),
                    ramp(4.0, 24.0, 6, 60.0), drain=60.0)


def multi_turn(scale: str) -> Scenario:
    """Growing chats: each turn's history is the previous turn's prompt plus two messages."""
    if scale == "tiny":
        w = MultiTurn(sessions=4, active=2, turns=3, system_tokens=64, user_tokens=16, answer_tokens=16,
                      output_tokens=8)
        return Scenario("multi-turn", scale, w, _fleet(scale, 2, 64, 1.0), [Stage(3.0, 4.0, "constant")],
                        drain=10.0, request_timeout=20.0)
    w = MultiTurn(sessions=64, active=16, turns=8, system_tokens=1024, user_tokens=128, answer_tokens=256,
                  output_tokens=32)
    replicas, ts = 4, 5.0
    return Scenario("multi-turn", scale, w, _fleet(scale, replicas, 900, ts), ramp(2.0, 8.0, 4, 25.0), drain=40.0)


def agentic(scale: str) -> Scenario:
    """Long input, short output (the seeds' ~65K/0.5K agent traces, scaled to the simulator)."""
    if scale == "tiny":
        w = Agentic(agents=2, active=2, steps=3, context_tokens=256, tool_tokens=32, output_tokens=4)
        return Scenario("agentic", scale, w, _fleet(scale, 2, 96, 1.0), [Stage(3.0, 3.0, "constant")],
                        drain=10.0, request_timeout=20.0)
    w = Agentic(agents=16, active=8, steps=8, context_tokens=6144, tool_tokens=512, output_tokens=16)
    replicas, ts = 4, 5.0
    return Scenario("agentic", scale, w,
                    _fleet(scale, replicas, 1600, ts, max_model_len=16384, max_num_batched_tokens=8192),
                    ramp(1.0, 4.0, 4, 25.0), drain=40.0)


def no_sharing(scale: str) -> Scenario:
    """Unique prompts: the control where cache-aware routing has nothing to win."""
    if scale == "tiny":
        w = NoSharing(prompt_tokens=128, output_tokens=8)
        return Scenario("no-sharing", scale, w, _fleet(scale, 2, 64, 1.0), [Stage(3.0, 4.0, "constant")],
                        drain=10.0, request_timeout=20.0)
    w = NoSharing(prompt_tokens=2048, output_tokens=32)
    replicas, ts = 4, 5.0
    return Scenario("no-sharing", scale, w, _fleet(scale, replicas, 1100, ts), ramp(2.0, 8.0, 4, 25.0), drain=40.0)


# Per scale: the TraceReplay knobs (tokens per hash block, prompt and output caps, speedup,
# share of conversations) and the fleet (replicas, KV blocks each, time scale).
TRACE_KNOBS: dict[str, dict[str, float]] = {
    "tiny": {"block_tokens": 16, "max_prompt_tokens": 512, "max_output_tokens": 4, "speedup": 1.0, "fraction": 1.0,
             "common_share": 0.5},
    "small": {"block_tokens": 128, "max_prompt_tokens": 8000, "max_output_tokens": 64, "speedup": 30.0,
              "fraction": 0.06},
    "medium": {"block_tokens": 256, "max_prompt_tokens": 16000, "max_output_tokens": 128, "speedup": 10.0,
               "fraction": 0.1},
}


def trace(scale: str, path: str | None = None, **knobs: float | None) -> Scenario:
    """A Mooncake or Bailian trace replayed at its timestamps (one timed stage); `knobs` override TRACE_KNOBS."""
    if not path:
        raise ValueError("the trace scenario needs --trace PATH (a Mooncake or Bailian JSONL file: timestamp, "
                         "input_length, output_length, hash_ids)")
    params = {**TRACE_KNOBS[scale], **{k: v for k, v in knobs.items() if v is not None}}
    for k in ("block_tokens", "max_prompt_tokens", "max_output_tokens"):
        params[k] = int(params[k])
    w = TraceReplay(path, **params)  # type: ignore[arg-type]
    duration = w.duration_s() + 1e-3
    stage = Stage(duration, len(w.selected()) / max(duration, 1e-3), "trace")
    if scale == "tiny":
        return Scenario("trace", scale, w, _fleet(scale, 2, 96, 1.0), [stage], drain=10.0, request_timeout=20.0)
    if scale == "small":
        # 2,000 blocks (32K tokens) a replica: the fleet holds about ten seconds of this traffic,
        # about the sped-up gap between two turns of a conversation, so placement decides reuse.
        return Scenario("trace", scale, w, _fleet(scale, 4, 2000, 5.0), [stage], drain=40.0)
    return Scenario("trace", scale, w, _fleet(scale, 8, 4000, 2.0, max_model_len=16384), [stage], drain=60.0)


SCENARIOS = {"shared-prefix": shared_prefix, "multi-turn": multi_turn, "agentic": agentic,
             "no-sharing": no_sharing, "trace": trace}


def get_scenario(name: str, scale: str, trace_path: str | None = None, **trace_knobs: float | None) -> Scenario:
    """The named scenario at `scale` (`trace` needs `trace_path`; `trace_knobs` override its knobs)."""
    if name not in SCENARIOS:
        raise ValueError(f"unknown scenario {name!r}; known: {sorted(SCENARIOS)}")
    if scale not in SCALES:
        raise ValueError(f"unknown scale {scale!r}; known: {SCALES}")
    if name == "trace":
        return trace(scale, trace_path, **trace_knobs)
    return SCENARIOS[name](scale)


__all__ = ["SCALES", "SCENARIOS", "TRACE_KNOBS", "Scenario", "get_scenario"]
