"""The `flowControl` section of the EndpointPickerConfig, validated strictly (GIE field names and defaults).

```yaml
featureGates: [flowControl]
flowControl:
  maxBytes: 2Gi                # all bands together; 0 or absent = unlimited
  maxRequests: 1000            # all bands together; 0 or absent = unlimited
  defaultRequestTTL: 30s       # longest wait in the queue; 0 or absent = until the client leaves
  usageLimitPolicyPluginRef: static-usage-limit-policy   # or priority-holdback-policy
  enableEviction: false        # true: in-flight sheddable requests (priority < 0) may be evicted for higher bands
  defaultPriorityBand:         # template for priorities without their own band
    maxBytes: 1G
  priorityBands:
  - priority: 100
    maxBytes: 500M             # default 1,000,000,000
    maxRequests: 200           # default unlimited
    defaultRequestTTL: 10s     # this band's queue-wait budget (default: the global one; 0 = none)
    fairnessPolicyRef: round-robin-fairness-policy   # default global-strict-fairness-policy
    orderingPolicyRef: edf-ordering-policy           # default fcfs-ordering-policy
```

Policy references name a plugin of the `plugins` list or, as GIE's defaults do, a policy type.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from epp.flowcontrol.backlog import PrefillBacklogDetector
from epp.flowcontrol.concurrency import ConcurrencyDetector
from epp.flowcontrol.fairness import DEFAULT_FAIRNESS_POLICY, FAIRNESS_POLICIES, FairnessPolicy
from epp.flowcontrol.ordering import DEFAULT_ORDERING_POLICY, ORDERING_POLICIES, OrderingPolicy
from epp.flowcontrol.program_aware import ProgramAwareFairness
from epp.flowcontrol.usage import DEFAULT_USAGE_LIMIT_POLICY, USAGE_LIMIT_POLICIES, UsageLimitPolicy
from epp.framework import parse_duration
from epp.framework.errors import ConfigError
from epp.framework.plugin import Plugin
from epp.framework.registry import PluginRegistry

FEATURE_GATE = "flowControl"
FLOW_CONTROL_FIELDS = ("maxBytes", "maxRequests", "defaultRequestTTL", "defaultPriorityBand", "priorityBands",
                       "usageLimitPolicyPluginRef", "enableEviction")
BAND_FIELDS = ("priority", "maxBytes", "maxRequests", "fairnessPolicyRef", "orderingPolicyRef", "defaultRequestTTL")
DEFAULT_BAND_FIELDS = tuple(f for f in BAND_FIELDS if f != "priority")
DEFAULT_BAND_MAX_BYTES = 1_000_000_000  # GIE's per-band default

_QUANTITY = re.compile(r"^(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$")
_SUFFIX = {None: 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
           "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}

P = TypeVar("P", bound=Plugin)

# Every fairness policy type, program-aware-fairness included (it builds on the module of the others).
FAIRNESS_TYPES: dict[str, type[FairnessPolicy]] = {**FAIRNESS_POLICIES,
                                                    ProgramAwareFairness.type_name: ProgramAwareFairness}


@dataclass(frozen=True)
class BandConfig:
    """Limits and policies of one priority band (limits: 0 = unlimited)."""

    priority: int
    max_bytes: int
    max_requests: int
    fairness: FairnessPolicy
    ordering: OrderingPolicy
    # The band's own queue-wait budget in seconds (llm-d.ai/v1's per-band `defaultRequestTTL`; 0: none);
    # None: the global `defaultRequestTTL`.
    request_ttl: float | None = None


@dataclass(frozen=True)
class FlowControlConfig:
    """The resolved `flowControl` section; `band_for` gives the band of any priority."""

    max_bytes: int = 0
    max_requests: int = 0
    default_request_ttl: float = 0.0
    usage_limit: UsageLimitPolicy = field(default_factory=lambda: USAGE_LIMIT_POLICIES[DEFAULT_USAGE_LIMIT_POLICY]())
    default_band: BandConfig = field(default_factory=lambda: BandConfig(
        0, DEFAULT_BAND_MAX_BYTES, 0, FAIRNESS_POLICIES[DEFAULT_FAIRNESS_POLICY](),
        ORDERING_POLICIES[DEFAULT_ORDERING_POLICY]()))
    bands: tuple[BandConfig, ...] = ()
    # llm-d's `enableEviction`: evict in-flight sheddable requests when a higher band is blocked.
    enable_eviction: bool = False

    def band_for(self, priority: int) -> BandConfig:
        """The configured band of `priority`, or the default band's template for it."""
        for band in self.bands:
            if band.priority == priority:
                return band
        d = self.default_band
        return BandConfig(priority, d.max_bytes, d.max_requests, d.fairness, d.ordering, d.request_ttl)

    def ttl_for(self, priority: int) -> float:
        """Seconds a request of `priority` may wait in the queue: its band's budget, else the global one (0: none)."""
        own = self.band_for(priority).request_ttl
        return self.default_request_ttl if own is None else own

    def describe(self) -> list[str]:
        """Readable lines for `epp check-config`."""
        def limits(max_bytes: int, max_requests: int) -> str:
            return (f"maxBytes {max_bytes or 'unlimited'}, maxRequests {max_requests or 'unlimited'}")

        def own_ttl(band: BandConfig) -> str:
            if band.request_ttl is None:
                return ""
            return f"; defaultRequestTTL {band.request_ttl:g}s" if band.request_ttl else "; defaultRequestTTL none"

        ttl = f"{self.default_request_ttl:g}s" if self.default_request_ttl else "none (until the client leaves)"
        lines = [f"global: {limits(self.max_bytes, self.max_requests)}; defaultRequestTTL {ttl}",
                 f"usage limit policy: {self.usage_limit.name} (type {self.usage_limit.type_name}; "
                 f"{self.usage_limit.describe()})"]
        if self.enable_eviction:
            lines.append("eviction: in-flight sheddable requests (priority < 0) are evicted, lowest priority and newest "
                         "first, while a higher band is blocked (429, x-llm-d-request-dropped-reason: evicted)")
        for band in sorted(self.bands, key=lambda b: -b.priority):
            lines.append(f"band priority {band.priority}: {limits(band.max_bytes, band.max_requests)}; "
                         f"fairness {band.fairness.name}, ordering {band.ordering.name}{own_ttl(band)}")
        d = self.default_band
        lines.append(f"other priorities (defaultPriorityBand): {limits(d.max_bytes, d.max_requests)}; "
                     f"fairness {d.fairness.name}, ordering {d.ordering.name}{own_ttl(d)}")
        return lines


def parse_quantity(value: Any, what: str) -> int:
    """A Kubernetes quantity (`1000`, `500M`, `2Gi`) or a non-negative integer, as an integer."""
    if isinstance(value, bool):
        raise ConfigError(f"{what}: must be a non-negative integer or a quantity such as 500M or 2Gi, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"{what}: must be >= 0, got {value}")
        return value
    match = _QUANTITY.match(value.strip()) if isinstance(value, str) else None
    if match is None:
        raise ConfigError(f"{what}: must be a non-negative integer or a quantity such as 500M or 2Gi, got {value!r}")
    return int(float(match.group(1)) * _SUFFIX[match.group(2)])


class _Parser:
    """One parse of a `flowControl` section; errors name `source`, the field path and what is allowed."""

    def __init__(self, source: str, plugins: Mapping[str, Plugin]) -> None:
        self.source = source
        self.plugins = plugins
        self.builtins: dict[str, Plugin] = {}  # one instance per policy type named directly

    def fail(self, path: str, message: str) -> ConfigError:
        return ConfigError(f"{self.source}: {path}: {message}")

    def mapping(self, raw: Any, path: str, allowed: tuple[str, ...]) -> Mapping[str, Any]:
        if raw is None:
            return {}
        if not isinstance(raw, dict):
            raise self.fail(path, f"must be a mapping with fields {list(allowed)}, got {type(raw).__name__}")
        for key in raw:
            if key not in allowed:
                raise self.fail(f"{path}.{key}", f"unknown field; allowed fields: {', '.join(allowed)}")
        return raw

    def quantity(self, item: Mapping[str, Any], key: str, path: str, default: int) -> int:
        if item.get(key) is None:
            return default
        try:
            return parse_quantity(item[key], f"{self.source}: {path}.{key}")
        except ConfigError:
            raise
        except (ValueError, OverflowError):
            raise self.fail(f"{path}.{key}", f"not a quantity: {item[key]!r}") from None

    def policy(self, raw: Any, path: str, kind: type[P], catalogue: Mapping[str, type[P]], what: str) -> P:
        if not isinstance(raw, str) or not raw:
            raise self.fail(path, f"must be the name of a {what} plugin or type, got {raw!r}")
        configured = self.plugins.get(raw)
        if configured is not None:
            if not isinstance(configured, kind):
                article = "an" if what[0] in "aeiou" else "a"
                raise self.fail(path, f"plugin {raw!r} (type {configured.type_name}) is not {article} {what}; allowed "
                                      f"types: {', '.join(catalogue)}")
            return configured
        if raw in catalogue:
            builtin = self.builtins.get(raw)
            if builtin is None:
                builtin = self.builtins[raw] = catalogue[raw]()
            if isinstance(builtin, kind):  # a type name stands for one kind of policy only
                return builtin
        raise self.fail(path, f"unknown {what} {raw!r}; allowed: a plugin of type {', '.join(catalogue)}, "
                              "or one of those type names")

    def band(self, raw: Any, path: str, fields: tuple[str, ...], template: BandConfig | None) -> BandConfig:
        item = self.mapping(raw, path, fields)
        priority = 0
        if "priority" in fields:
            raw_priority = item.get("priority")
            if not isinstance(raw_priority, int) or isinstance(raw_priority, bool):
                raise self.fail(f"{path}.priority", f"is required and must be an integer, got {raw_priority!r}")
            priority = raw_priority
        fairness = (self.policy(item["fairnessPolicyRef"], f"{path}.fairnessPolicyRef", FairnessPolicy,
                                FAIRNESS_TYPES, "fairness policy")
                    if item.get("fairnessPolicyRef") is not None
                    else template.fairness if template else self.policy(
                        DEFAULT_FAIRNESS_POLICY, path, FairnessPolicy, FAIRNESS_TYPES, "fairness policy"))
        ordering = (self.policy(item["orderingPolicyRef"], f"{path}.orderingPolicyRef", OrderingPolicy,
                                ORDERING_POLICIES, "ordering policy")
                    if item.get("orderingPolicyRef") is not None
                    else template.ordering if template else self.policy(
                        DEFAULT_ORDERING_POLICY, path, OrderingPolicy, ORDERING_POLICIES, "ordering policy"))
        max_bytes = self.quantity(item, "maxBytes", path, template.max_bytes if template else DEFAULT_BAND_MAX_BYTES)
        max_requests = self.quantity(item, "maxRequests", path, template.max_requests if template else 0)
        request_ttl = self.duration(item.get("defaultRequestTTL"), f"{path}.defaultRequestTTL")
        return BandConfig(priority, max_bytes, max_requests, fairness, ordering, request_ttl)

    def duration(self, raw: Any, path: str) -> float | None:
        """A queue-wait budget in seconds (`30s`, `1m30s` or a number; 0: none), None when absent."""
        if raw is None:
            return None
        if isinstance(raw, str):
            return parse_duration(raw, what=f"{self.source}: {path}")
        if isinstance(raw, (int, float)) and not isinstance(raw, bool) and raw >= 0:
            return float(raw)
        raise self.fail(path, f"must be a duration such as 30s, got {raw!r}")

    def parse(self, raw: Any) -> FlowControlConfig:
        item = self.mapping(raw, "flowControl", FLOW_CONTROL_FIELDS)
        ttl_s = self.duration(item.get("defaultRequestTTL"), "flowControl.defaultRequestTTL") or 0.0
        usage_ref = item.get("usageLimitPolicyPluginRef") or DEFAULT_USAGE_LIMIT_POLICY
        usage = self.policy(usage_ref, "flowControl.usageLimitPolicyPluginRef", UsageLimitPolicy,
                            USAGE_LIMIT_POLICIES, "usage limit policy")
        default_band = self.band(item.get("defaultPriorityBand"), "flowControl.defaultPriorityBand",
                                 DEFAULT_BAND_FIELDS, None)
        raw_bands = item.get("priorityBands")
        if raw_bands is not None and not isinstance(raw_bands, list):
            raise self.fail("flowControl.priorityBands", f"must be a list of bands, got {type(raw_bands).__name__}")
        bands: list[BandConfig] = []
        for i, raw_band in enumerate(raw_bands or ()):
            path = f"flowControl.priorityBands[{i}]"
            band = self.band(raw_band, path, BAND_FIELDS, None)
            if any(b.priority == band.priority for b in bands):
                raise self.fail(f"{path}.priority", f"priority {band.priority} has two bands; allowed: one per priority")
            bands.append(band)
        eviction = item.get("enableEviction", False)
        if not isinstance(eviction, bool):
            raise self.fail("flowControl.enableEviction", f"must be true or false, got {eviction!r}")
        return FlowControlConfig(
            enable_eviction=eviction,
            max_bytes=self.quantity(item, "maxBytes", "flowControl", 0),
            max_requests=self.quantity(item, "maxRequests", "flowControl", 0),
            default_request_ttl=ttl_s, usage_limit=usage, default_band=default_band, bands=tuple(bands))


def parse_flow_control(raw: Any, *, source: str = "<config>", plugins: Mapping[str, Plugin] | None = None
                       ) -> FlowControlConfig:
    """The `flowControl` section (None = every default) with policy refs resolved against `plugins`."""
    return _Parser(source, plugins or {}).parse(raw)


def register(registry: PluginRegistry) -> None:
    """Entry point of the `epp.plugins` group: the flow-control policies and the saturation detectors here."""
    for catalogue in (ORDERING_POLICIES, FAIRNESS_TYPES, USAGE_LIMIT_POLICIES):
        for cls in catalogue.values():
            registry.register_class(cls)
    registry.register_class(PrefillBacklogDetector)
    registry.register_class(ConcurrencyDetector)
