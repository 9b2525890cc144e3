"""Usage-limit policies: the pool saturation up to which each priority band may dispatch."""

from __future__ import annotations

from epp.framework.errors import ConfigError
from epp.framework.plugin import Plugin, PluginContext
from epp.framework.registry import PluginParams


class UsageLimitPolicy(Plugin):
    """A band dispatches only while the pool's saturation is below its ceiling."""

    def ceiling(self, priority: int, saturation: float) -> float:
        raise NotImplementedError


class StaticUsageLimitPolicy(UsageLimitPolicy):
    """One fixed ceiling for every priority (`threshold`, default 1.0: dispatch until saturated)."""

    type_name = "static-usage-limit-policy"

    def __init__(self, name: str | None = None, params: PluginParams | None = None,
                 context: PluginContext | None = None, *, threshold: float = 1.0) -> None:
        super().__init__(name)
        if params is not None:
            threshold = params.float("threshold", threshold)
        if not 0 < threshold <= 1:
            raise ConfigError(f"plugin {self.name!r}: parameter 'threshold' must be in (0, 1], got {threshold}")
        self.threshold = float(threshold)

    def ceiling(self, priority: int, saturation: float) -> float:
        return self.threshold

    def describe(self) -> str:
        return f"threshold={self.threshold:g}"


USAGE_LIMIT_POLICIES: dict[str, type[UsageLimitPolicy]] = {StaticUsageLimitPolicy.type_name: StaticUsageLimitPolicy}
DEFAULT_USAGE_LIMIT_POLICY = StaticUsageLimitPolicy.type_name
