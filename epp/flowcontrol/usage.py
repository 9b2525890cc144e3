"""Usage-limit policies: the pool saturation up to which each priority band may dispatch."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from epp.framework import PluginParams
from epp.framework.errors import ConfigError
from epp.framework.plugin import Plugin, PluginContext


class UsageLimitPolicy(Plugin):
    """A band dispatches only while the pool's saturation is below its ceiling."""

    def ceiling(self, priority: int, saturation: float) -> float:
        raise NotImplementedError

    def ceilings(self, priorities: Sequence[int], saturation: float) -> dict[int, float]:
        """The ceiling of each of `priorities` (highest first: every band the controller knows)."""
        return {p: self.ceiling(p, saturation) for p in priorities}

    def describe(self) -> str:
        """The ceilings in words, for `epp check-config`."""
        return ""


class StaticUsageLimitPolicy(UsageLimitPolicy):
    """Fixed ceilings: `threshold` (GIE, default 1.0) for every priority, unless `priorityThresholds` names it.

    `priorityThresholds` (this project's extension, `{priority: ceiling}`) holds capacity back for
    higher bands: e.g. `{0: 0.8}` lets priority 0 fill the pool only to 0.8 of saturation, so a
    higher-priority request arriving later finds room at once.
    """

    type_name = "static-usage-limit-policy"

    def __init__(self, name: str | None = None, params: PluginParams | None = None,
                 context: PluginContext | None = None, *, threshold: float = 1.0,
                 priority_thresholds: Mapping[int, float] | None = None) -> None:
        super().__init__(name)
        if params is not None:
            threshold = params.float("threshold", threshold)
            priority_thresholds = params.mapping("priorityThresholds", priority_thresholds)
        self.threshold = self._check("threshold", threshold)
        self.priority_thresholds: dict[int, float] = {}
        for key, value in (priority_thresholds or {}).items():
            try:
                priority = int(key)
            except (TypeError, ValueError):
                raise ConfigError(f"plugin {self.name!r}: parameter 'priorityThresholds' keys must be integer "
                                  f"priorities, got {key!r}") from None
            self.priority_thresholds[priority] = self._check(f"priorityThresholds[{priority}]", value)

    def _check(self, what: str, value: object) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
            raise ConfigError(f"plugin {self.name!r}: parameter {what!r} must be a number in (0, 1], got {value!r}")
        return float(value)

    def ceiling(self, priority: int, saturation: float) -> float:
        return self.priority_thresholds.get(priority, self.threshold)

    def describe(self) -> str:
        extra = "".join(f", priority {p}: {t:g}" for p, t in sorted(self.priority_thresholds.items()))
        return f"threshold={self.threshold:g}{extra}"


class PriorityHoldbackPolicy(UsageLimitPolicy):
    """llm-d's stepped ceilings: the highest priority band gets `maxCeiling`, the lowest `minCeiling`.

    Over the priorities the controller knows (its configured bands and every priority it has
    queued), highest first: `domain: rank` spaces the ceilings evenly by rank,
    `c_i = maxCeiling - i (maxCeiling - minCeiling) / (N - 1)`; `domain: value` by the priority's
    value within the range, `c = minCeiling + (p - pMin) / (pMax - pMin) (maxCeiling - minCeiling)`
    (all equal: `maxCeiling`). One priority alone gets `maxCeiling`. `shape: linear` is the only
    shape; `minCeiling` is required, in [0, 1); `maxCeiling` in (0, 1], default 1, above `minCeiling`.
    """

    type_name = "priority-holdback-policy"

    def __init__(self, name: str | None = None, params: PluginParams | None = None,
                 context: PluginContext | None = None, *, min_ceiling: float | None = None,
                 max_ceiling: float = 1.0, domain: str = "rank") -> None:
        super().__init__(name)
        if params is not None:
            params.str("shape", "linear", choices=("linear",))
            domain = params.str("domain", domain, choices=("rank", "value"))
            raw_min = params.float("minCeiling", math.nan)
            min_ceiling = None if math.isnan(raw_min) else raw_min
            max_ceiling = params.float("maxCeiling", max_ceiling)
        if min_ceiling is None:
            raise ConfigError(f"plugin {self.name!r}: parameter 'minCeiling' is required (the ceiling of the lowest "
                              "priority, in [0, 1))")
        if not 0.0 <= min_ceiling < 1.0:
            raise ConfigError(f"plugin {self.name!r}: parameter 'minCeiling' must be in [0, 1), got {min_ceiling:g}")
        if not 0.0 < max_ceiling <= 1.0:
            raise ConfigError(f"plugin {self.name!r}: parameter 'maxCeiling' must be in (0, 1], got {max_ceiling:g}")
        if min_ceiling >= max_ceiling:
            raise ConfigError(f"plugin {self.name!r}: 'minCeiling' ({min_ceiling:g}) must be below 'maxCeiling' "
                              f"({max_ceiling:g})")
        self.min_ceiling = float(min_ceiling)
        self.max_ceiling = float(max_ceiling)
        self.domain = domain

    def ceiling(self, priority: int, saturation: float) -> float:
        """Alone (no other priority known): `maxCeiling`."""
        return self.max_ceiling

    def ceilings(self, priorities: Sequence[int], saturation: float) -> dict[int, float]:
        ordered = sorted(set(priorities), reverse=True)
        if len(ordered) <= 1:
            return dict.fromkeys(ordered, self.max_ceiling)
        spread = self.max_ceiling - self.min_ceiling
        if self.domain == "rank":
            step = spread / (len(ordered) - 1)
            return {p: self.max_ceiling - i * step for i, p in enumerate(ordered)}
        high, low = ordered[0], ordered[-1]
        return {p: self.min_ceiling + (p - low) / (high - low) * spread for p in ordered}

    def describe(self) -> str:
        return f"shape=linear domain={self.domain} minCeiling={self.min_ceiling:g} maxCeiling={self.max_ceiling:g}"


USAGE_LIMIT_POLICIES: dict[str, type[UsageLimitPolicy]] = {
    cls.type_name: cls for cls in (StaticUsageLimitPolicy, PriorityHoldbackPolicy)}
DEFAULT_USAGE_LIMIT_POLICY = StaticUsageLimitPolicy.type_name
