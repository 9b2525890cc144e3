"""Profile handlers: which scheduling profiles run, and which result is primary."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from epp.framework.errors import ConfigError
from epp.framework.plugin import CycleState, PluginContext, ProfileHandler, ProfileRunResult, SchedulingResult
from epp.framework.registry import PluginParams
from epp.framework.types import InferenceRequest


class SingleProfileHandler(ProfileHandler):
    """Runs the one configured profile once; its result is the primary result."""

    type_name = "single-profile-handler"

    def __init__(self, name: str, params: PluginParams, context: PluginContext) -> None:
        super().__init__(name)

    def check_profiles(self, names: Sequence[str]) -> None:
        """Fail at start-up unless exactly one profile is configured."""
        if len(names) != 1:
            raise ConfigError(f"{self.type_name} requires exactly one scheduling profile, got {len(names)}: "
                              f"{list(names)}")

    def pick_profiles(self, state: CycleState, request: InferenceRequest, profiles: Mapping[str, Any],
                      results: Mapping[str, ProfileRunResult | None]) -> list[str]:
        return [] if results else list(profiles)

    def process_results(self, state: CycleState, request: InferenceRequest,
                        results: Mapping[str, ProfileRunResult | None]) -> SchedulingResult:
        (name,) = results.keys()
        return SchedulingResult(profile_results=dict(results), primary_profile=name)
