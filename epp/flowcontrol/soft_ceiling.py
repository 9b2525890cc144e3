"""`soft-reflective-ceiling-policy` (llm-d): graduated, priority-aware dispatch ceilings without parameters.

Over the N priorities flow control knows, highest first, band i has the reflective ceiling
`1 - i x saturation / (N - 1)`. The highest band's ceiling is always 1.0. A lower band below its
reflective ceiling is open (1.0); at saturation >= 1 it is closed (0.0); in between it alternates
open and closed across calls, open on one call in `round(saturation / (1 - saturation))`, so its
dispatch rate falls continuously as saturation rises. Every gated band shares one tick: on a call
either all gated bands are open or all are closed (the dispatch loop stops at the first gated
band). One band alone: always open. It takes no parameters, and is used only when declared and
named by `flowControl.usageLimitPolicyPluginRef`, as in llm-d.
"""

from __future__ import annotations

from collections.abc import Sequence

from epp.flowcontrol.usage import UsageLimitPolicy
from epp.framework import PluginContext, PluginParams, PluginRegistry


class SoftReflectiveCeilingPolicy(UsageLimitPolicy):
    """Ceilings that tighten for lower bands as saturation rises, alternating open and closed past them."""

    type_name = "soft-reflective-ceiling-policy"

    def __init__(self, name: str | None = None, params: PluginParams | None = None,
                 context: PluginContext | None = None) -> None:
        super().__init__(name)  # no parameters: any given is refused as unknown
        self.tick = 0

    def ceiling(self, priority: int, saturation: float) -> float:
        return 1.0  # one band alone is never gated

    def ceilings(self, priorities: Sequence[int], saturation: float) -> dict[int, float]:
        ordered = sorted(set(priorities), reverse=True)
        n = len(ordered)
        if n <= 1:
            return dict.fromkeys(ordered, 1.0)
        open_now = False
        if 1.0 - saturation <= saturation < 1.0:  # the alternating regime (saturation in [0.5, 1))
            period = max(1, round(saturation / (1.0 - saturation + 1e-9)))
            self.tick += 1
            open_now = self.tick % period == 0
        out: dict[int, float] = {}
        for i, priority in enumerate(ordered):
            reflective = 1.0 - i * saturation / (n - 1)
            if i == 0 or saturation < reflective:
                out[priority] = 1.0
            elif saturation >= 1.0:
                out[priority] = 0.0
            else:
                out[priority] = 1.0 if open_now else 0.0
        return out

    def describe(self) -> str:
        return "band i of N: 1 - i x saturation / (N - 1); past it, open one call in round(s / (1 - s))"


def register(registry: PluginRegistry) -> None:
    """Entry point of the `epp.plugins` group: registers the policy."""
    registry.register_class(SoftReflectiveCeilingPolicy)
