"""llm-d's disaggregation and data-parallel profile handlers, and the P/D deciders.

`disagg-profile-handler` runs the decode profile (the destination), then the encode profile
when its encode decider approves (a multimodal request's encoders, E/PD), then the prefill
profile when its prefill decider approves, and names the encode picks in `x-encoder-hosts-ports`
and the prefill pick in `x-prefiller-host-port` for the decode pod's sidecar.
`always-disagg-multimodal-decider` approves the encode stage for a request with image, audio or
video content. `disagg-headers-handler` is llm-d's deprecated hook that sets the same headers.
`prefix-based-pd-decider` approves when the decode pick would compute at least `nonCachedTokens`
of the prompt itself (0: never); `always-disagg-pd-decider` always does.
`data-parallel-profile-handler` sends the request to the picked pod's `primaryPort` and names the
picked rank in `x-data-parallel-host-port`.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from epp.framework import (
    ENCODER_HOSTS_PORTS_HEADER,
    PREFILLER_HOST_PORT_HEADER,
    PREFIX_MATCH_INFO,
    PREFIX_TIER_MATCH,
    PROMPT_TOKENS,
    ConfigError,
    CycleState,
    Endpoint,
    InferenceRequest,
    Plugin,
    PluginContext,
    PluginParams,
    PrefixMatchInfo,
    PreRequestHook,
    ProfileHandler,
    ProfileRunResult,
    PromptTokens,
    SchedulingResult,
    TierMatch,
)
from epp.scorers.pd import DECODE_ONLY, NO_PREFILLER, PREFILL_DECODE, _decisions_counter
from epp.scorers.prefix_hashing import AVERAGE_CHARACTERS_PER_TOKEN
from epp.scorers.prompt_text import user_input_length

log = logging.getLogger(__name__)

DATA_PARALLEL_HEADER = "x-data-parallel-host-port"
STAGE_ORDERS = ("decode-first", "prefill-first")
# Flat keys of llm-d's older disagg-profile-handler, mapped with a warning as llm-d does.
_LEGACY_KEYS = {"decodeProfile": ("profiles", "decode"), "prefillProfile": ("profiles", "prefill"),
                "encodeProfile": ("profiles", "encode"), "deciderPluginName": ("deciders", "prefill")}


class PDDecider(Plugin):
    """Decides per request whether the prefill stage runs, given the decode profile's pick."""

    def disaggregate(self, state: CycleState, request: InferenceRequest, decode: Endpoint) -> bool:
        raise NotImplementedError


def prompt_token_count(state: CycleState, request: InferenceRequest) -> int:
    """The prompt's tokens: the token-producer's count, else characters / 4 (llm-d's estimate)."""
    tokens: PromptTokens | None = state.get(PROMPT_TOKENS)
    if tokens is not None:
        return len(tokens.token_ids)
    return user_input_length(request) // AVERAGE_CHARACTERS_PER_TOKEN


class PrefixBasedPDDecider(PDDecider):
    """Prefill remotely when the decode pick's uncached prompt reaches `nonCachedTokens` (0: never) and the
    prompt is at least `promptTokens` long (0: any)."""

    type_name = "prefix-based-pd-decider"

    def __init__(self, name: str, params: PluginParams, context: PluginContext) -> None:
        super().__init__(name)
        self.non_cached_tokens = params.int("nonCachedTokens", 0, minimum=0)
        self.prompt_tokens = params.int("promptTokens", 0, minimum=0)

    def describe(self) -> str:
        return f"nonCachedTokens={self.non_cached_tokens} promptTokens={self.prompt_tokens}"

    def disaggregate(self, state: CycleState, request: InferenceRequest, decode: Endpoint) -> bool:
        if self.non_cached_tokens == 0:
            return False
        tiers = state.endpoint_data(PREFIX_TIER_MATCH, decode.name)
        if isinstance(tiers, TierMatch):
            # Precise KV events: exact, and cached in any tier counts (a CPU load beats a remote prefill).
            total, cached = tiers.total_tokens, tiers.cached_tokens
        else:
            info = state.endpoint_data(PREFIX_MATCH_INFO, decode.name)
            if not isinstance(info, PrefixMatchInfo):
                return False  # no prefix data for the decode pick: llm-d does not disaggregate
            total, cached = prompt_token_count(state, request), int(info.matched_blocks * info.block_size_tokens)
        if self.prompt_tokens and total < self.prompt_tokens:
            return False
        return total - cached >= self.non_cached_tokens


class AlwaysDisaggPDDecider(PDDecider):
    """Prefill remotely for every request."""

    type_name = "always-disagg-pd-decider"

    def disaggregate(self, state: CycleState, request: InferenceRequest, decode: Endpoint) -> bool:
        return True


# The chat content blocks llm-d's encode stage sends to encoders (one encoder request per item).
MULTIMODAL_TYPES = frozenset({"image_url", "audio_url", "video_url", "input_audio"})


def multimodal_items(body: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The multimodal content blocks of a chat request's messages, in order."""
    items: list[Mapping[str, Any]] = []
    messages = body.get("messages")
    for message in messages if isinstance(messages, list) else ():
        content = message.get("content") if isinstance(message, dict) else None
        for block in content if isinstance(content, list) else ():
            if isinstance(block, dict) and block.get("type") in MULTIMODAL_TYPES:
                items.append(block)
    return items


class AlwaysDisaggMultimodalDecider(PDDecider):
    """Runs the encode stage for every request with image, audio or video content; text-only requests skip it."""

    type_name = "always-disagg-multimodal-decider"

    def disaggregate(self, state: CycleState, request: InferenceRequest, decode: Endpoint) -> bool:
        return bool(multimodal_items(request.body))


def set_stage_headers(state: CycleState, result: SchedulingResult, prefill_profile: str, encode_profile: str) -> None:
    """Name the prefill pick in `x-prefiller-host-port` and every encode pick in `x-encoder-hosts-ports`."""
    prefill = result.profile_results.get(prefill_profile)
    if prefill is not None and prefill.targets and result.primary_profile != prefill_profile:
        state.set_request_header(PREFILLER_HOST_PORT_HEADER, prefill.targets[0].hostport)
    encode = result.profile_results.get(encode_profile)
    if encode is not None and encode.targets and result.primary_profile != encode_profile:
        state.set_request_header(ENCODER_HOSTS_PORTS_HEADER, ",".join(ep.hostport for ep in encode.targets))


class DisaggProfileHandler(ProfileHandler, PreRequestHook):
    """Runs `profiles.decode`, then `profiles.encode` when `deciders.encode` approves and `profiles.prefill` when
    `deciders.prefill` approves; the picks go in `x-encoder-hosts-ports` and `x-prefiller-host-port`; decode is
    the primary result."""

    type_name = "disagg-profile-handler"

    def __init__(self, name: str, params: PluginParams, context: PluginContext) -> None:
        super().__init__(name)
        profiles = dict(params.mapping("profiles", None) or {})
        deciders = dict(params.mapping("deciders", None) or {})
        for key, (section, field) in _LEGACY_KEYS.items():
            value = params.str(key, None)
            if value is not None:
                log.warning("plugin %s: parameter %r is deprecated; read as %s.%s", name, key, section, field)
                (profiles if section == "profiles" else deciders).setdefault(field, value)
        _only(name, "profiles", profiles, ("decode", "prefill", "encode"))
        _only(name, "deciders", deciders, ("prefill", "encode"))
        order = params.str("stageOrder", "decode-first", choices=STAGE_ORDERS)
        if order != "decode-first":
            raise ConfigError(f"plugin {name!r}: parameter 'stageOrder' {order!r} is not supported: the prefill "
                              "decider reads the decode pick, so decode runs first")
        self.decode_profile = str(profiles.get("decode", "decode"))
        self.prefill_profile = str(profiles.get("prefill", "prefill"))
        self.encode_profile = str(profiles.get("encode", "encode"))
        if len({self.decode_profile, self.prefill_profile, self.encode_profile}) < 3:
            raise ConfigError(f"plugin {name!r}: profiles.decode, profiles.prefill and profiles.encode must differ")
        self.refs = {f"deciders.{stage}": str(deciders[stage]) for stage in ("prefill", "encode")
                     if deciders.get(stage)}
        self.decider: PDDecider | None = None
        self.encode_decider: PDDecider | None = None
        self.decisions = _decisions_counter(context.metrics_registry)

    def describe(self) -> str:
        prefill = self.refs.get("deciders.prefill", "none")
        encode = self.refs.get("deciders.encode", "none")
        return (f"profiles.decode={self.decode_profile} profiles.prefill={self.prefill_profile} "
                f"profiles.encode={self.encode_profile} deciders.prefill={prefill} deciders.encode={encode}")

    def plugin_refs(self) -> Mapping[str, str]:
        """The deciders `deciders.prefill` and `deciders.encode` name (resolved by the loader)."""
        return self.refs

    def bind_plugins(self, plugins: Mapping[str, Plugin]) -> None:
        for param, plugin in plugins.items():
            if not isinstance(plugin, PDDecider):
                raise ConfigError(f"plugin {self.name!r}: parameter {param!r} names {plugin.name!r} (type "
                                  f"{plugin.type_name}), which is no P/D decider; allowed: prefix-based-pd-decider, "
                                  "always-disagg-pd-decider, always-disagg-multimodal-decider")
            if param == "deciders.encode":
                self.encode_decider = plugin
            else:
                self.decider = plugin

    def check_profiles(self, names: Sequence[str]) -> None:
        """Fail at start-up unless the decode profile exists, and each optional stage's when a decider may run it."""
        wanted = {self.decode_profile}
        if "deciders.prefill" in self.refs:
            wanted.add(self.prefill_profile)
        if "deciders.encode" in self.refs:
            wanted.add(self.encode_profile)
        missing = sorted(wanted - set(names))
        extra = sorted(set(names) - wanted)
        if missing or extra:
            raise ConfigError(f"{self.type_name} needs exactly the profiles {sorted(wanted)}; missing {missing}, "
                              f"never run {extra}")

    def pick_profiles(self, state: CycleState, request: InferenceRequest, profiles: Mapping[str, Any],
                      results: Mapping[str, ProfileRunResult | None]) -> list[str]:
        if not results:
            return [self.decode_profile]
        decode = results.get(self.decode_profile)
        if decode is None or not decode.targets:
            return []
        # llm-d's decode-first order: decode, then encode, then prefill; each optional stage decided once.
        decided = state.get(f"{self.name}/decided") or set()
        state.put(f"{self.name}/decided", decided)
        for stage, profile, decider in (("encode", self.encode_profile, self.encode_decider),
                                        ("prefill", self.prefill_profile, self.decider)):
            if decider is None or stage in decided or profile in results:
                continue
            decided.add(stage)
            approve = decider.disaggregate(state, request, decode.targets[0])
            if stage == "prefill":
                state.put(self.name, approve)
            if approve:
                return [profile]
        return []

    def process_results(self, state: CycleState, request: InferenceRequest,
                        results: Mapping[str, ProfileRunResult | None]) -> SchedulingResult:
        kept = {name: result for name, result in results.items() if result is not None}
        if self.decisions is not None and self.decode_profile in kept:
            if not state.get(self.name):
                label = DECODE_ONLY
            else:
                label = PREFILL_DECODE if self.prefill_profile in kept else NO_PREFILLER
            self.decisions.labels(label).inc()
        return SchedulingResult(profile_results=kept, primary_profile=self.decode_profile)

    def pre_request(self, state: CycleState, request: InferenceRequest, result: SchedulingResult) -> None:
        set_stage_headers(state, result, self.prefill_profile, self.encode_profile)


class DisaggHeadersHandler(PreRequestHook):
    """Deprecated in llm-d (use disagg-profile-handler, which sets them itself): names the prefill pick in
    `x-prefiller-host-port` and the encode picks in `x-encoder-hosts-ports`."""

    type_name = "disagg-headers-handler"

    def __init__(self, name: str, params: PluginParams, context: PluginContext) -> None:
        super().__init__(name)
        self.prefill_profile = params.str("prefillProfile", "prefill") or "prefill"
        self.encode_profile = params.str("encodeProfile", "encode") or "encode"
        log.warning("plugin %s: disagg-headers-handler is deprecated in llm-d; disagg-profile-handler sets "
                    "x-prefiller-host-port and x-encoder-hosts-ports itself", name)

    def describe(self) -> str:
        return (f"prefillProfile={self.prefill_profile} encodeProfile={self.encode_profile} (deprecated: "
                "disagg-profile-handler sets these headers itself)")

    def pre_request(self, state: CycleState, request: InferenceRequest, result: SchedulingResult) -> None:
        set_stage_headers(state, result, self.prefill_profile, self.encode_profile)


class DataParallelProfileHandler(ProfileHandler):
    """Runs the one profile; the request goes to the picked pod's `primaryPort`, the picked rank (`ip:port`) in
    `x-data-parallel-host-port` for the pod's sidecar."""

    type_name = "data-parallel-profile-handler"

    def __init__(self, name: str, params: PluginParams, context: PluginContext) -> None:
        super().__init__(name)
        self.primary_port = params.int("primaryPort", 8000, minimum=1)
        if self.primary_port > 65535:
            raise ConfigError(f"plugin {name!r}: parameter 'primaryPort' must be a port (1-65535), "
                              f"got {self.primary_port}")

    def describe(self) -> str:
        return f"primaryPort={self.primary_port} header={DATA_PARALLEL_HEADER}"

    def check_profiles(self, names: Sequence[str]) -> None:
        """Fail at start-up unless exactly one profile is configured."""
        if len(names) != 1:
            raise ConfigError(f"{self.type_name} requires exactly one scheduling profile, got {list(names)}")

    def pick_profiles(self, state: CycleState, request: InferenceRequest, profiles: Mapping[str, Any],
                      results: Mapping[str, ProfileRunResult | None]) -> list[str]:
        return [] if results else list(profiles)

    def process_results(self, state: CycleState, request: InferenceRequest,
                        results: Mapping[str, ProfileRunResult | None]) -> SchedulingResult:
        (name, result), = results.items()
        if result is None or not result.targets:
            return SchedulingResult(profile_results={}, primary_profile=name)
        state.set_request_header(DATA_PARALLEL_HEADER, result.targets[0].hostport)
        primary = tuple(dataclasses.replace(ep, port=self.primary_port) for ep in result.targets)
        return SchedulingResult(profile_results={name: ProfileRunResult(primary)}, primary_profile=name)


def _only(plugin: str, param: str, section: Mapping[str, Any], allowed: tuple[str, ...]) -> None:
    for key, value in section.items():
        if key not in allowed:
            raise ConfigError(f"plugin {plugin!r}: parameter '{param}.{key}' is unknown; allowed: "
                              f"{', '.join(allowed)}")
        if not isinstance(value, str) or not value:
            raise ConfigError(f"plugin {plugin!r}: parameter '{param}.{key}' must be a name, got {value!r}")
