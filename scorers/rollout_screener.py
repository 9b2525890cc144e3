"""`disaggregatedset-rollout-screener` (llm-d): during a DisaggregatedSet rollout, one revision per request.

A DisaggregatedSet revision is one version of every role (prefill, decode...): its pods carry the
same `disaggregatedset.x-k8s.io/revision` label. Prefill and decode pods of different revisions
must not serve one request (their KV-cache formats or transfer stacks may differ). Before any
profile runs (it is a capacity gate here: the candidates it returns are every profile's), the
screener keeps the endpoints of `scope.labelSelector`, drops the revisions that lack a Ready
endpoint of some required role, chooses one of the rest at random by weight, and hands on only
that revision's endpoints:

- `max-role`: the role with the most Ready endpoints over the covered revisions (ties: the first
  required role) is the dominant one; a revision weighs its count of that role.
- `sum`: a revision weighs its Ready endpoints of every required role together.
- `disabled`: no coverage check, no choice: every candidate goes on (header selectors still act).

No covered revision fails closed: 503. `headerSelectors` map a request header to an endpoint label:
`strict` keeps only endpoints whose label equals the request's header (none: 503); `prefer` only
stamps. Every selector stamps its header on the response from the label of the endpoint that served.
Metrics: `epp_disaggregatedset_strict_header_no_match_total{selector}` and
`epp_disaggregatedset_revision_gating_share{plugin,revision}` (a revision's series goes when its
endpoints go; at most `MAX_REVISIONS` revisions are reported).
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from epp.framework import (
    CapacityGate,
    ConfigError,
    CycleState,
    Endpoint,
    ErrorCode,
    InferenceError,
    InferenceRequest,
    PluginContext,
    PluginParams,
    PluginRegistry,
    ResponseHeadersHook,
    ResponseInfo,
    once_per_registry,
)

REVISION_LABEL = "disaggregatedset.x-k8s.io/revision"
ROLE_LABEL = "disaggregatedset.x-k8s.io/role"
GATING_MODES = ("max-role", "sum", "disabled")
SELECTOR_MODES = ("strict", "prefer")
# Revisions coexist only during a rollout (two, rarely three); the share gauge keeps at most this many.
MAX_REVISIONS = 16


def parse_selector(text: str, where: str) -> dict[str, str]:
    """`k=v,k2=v2` (equality only) into labels; ConfigError naming `where` otherwise."""
    labels: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("==") if "==" in part else part.partition("=")
        if not sep or not key.strip() or "!" in key:
            raise ConfigError(f"{where}: {part!r} is not key=value (only equality selectors are supported)")
        labels[key.strip()] = value.strip()
    if not labels:
        raise ConfigError(f"{where}: at least one key=value is required")
    return labels


@dataclass(frozen=True)
class HeaderSelector:
    """One request header <-> endpoint label mapping."""

    name: str
    header: str
    label: str
    strict: bool


class _Metrics:
    def __init__(self, registry: CollectorRegistry | None) -> None:
        kw: dict[str, Any] = {"registry": registry}
        self.no_match = Counter("epp_disaggregatedset_strict_header_no_match",
                                "Requests whose strict header selector matched no endpoint (answered 503)",
                                ["selector"], **kw)
        self.share = Gauge("epp_disaggregatedset_revision_gating_share",
                           "Share of requests a DisaggregatedSet revision receives (0 while it lacks a role)",
                           ["plugin", "revision"], **kw)


class DisaggregatedSetRolloutScreener(CapacityGate, ResponseHeadersHook):
    """Keeps one covered DisaggregatedSet revision's endpoints per request (every profile sees only those)."""

    type_name = "disaggregatedset-rollout-screener"

    def __init__(self, name: str, params: PluginParams, context: PluginContext) -> None:
        super().__init__(name)
        where = f"plugin {name!r}: parameter"
        scope = params.mapping("scope", None) or {}
        if not isinstance(scope.get("labelSelector"), str):
            raise ConfigError(f"{where} 'scope.labelSelector' is required (the pods of the DisaggregatedSet)")
        if set(scope) - {"labelSelector"}:
            raise ConfigError(f"{where} 'scope': unknown field(s) {sorted(set(scope) - {'labelSelector'})}")
        self.scope = parse_selector(scope["labelSelector"], f"{where} 'scope.labelSelector'")
        gating = params.mapping("revisionGating", None)
        if gating is None:
            raise ConfigError(f"{where} 'revisionGating' is required (mode: max-role, sum or disabled)")
        allowed = {"mode", "requireRoles", "requiredRoles", "revisionLabelKey", "roleLabelKey"}
        if set(gating) - allowed:
            raise ConfigError(f"{where} 'revisionGating': unknown field(s) {sorted(set(gating) - allowed)}; "
                              f"allowed: {', '.join(sorted(allowed))}")
        self.mode = gating.get("mode")
        if self.mode not in GATING_MODES:
            raise ConfigError(f"{where} 'revisionGating.mode' must be one of {list(GATING_MODES)}, got {self.mode!r}")
        self.revision_label = str(gating.get("revisionLabelKey") or REVISION_LABEL)
        self.role_label = str(gating.get("roleLabelKey") or ROLE_LABEL)
        self.roles = self._roles(gating, where)
        self.selectors = self._selectors(params.list("headerSelectors", None) or [], where)
        self._random = random.Random()
        self.metrics = once_per_registry(context.metrics_registry, "epp_disaggregatedset", _Metrics)
        self._reported: set[str] = set()

    def _roles(self, gating: Mapping[str, Any], where: str) -> tuple[str, ...]:
        # llm-d's `requireRoles: {values: [...]}`; the guides also write `requiredRoles: [...]`.
        listed = gating.get("requiredRoles")
        nested = gating.get("requireRoles")
        if listed is not None and nested is not None:
            raise ConfigError(f"{where} 'revisionGating': set requireRoles or requiredRoles, not both")
        if nested is not None:
            if not isinstance(nested, dict) or set(nested) - {"values"}:
                raise ConfigError(f"{where} 'revisionGating.requireRoles' must be {{values: [roles]}}, got {nested!r}")
            listed = nested.get("values")
        roles = tuple(listed or ())
        if not all(isinstance(r, str) and r for r in roles) or len(set(roles)) != len(roles):
            raise ConfigError(f"{where} 'revisionGating.requireRoles.values' must be distinct role names, got "
                              f"{list(roles)!r}")
        if self.mode != "disabled" and not roles:
            raise ConfigError(f"{where} 'revisionGating.requireRoles.values' is required with mode {self.mode}")
        return roles

    def _selectors(self, raw: list[Any], where: str) -> tuple[HeaderSelector, ...]:
        selectors = []
        for i, item in enumerate(raw):
            path = f"{where} 'headerSelectors[{i}]'"
            if not isinstance(item, dict) or set(item) - {"name", "headerName", "labelKey", "mode"}:
                raise ConfigError(f"{path} must be {{name, headerName, labelKey, mode}}, got {item!r}")
            if not all(isinstance(item.get(k), str) and item[k] for k in ("name", "headerName", "labelKey")):
                raise ConfigError(f"{path}: name, headerName and labelKey are required strings")
            if item.get("mode", "strict") not in SELECTOR_MODES:
                raise ConfigError(f"{path}.mode must be strict or prefer, got {item.get('mode')!r}")
            selectors.append(HeaderSelector(item["name"], item["headerName"].lower(), item["labelKey"],
                                            item.get("mode", "strict") == "strict"))
        return tuple(selectors)

    def describe(self) -> str:
        scope = ",".join(f"{k}={v}" for k, v in self.scope.items())
        roles = ",".join(self.roles) or "-"
        return f"scope={scope} mode={self.mode} roles={roles} headerSelectors={len(self.selectors)}"

    # ---- screening -----------------------------------------------------------------------------
    def _in_scope(self, endpoint: Endpoint) -> bool:
        return all(endpoint.labels.get(k) == v for k, v in self.scope.items())

    def shares(self, endpoints: Sequence[Endpoint]) -> dict[str, float]:
        """Each observed revision's share of requests (0 for one that lacks a required role)."""
        counts: dict[str, dict[str, int]] = {}
        for ep in endpoints:
            revision = ep.labels.get(self.revision_label)
            if revision is None or not self._in_scope(ep):
                continue
            role = ep.labels.get(self.role_label, "")
            by_role = counts.setdefault(revision, {})
            by_role[role] = by_role.get(role, 0) + 1
        covered = {rev: roles for rev, roles in counts.items() if all(roles.get(r, 0) for r in self.roles)}
        if self.mode == "max-role":
            totals = {r: sum(roles.get(r, 0) for roles in covered.values()) for r in self.roles}
            dominant = max(self.roles, key=lambda r: (totals[r], -self.roles.index(r)))
            weights = {rev: float(roles.get(dominant, 0)) for rev, roles in covered.items()}
        else:
            weights = {rev: float(sum(roles.get(r, 0) for r in self.roles)) for rev, roles in covered.items()}
        total = sum(weights.values())
        return {rev: (weights.get(rev, 0.0) / total if total else 0.0) for rev in counts}

    async def ensure_capacity(self, state: CycleState, request: InferenceRequest,
                              candidates: Sequence[Endpoint]) -> Sequence[Endpoint]:
        kept = list(candidates)
        for selector in self.selectors:
            wanted = request.headers.get(selector.header)
            if not selector.strict or wanted is None:
                continue
            kept = [ep for ep in kept if ep.labels.get(selector.label) == wanted]
            if not kept:
                self.metrics.no_match.labels(selector.name).inc()
                raise InferenceError(ErrorCode.SERVICE_UNAVAILABLE, f"no endpoint has {selector.label}={wanted} "
                                     f"(strict header {selector.header})")
        if self.mode == "disabled":
            return kept
        shares = self.shares(kept)
        self._report(shares)
        covered = [rev for rev, share in shares.items() if share > 0]
        if not covered:
            raise InferenceError(ErrorCode.SERVICE_UNAVAILABLE, "no DisaggregatedSet revision has a Ready endpoint "
                                 f"of every role {list(self.roles)}")
        revision = self._random.choices(covered, weights=[shares[r] for r in covered])[0]
        return [ep for ep in kept if self._in_scope(ep) and ep.labels.get(self.revision_label) == revision]

    def _report(self, shares: Mapping[str, float]) -> None:
        shown = dict(sorted(shares.items())[:MAX_REVISIONS])
        for revision in self._reported - set(shown):
            self.metrics.share.remove(self.name, revision)
        for revision, share in shown.items():
            self.metrics.share.labels(self.name, revision).set(share)
        self._reported = set(shown)

    def on_response_headers(self, state: CycleState, request: InferenceRequest, response: ResponseInfo,
                            target: Endpoint | None) -> None:
        if target is None:
            return
        for selector in self.selectors:
            value = target.labels.get(selector.label)
            if value is not None:
                response.set_headers[selector.header] = value


def register(registry: PluginRegistry) -> None:
    """Entry point of the `epp.plugins` group: registers the rollout screener."""
    registry.register_class(DisaggregatedSetRolloutScreener)
