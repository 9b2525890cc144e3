"""Cached-token accounting: per model and tenant, prompt tokens by where they came from, reported and predicted.

On every finished request with a usage block, two views are counted:

- **reported**: `usage.prompt_tokens` split by `usage.prompt_tokens_details.cached_tokens` (vLLM
  sends it only with `--enable-prompt-tokens-details`; `epp engine serve` turns it on) into
  `cached` and `computed`, or `unknown` when the details are missing;
- **predicted**: what the picker believed when it chose the endpoint: tokens cached in the GPU
  prefix cache, the CPU tier and the disk tier (precise mode's tier match; approximate mode
  predicts GPU hits only), the rest computed.

The gap between predicted and reported cached tokens (over / under) measures how true the
picker's view of the caches is. Labels are bounded: at most `max_models` model names and
`max_tenants` tenants, the rest counted under `__other__`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter

from epp.framework.datakeys import PREFIX_MATCH_INFO, PREFIX_TIER_MATCH, PrefixMatchInfo, TierMatch
from epp.framework.plugin import CycleState, ResponseCompleteHook
from epp.framework.types import Endpoint, InferenceRequest, ResponseInfo
from epp.metrics import BoundedLabels

TIERS = ("gpu", "cpu", "disk")
TENANT_SOURCES = ("fairness", "objective", "header", "none")


def parse_tenant_source(text: str) -> tuple[str, str | None]:
    """`fairness`, `objective`, `none` or `header:<name>` → (source, header name)."""
    source, _, header = text.partition(":")
    if source not in TENANT_SOURCES or (source == "header") != bool(header):
        raise ValueError(f"tenant source must be fairness, objective, none or header:<name>, got {text!r}")
    return source, header.lower() or None


def predicted_tiers(state: CycleState, endpoint: str, prompt_tokens: int) -> tuple[int, int, int]:
    """(gpu, cpu, disk) prompt tokens the picker expected cached on `endpoint`, capped at the prompt."""
    tier: TierMatch | None = state.endpoint_data(PREFIX_TIER_MATCH, endpoint)
    if tier is not None:
        gpu, cpu, disk = tier.gpu_tokens, tier.cpu_tokens, tier.disk_tokens
    else:
        info: PrefixMatchInfo | None = state.endpoint_data(PREFIX_MATCH_INFO, endpoint)
        gpu = int(info.matched_blocks * info.block_size_tokens) if info is not None else 0
        cpu = disk = 0
    gpu = min(gpu, prompt_tokens)
    cpu = min(cpu, prompt_tokens - gpu)
    disk = min(disk, prompt_tokens - gpu - cpu)
    return gpu, cpu, disk


class TokenAccounting(ResponseCompleteHook):
    """Counts prompt tokens (cached by tier / computed) and output tokens per model and tenant."""

    type_name = "token-accounting"

    def __init__(self, registry: CollectorRegistry, *, tenant_source: str = "fairness",
                 max_models: int = 100, max_tenants: int = 100, on_prefill=None,
                 label_value: Callable[[str], str] | None = None) -> None:
        super().__init__("token-accounting")
        self.source, self.header = parse_tenant_source(tenant_source)
        # Model names and tenants are client-chosen: `label_value` bounds their length and encoding.
        self.model_label = BoundedLabels(max_models, label_value)
        self.tenant_label = BoundedLabels(max_tenants, label_value)
        # Called with (endpoint, computed prompt tokens) for the pool's prefill-demand gauge.
        self.on_prefill = on_prefill
        self.reported = Counter(
            "epp_prompt_tokens_reported", "Prompt tokens by the model server's usage: cached, computed, or "
            "unknown (no prompt_tokens_details).", ["model", "tenant", "kind"], registry=registry)
        self.predicted = Counter(
            "epp_prompt_tokens_predicted", "Prompt tokens by where the picker expected them: gpu, cpu, disk "
            "(cached tiers) or computed.", ["model", "tenant", "tier"], registry=registry)
        self.output = Counter("epp_output_tokens", "Completion tokens reported by the model server.",
                              ["model", "tenant"], registry=registry)
        self.prediction_error = Counter(
            "epp_cached_tokens_prediction_error", "Predicted minus reported cached tokens, summed by sign "
            "(over: the picker expected more cache hits than the server had).",
            ["model", "tenant", "direction"], registry=registry)
        self.requests = Counter(
            "epp_accounted_requests", "Finished requests by what their usage reported: details, no_details, "
            "none.", ["model", "tenant", "usage"], registry=registry)
        # Label children looked up once: this hook runs per request. Bounded by the label caps above.
        self._children: dict[tuple[int, str, str, str], Any] = {}

    def _child(self, metric: Counter, model: str, tenant: str, kind: str = "") -> Any:
        key = (id(metric), model, tenant, kind)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(model, tenant, kind) if kind else metric.labels(model, tenant)
        return child

    def tenant_of(self, request: InferenceRequest) -> str:
        """The request's tenant under the configured source ("" when none)."""
        if self.source == "fairness":
            return request.fairness_id
        if self.source == "objective":
            return request.objective or ""
        if self.source == "header" and self.header:
            return request.headers.get(self.header, "")
        return ""

    def on_response_complete(self, state: CycleState, request: InferenceRequest, response: ResponseInfo,
                             target: Endpoint | None) -> None:
        model = self.model_label(request.target_model)
        tenant = self.tenant_label(self.tenant_of(request))
        usage = response.usage
        prompt = usage.get("prompt_tokens", usage.get("input_tokens")) if usage else None
        if not isinstance(prompt, int) or isinstance(prompt, bool) or prompt < 0:
            self._child(self.requests, model, tenant, "none").inc()
            return
        assert usage is not None
        output = usage.get("completion_tokens", usage.get("output_tokens"))
        if isinstance(output, int) and not isinstance(output, bool) and output > 0:
            self._child(self.output, model, tenant).inc(output)
        details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        reported_cached: int | None = None
        if isinstance(cached, int) and not isinstance(cached, bool) and 0 <= cached <= prompt:
            reported_cached = cached
            self._child(self.requests, model, tenant, "details").inc()
            self._child(self.reported, model, tenant, "cached").inc(cached)
            self._child(self.reported, model, tenant, "computed").inc(prompt - cached)
        else:
            self._child(self.requests, model, tenant, "no_details").inc()
            self._child(self.reported, model, tenant, "unknown").inc(prompt)
        gpu, cpu, disk = predicted_tiers(state, target.name, prompt) if target is not None else (0, 0, 0)
        predicted_cached = gpu + cpu + disk
        for tier, tokens in zip(TIERS, (gpu, cpu, disk)):
            if tokens:
                self._child(self.predicted, model, tenant, tier).inc(tokens)
        self._child(self.predicted, model, tenant, "computed").inc(prompt - predicted_cached)
        if reported_cached is not None:
            gap = predicted_cached - reported_cached
            if gap:
                self._child(self.prediction_error, model, tenant, "over" if gap > 0 else "under").inc(abs(gap))
        if self.on_prefill is not None and target is not None:
            computed = prompt - (reported_cached if reported_cached is not None else predicted_cached)
            self.on_prefill(target, computed)
