"""InferenceObjective priorities: the config's static map overlaid by the cluster's objectives."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar, overload

T = TypeVar("T")

# The groups InferenceObjectives are read from, the first winning a name both hold: llm-d's current
# group (the llm-d router chart creates its objectives there), then GIE's, which llm-d deprecates.
LLMD_OBJECTIVE_GROUP = "llm-d.ai"
OBJECTIVE_GROUP = "inference.networking.x-k8s.io"
OBJECTIVE_VERSION = "v1alpha2"
OBJECTIVE_GROUPS = ((LLMD_OBJECTIVE_GROUP, OBJECTIVE_VERSION), (OBJECTIVE_GROUP, OBJECTIVE_VERSION))


class ObjectivePriorities(Mapping[str, int]):
    """Objective name → priority: the cluster's `InferenceObjective`s over the config's static map."""

    def __init__(self, static: Mapping[str, int] | None = None) -> None:
        self.static = dict(static or {})
        self._live: dict[str, int] = {}
        self._merged = dict(self.static)

    def set_live(self, priorities: Mapping[str, int]) -> None:
        """Replace the cluster's objectives (a full view)."""
        self._live = dict(priorities)
        self._merged = {**self.static, **self._live}

    @property
    def live(self) -> Mapping[str, int]:
        return self._live

    @overload
    def get(self, name: str, /) -> int | None: ...

    @overload
    def get(self, name: str, /, default: int | T) -> int | T: ...

    def get(self, name: str, /, default: object = None) -> object:
        """The priority of objective `name`, or `default` (a dict lookup: no KeyError on a miss)."""
        return self._merged.get(name, default)

    def __getitem__(self, name: str) -> int:
        return self._merged[name]

    def __iter__(self):
        return iter(self._merged)

    def __len__(self) -> int:
        return len(self._merged)


def objective_priority(objective: Mapping[str, Any], pool_name: str, pool_group: str) -> int | None:
    """The priority of an InferenceObjective that refers to this pool, else None."""
    spec = objective.get("spec") or {}
    ref = spec.get("poolRef") or {}
    if ref.get("name") != pool_name or ref.get("group", pool_group) not in (pool_group, "", None):
        return None
    priority = spec.get("priority", 0)
    if isinstance(priority, bool) or not isinstance(priority, int):
        return 0
    return priority


# ---- metrics -----------------------------------------------------------------------------------
