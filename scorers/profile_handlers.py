"""Profile handlers: which scheduling profiles run, and which result is primary."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from epp.framework import (
    ConfigError,
    CycleState,
    ErrorCode,
    InferenceError,
    InferenceRequest,
    PluginContext,
    PluginParams,
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


class HeaderProfileHandler(ProfileHandler):
    """Runs the one profile a request header names (`headerName`, default `epp-profile`); `defaultProfile`
    (`decode`) when the header is absent or blank; with one profile configured, always that one."""

    type_name = "header-profile-handler"

    def __init__(self, name: str, params: PluginParams, context: PluginContext) -> None:
        super().__init__(name)
        # Header names arrive lower-cased; llm-d's default spelling is EPP-Profile.
        self.header = (params.str("headerName", "") or "").strip().lower() or "epp-profile"
        self.default_profile = (params.str("defaultProfile", "") or "").strip() or "decode"

    def describe(self) -> str:
        return f"headerName={self.header} defaultProfile={self.default_profile}"

    def _named(self, request: InferenceRequest) -> str:
        return request.headers.get(self.header, "").strip()

    def pick_profiles(self, state: CycleState, request: InferenceRequest, profiles: Mapping[str, Any],
                      results: Mapping[str, ProfileRunResult | None]) -> list[str]:
        if results:
            return []
        if len(profiles) == 1:
            return list(profiles)
        wanted = self._named(request) or self.default_profile
        return [wanted] if wanted in profiles else []

    def process_results(self, state: CycleState, request: InferenceRequest,
                        results: Mapping[str, ProfileRunResult | None]) -> SchedulingResult:
        if not results:
            named = self._named(request)
            # llm-d answers 429 here for want of a way to say 400; a request naming no profile is the client's error.
            reason = (f"header {self.header!r} names {named!r}, which is no scheduling profile" if named else
                      f"no {self.header!r} header, and defaultProfile {self.default_profile!r} is no scheduling "
                      "profile")
            raise InferenceError(ErrorCode.BAD_REQUEST, f"header-profile-handler: {reason}")
        (name,) = results.keys()
        return SchedulingResult(profile_results=dict(results), primary_profile=name)
