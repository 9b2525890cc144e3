"""The latency objectives of a routing run: what every request is sent with and measured against.

Every request carries a TTFT objective (`x-llm-d-slo-ttft-ms`, default `DEFAULT_TTFT_OBJECTIVE_MS`); a
seeded share of the sharing groups (a trace's conversations, a multi-turn workload's sessions) is
marked latency-sensitive and carries a tighter TTFT objective, and optionally a TPOT objective
(`x-llm-d-slo-tpot-ms`). The load generator sends them; `goodput.py` measures against them.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

DEFAULT_TTFT_OBJECTIVE_MS = 2000.0
SLO_TTFT_HEADER = "x-llm-d-slo-ttft-ms"
SLO_TPOT_HEADER = "x-llm-d-slo-tpot-ms"


@dataclass(frozen=True)
class Objectives:
    """The run's latency objectives (milliseconds) and which groups are latency-sensitive."""

    ttft_ms: float = DEFAULT_TTFT_OBJECTIVE_MS
    sensitive_share: float = 0.0
    sensitive_ttft_ms: float | None = None
    sensitive_tpot_ms: float | None = None
    seed: int = 11

    def __post_init__(self) -> None:
        if not self.ttft_ms > 0 or (self.sensitive_ttft_ms is not None and not self.sensitive_ttft_ms > 0) or \
                (self.sensitive_tpot_ms is not None and not self.sensitive_tpot_ms > 0):
            raise ValueError("latency objectives must be > 0 ms")
        if not 0 <= self.sensitive_share <= 1:
            raise ValueError(f"the latency-sensitive share must be in [0, 1], got {self.sensitive_share}")

    def sensitive(self, group: str) -> bool:
        """Whether the group's requests are latency-sensitive (seeded per group, the same for every contender)."""
        return self.sensitive_share > 0 and random.Random(f"{self.seed}:{group}").random() < self.sensitive_share

    def of(self, group: str) -> tuple[float, float | None, bool]:
        """(TTFT objective ms, TPOT objective ms or None, latency-sensitive) of a group's requests."""
        if self.sensitive(group):
            return (self.sensitive_ttft_ms or self.ttft_ms), self.sensitive_tpot_ms, True
        return self.ttft_ms, None, False

    def headers(self, group: str) -> dict[str, str]:
        """The objective headers a request of `group` is sent with."""
        ttft, tpot, _ = self.of(group)
        out = {SLO_TTFT_HEADER: f"{ttft:g}"}
        if tpot is not None:
            out[SLO_TPOT_HEADER] = f"{tpot:g}"
        return out

    def describe(self) -> str:
        text = f"TTFT objective {self.ttft_ms:g} ms for every request (`{SLO_TTFT_HEADER}`)"
        if self.sensitive_share > 0:
            tpot = f", TPOT {self.sensitive_tpot_ms:g} ms (`{SLO_TPOT_HEADER}`)" if self.sensitive_tpot_ms else ""
            text += (f"; {self.sensitive_share:.0%} of the groups latency-sensitive: TTFT "
                     f"{self.sensitive_ttft_ms or self.ttft_ms:g} ms{tpot}")
        return text


__all__ = ["DEFAULT_TTFT_OBJECTIVE_MS", "SLO_TPOT_HEADER", "SLO_TTFT_HEADER", "Objectives"]
