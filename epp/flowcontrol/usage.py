"""Usage-limit policies: the pool saturation up to which each priority band may dispatch."""

from __future__ import annotations

from collections.abc import Mapping

from epp.framework import PluginParams
from epp.framework.errors import ConfigError
from epp.framework.plugin import Plugin, PluginContext


class UsageLimitPolicy(Plugin):
    """A band dispatches only while the pool's saturation is below its ceiling."""

    def ceiling(self, priority: int, saturation: float) -> float:
        raise NotImplementedError

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


USAGE_LIMIT_POLICIES: dict[str, type[UsageLimitPolicy]] = {StaticUsageLimitPolicy.type_name: StaticUsageLimitPolicy}
DEFAULT_USAGE_LIMIT_POLICY = StaticUsageLimitPolicy.type_name
