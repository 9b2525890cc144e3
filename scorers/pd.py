"""Prefill/decode disaggregation: the P/D profile handler and the prefill-header hook.

The handler always runs the decode profile first (the decode endpoint is the destination). It
then estimates how much of the prompt the chosen decode endpoint would have to prefill itself:
exactly, from the precise producer's tokens cached there (any tier), or approximately, from the
approximate producer's matched blocks against the prompt's estimated length. Only when that
uncached part reaches `threshold` tokens does it also run the prefill profile, whose pick the
`prefill-header-handler` names in `x-prefiller-host-port` for the decode pod's sidecar.
A prefill profile that finds no endpoint leaves the request aggregated (decode prefills locally).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter

from epp.framework import (
    PREFILLER_HOST_PORT_HEADER,
    PREFIX_MATCH_INFO,
    PREFIX_TIER_MATCH,
    ConfigError,
    CycleState,
    Endpoint,
    InferenceRequest,
    PluginContext,
    PluginParams,
    PluginRegistry,
    PrefixMatchInfo,
    PreRequestHook,
    ProfileHandler,
    ProfileRunResult,
    SchedulingResult,
    TierMatch,
    once_per_registry,
)
from epp.scorers.prefix_hashing import AVERAGE_CHARACTERS_PER_TOKEN
from epp.scorers.prompt_text import user_input_length

DECODE_ONLY = "decode-only"
PREFILL_DECODE = "prefill-decode"
NO_PREFILLER = "no-prefiller"  # wanted a remote prefill, but the prefill profile found no endpoint

def _decisions_counter(registry: CollectorRegistry | None) -> Counter | None:
    """`epp_pd_decisions_total{decision}`, once per registry (several handlers may share it)."""
    if registry is None:
        return None
    return once_per_registry(registry, "epp_pd_decisions", lambda r: Counter(
        "epp_pd_decisions", "P/D decisions of the profile handler: decode-only, prefill-decode, "
        "no-prefiller (disaggregation wanted, no prefill endpoint)", ["decision"], registry=r))


@dataclass(frozen=True, slots=True)
class PDDecision:
    """What the handler decided for one request, kept in `CycleState` under the handler's name."""

    uncached_tokens: int
    source: str  # "precise", "approximate" or "estimate" (no prefix data for the decode endpoint)
    disaggregate: bool


def uncached_prompt_tokens(state: CycleState, request: InferenceRequest, endpoint: Endpoint) -> tuple[int, str]:
    """Prompt tokens `endpoint` would compute itself, and where the number comes from."""
    tiers = state.endpoint_data(PREFIX_TIER_MATCH, endpoint.name)
    if isinstance(tiers, TierMatch):
        # Cached in any tier counts: loading from CPU/disk is cheaper than a remote prefill, and
        # the tier-weighted block count would undercount CPU blocks (llm-d/llm-d #1466).
        return max(0, tiers.total_tokens - tiers.cached_tokens), "precise"
    estimate = -(-user_input_length(request) // AVERAGE_CHARACTERS_PER_TOKEN)
    info = state.endpoint_data(PREFIX_MATCH_INFO, endpoint.name)
    if isinstance(info, PrefixMatchInfo):
        cached = int(info.matched_blocks * info.block_size_tokens)
        return max(0, estimate - cached), "approximate"
    return estimate, "estimate"


class PDProfileHandler(ProfileHandler):
    """Runs `decode`, then `prefill` only when the decode pick's uncached prompt reaches `threshold` tokens."""

    type_name = "pd-profile-handler"

    def __init__(self, name: str, params: PluginParams, context: PluginContext) -> None:
        super().__init__(name)
        # Uncached prompt tokens on the decode pick from which a remote prefill pays (0: always).
        self.threshold = params.int("threshold", 0, minimum=0)
        self.decode_profile = params.str("decodeProfile", "decode") or "decode"
        self.prefill_profile = params.str("prefillProfile", "prefill") or "prefill"
        if self.decode_profile == self.prefill_profile:
            raise ConfigError(f"plugin {name!r}: 'decodeProfile' and 'prefillProfile' must differ, "
                              f"both are {self.decode_profile!r}")
        self.decisions = _decisions_counter(context.metrics_registry)

    def describe(self) -> str:
        return (f"threshold={self.threshold} decodeProfile={self.decode_profile} "
                f"prefillProfile={self.prefill_profile}")

    def check_profiles(self, names: Sequence[str]) -> None:
        """Fail at start-up unless both the decode and the prefill profile exist, and nothing else."""
        wanted = {self.decode_profile, self.prefill_profile}
        missing = sorted(wanted - set(names))
        extra = sorted(set(names) - wanted)
        if missing or extra:
            raise ConfigError(f"{self.type_name} needs exactly the profiles {sorted(wanted)}; "
                              f"missing {missing}, unexpected {extra}")

    def pick_profiles(self, state: CycleState, request: InferenceRequest, profiles: Mapping[str, Any],
                      results: Mapping[str, ProfileRunResult | None]) -> list[str]:
        if not results:
            return [self.decode_profile]
        decode = results.get(self.decode_profile)
        if decode is None or not decode.targets or self.prefill_profile in results:
            return []
        uncached, source = uncached_prompt_tokens(state, request, decode.targets[0])
        disaggregate = uncached >= self.threshold and self.prefill_profile in profiles
        state.put(self.name, PDDecision(uncached, source, disaggregate))
        return [self.prefill_profile] if disaggregate else []

    def process_results(self, state: CycleState, request: InferenceRequest,
                        results: Mapping[str, ProfileRunResult | None]) -> SchedulingResult:
        kept = {name: result for name, result in results.items() if result is not None}
        if self.decisions is not None and self.decode_profile in kept:
            decision: PDDecision | None = state.get(self.name)
            if decision is None or not decision.disaggregate:
                label = DECODE_ONLY
            else:
                label = PREFILL_DECODE if self.prefill_profile in kept else NO_PREFILLER
            self.decisions.labels(label).inc()
        return SchedulingResult(profile_results=kept, primary_profile=self.decode_profile)


class PrefillHeaderHandler(PreRequestHook):
    """Names the prefill profile's pick in `x-prefiller-host-port` (only when one was made)."""

    type_name = "prefill-header-handler"

    def __init__(self, name: str, params: PluginParams, context: PluginContext) -> None:
        super().__init__(name)
        self.prefill_profile = params.str("prefillProfile", "prefill") or "prefill"

    def describe(self) -> str:
        return f"prefillProfile={self.prefill_profile} header={PREFILLER_HOST_PORT_HEADER}"

    def pre_request(self, state: CycleState, request: InferenceRequest, result: SchedulingResult) -> None:
        prefill = result.profile_results.get(self.prefill_profile)
        if prefill is not None and prefill.targets and result.primary_profile != self.prefill_profile:
            state.set_request_header(PREFILLER_HOST_PORT_HEADER, prefill.targets[0].hostport)


def register(registry: PluginRegistry) -> None:
    """Register `pd-profile-handler` and `prefill-header-handler`."""
    registry.register_class(PDProfileHandler)
    registry.register_class(PrefillHeaderHandler)
