"""Named scenarios: a workload, a simulated fleet and a load schedule, at several scales.

Scales: `tiny` (the CI smoke run: seconds per contender), `small` (what a 2-core machine
sustains while every process of the stack shares it), `medium` (a bigger machine).
The simulated replicas use the `h100-llama3-8b` latency profile (a datasheet roofline of
Llama-3.1-8B on one H100, see engine/sim/profiles.py) slowed by `time_scale`, so the offered
rates in wall-clock requests/s stay within what the machine can drive; every latency in the
results is wall-clock (divide by `time_scale` for simulated-GPU seconds).
Cache sizing follows llm-d's "73-capacity" experiment: the groups' shared prefixes fill
about 73 % of the fleet's KV cache and several times one replica's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from bench.routing.loadgen import Stage, ramp
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
    workload: Workload
    fleet: FleetConfig
    stages: list[Stage]
    drain: float = 30.0
    request_timeout: float = 120.0
    notes: list[str] = field(default_factory=list)

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


SCENARIOS = {"shared-prefix": shared_prefix, "multi-turn": multi_turn, "agentic": agentic,
             "no-sharing": no_sharing}


def get_scenario(name: str, scale: str) -> Scenario:
    """The named scenario at `scale`."""
    if name not in SCENARIOS:
        raise ValueError(f"unknown scenario {name!r}; known: {sorted(SCENARIOS)}")
    if scale not in SCALES:
        raise ValueError(f"unknown scale {scale!r}; known: {SCALES}")
    return SCENARIOS[name](scale)


__all__ = ["SCALES", "SCENARIOS", "Scenario", "get_scenario"]
