"""Is a contender's row a fair measurement of its router? Checked from the router's own counters.

A cache-aware router whose index stayed empty (its KV events never arrived, its policy never
ran) measures our setup, not its design: vllm-router's kv_aware once ran with 0 placement hits
for 364 lookups because its replicas published on a topic it drops. Each check reads the
counters the router exports at the end of the run and says `valid`, `invalid` (the row is not
compared: the report lists it apart) or `unverified` (no counters to read).

- vllm-router: `vllm_router_policy_decisions_total{policy=P}` or
  `vllm_router_prefix_routing_decisions_total{policy=P}` must cover the requests (the policy
  ran); kv_aware needs `vllm_router_kv_placement_lookups_total{result="hit"}` > 0 and
  cache_aware `prefix_routing_decisions_total{outcome="prefix_hit"}` > 0 whenever the oracle
  says there was something to reuse. Both tokenize through the replicas' `/v1/completions/render`
  (vLLM serves it only with `--enable-scale-out`, 403 otherwise): more than 10 % of
  `vllm_router_kv_routing_inputs_total{result="preparation_rejected"}` makes the row invalid
  (the router routed without tokens).
- sglang-router: `smg_worker_selection_total{policy=P}` must cover the requests.
- our precise contenders: `epp_kv_index_events_applied_total` > 0, and lookup hit blocks > 0
  when there was something to reuse (the same standard as kv_aware).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from bench.routing.contenders import Contender
from bench.routing.summary import ContenderResult

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
COVERAGE = 0.9  # a policy must have decided at least this share of the requests sent


@dataclass(frozen=True, slots=True)
class Validity:
    """The verdict on one row: 'valid', 'invalid' or 'unverified', and what the counters said."""

    verdict: str
    detail: str

    @property
    def compared(self) -> bool:
        """Whether the row may stand in the comparison tables."""
        return self.verdict != "invalid"


def metric_sum(samples: dict[str, float], name: str, **labels: str) -> float | None:
    """Sum of the samples of `name` whose labels include `labels`; None when there is no such sample."""
    total, seen = 0.0, False
    for key, value in samples.items():
        m = _SAMPLE.match(key)
        if not m or m.group(1) != name:
            continue
        have = dict(_LABEL.findall(m.group(2) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            total += value
            seen = True
    return total if seen else None


def check(contender: Contender, result: ContenderResult) -> Validity:
    """The validity of `result` for `contender` (see the module docstring)."""
    o = result.overall
    if o is None:
        return Validity("invalid", result.status)
    m = result.router_metrics
    reuse = (o.oracle_hit_rate or 0.0) > 0.0
    if contender.kind == "vllm-router":
        policy = contender.variant
        decided = max(metric_sum(m, "vllm_router_policy_decisions_total", policy=policy) or 0.0,
                      metric_sum(m, "vllm_router_prefix_routing_decisions_total", policy=policy) or 0.0)
        if not m:
            return Validity("unverified", "no router counters could be read")
        if decided < COVERAGE * o.requests:
            return Validity("invalid", f"policy {policy} decided {decided:g} of {o.requests} requests")
        inputs = metric_sum(m, "vllm_router_kv_routing_inputs_total") or 0.0
        rejected = metric_sum(m, "vllm_router_kv_routing_inputs_total", result="preparation_rejected") or 0.0
        if inputs and rejected > (1 - COVERAGE) * inputs:
            return Validity("invalid", f"the replicas rejected {rejected:g} of its {inputs:g} tokenization requests "
                                       "(vLLM answers /v1/completions/render 403 without --enable-scale-out)")
        if policy == "kv_aware":
            hits = metric_sum(m, "vllm_router_kv_placement_lookups_total", result="hit") or 0.0
            misses = metric_sum(m, "vllm_router_kv_placement_lookups_total", result="miss") or 0.0
            if reuse and hits == 0:
                return Validity("invalid", f"0 placement hits for {misses:g} lookups: its KV index stayed empty")
            return Validity("valid", f"{hits:g} placement hits / {hits + misses:g} lookups")
        if policy == "cache_aware":
            hits = metric_sum(m, "vllm_router_prefix_routing_decisions_total", policy=policy,
                              outcome="prefix_hit") or 0.0
            if reuse and hits == 0:
                return Validity("invalid", f"0 prefix hits in {decided:g} decisions: its tree never matched")
            return Validity("valid", f"{hits:g} prefix hits / {decided:g} decisions")
        return Validity("valid", f"{policy} decided {decided:g} requests")
    if contender.kind == "sglang-router":
        if not m:
            return Validity("unverified", "no router counters could be read")
        decided = metric_sum(m, "smg_worker_selection_total", policy=contender.variant) or 0.0
        if decided < COVERAGE * o.requests:
            return Validity("invalid", f"policy {contender.variant} selected {decided:g} of {o.requests} requests")
        return Validity("valid", f"{contender.variant} selected {decided:g} requests (no hit counter exported)")
    if contender.kind == "epp" and contender.variant.startswith("precise"):
        applied = metric_sum(m, "epp_kv_index_events_applied_total")
        if applied is None:
            return Validity("unverified", "no index counters could be read")
        hit_blocks = metric_sum(m, "epp_kv_index_lookup_hit_blocks_total") or 0.0
        if applied == 0 or (reuse and hit_blocks == 0):
            return Validity("invalid", f"{applied:g} KV events applied, {hit_blocks:g} lookup hit blocks")
        return Validity("valid", f"{applied:g} KV events applied, {hit_blocks:g} lookup hit blocks")
    return Validity("valid", "nothing to check (no cache index)")


__all__ = ["COVERAGE", "Validity", "check", "metric_sum"]
