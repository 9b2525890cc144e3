"""Profile handlers: which scheduling profiles run, and which result is primary."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from epp.framework import (
    ConfigError,
    CycleState,
    InferenceRequest,
    ProfileHandler,
    ProfileRunResult,
    SchedulingResult,
)


class SingleProfileHandler(ProfileHandler):
    """Runs the one configured profile once; its result is the primary result."""

    type_name = "single-profile-handler"

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
