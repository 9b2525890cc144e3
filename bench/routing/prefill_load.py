"""How hard a run loaded the fleet's prefill: offered uncached prompt tokens/s over the fleet's prefill throughput.

Everything comes from what a user of a real deployment can know, never from the simulator's
profile: the prompt tokens the replicas reported (`usage.prompt_tokens`), the share of them no
router could have served from cache (1 - the oracle hit rate, computed from the requests' shared
prefixes), and the prefill cost per token that the self-calibrating `predicted-ttft-scorer` of an
`epp-*` contender learned from the replicas' first-token times in the same run
(`epp_ttft_calibration{term="prefill_seconds_per_token"}`, the median over the replicas).

    share = prompt tokens x (1 - oracle hit rate) / seconds the load was offered in
            x learned prefill seconds per token / replicas

The busiest 10 s of sends are shown too (at the run's oracle hit rate): a trace's load is not
steady. A share of 1 means the replicas would spend all their time prefilling even with perfect reuse.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from bench.routing.summary import ContenderResult, StageSummary

_PREFILL_TERM = re.compile(r'^epp_ttft_calibration\{.*term="prefill_seconds_per_token"')


@dataclass(frozen=True)
class PrefillLoad:
    """One stage's (or the run's) offered prefill against the fleet's learned prefill throughput."""

    label: str
    uncached_tokens_per_s: float
    fleet_tokens_per_s: float
    peak_uncached_tokens_per_s: float = 0.0  # in the busiest 10 s of sends

    @property
    def share(self) -> float:
        return self.uncached_tokens_per_s / self.fleet_tokens_per_s

    @property
    def peak_share(self) -> float:
        return self.peak_uncached_tokens_per_s / self.fleet_tokens_per_s


def learned_prefill_s_per_token(results: Sequence[ContenderResult]) -> tuple[str, float] | None:
    """(contender, median learned prefill seconds per token over its replicas) of the first calibrating contender."""
    for r in results:
        values = [v for k, v in r.router_metrics.items() if _PREFILL_TERM.match(k) and v > 0]
        if values:
            return r.name, statistics.median(values)
    return None


def prefill_load(summary: StageSummary, replicas: int, s_per_token: float) -> PrefillLoad | None:
    """The stage's offered uncached prefill against `replicas` replicas of `1 / s_per_token` tokens/s each."""
    if summary.sent_span_s <= 0 or not summary.prompt_tokens or s_per_token <= 0 or replicas < 1:
        return None
    reusable = summary.oracle_hit_rate or 0.0
    uncached = summary.prompt_tokens * (1.0 - reusable)
    return PrefillLoad(summary.label, uncached / summary.sent_span_s, replicas / s_per_token,
                       summary.peak_prompt_tokens_per_s * (1.0 - reusable))


def prefill_load_lines(results: Sequence[ContenderResult], replicas: int) -> list[str]:
    """Report lines: the offered prefill load per stage, as a share of the fleet's learned prefill throughput."""
    learned = learned_prefill_s_per_token(results)
    measured = next((r for r in results if r.overall is not None and r.overall.prompt_tokens), None)
    if learned is None or measured is None:
        return ["Prefill load: not measured (needs a self-calibrating `epp-*-ttft` contender in the run).", ""]
    source, s_per_token = learned
    lines = [(f"Prefill load (offered uncached prompt tokens/s, i.e. prompt tokens x (1 - oracle hit rate), over "
              f"the fleet's prefill throughput, {replicas} replicas x 1 / {s_per_token * 1e6:.1f} µs per token as "
              f"`{source}` learned it; requests as `{measured.name}` sent them):"), "",
             "| stage | uncached prompt tokens/s | fleet prefill tokens/s | share of prefill capacity "
             "| share in the busiest 10 s |", "|---|---|---|---|---|"]
    rows = measured.stages + ([measured.overall] if len(measured.stages) > 1 else [])
    for summary in rows:
        load = prefill_load(summary, replicas, s_per_token)
        if load is not None:
            lines.append(f"| {load.label} | {load.uncached_tokens_per_s:,.0f} | {load.fleet_tokens_per_s:,.0f} "
                         f"| {load.share:.0%} | {load.peak_share:.0%} |")
    return [*lines, ""]
