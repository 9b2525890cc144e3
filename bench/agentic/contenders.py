"""The routers the agentic benchmark compares, beside the routing benchmark's own contenders.

- Ours: the recommended pipelines of the routing benchmark (`recommended()`: its default `epp-*`
  contenders but the random and load-only references) and `epp-agentic`
  (examples/configs/agentic.yaml, its `cpuTierTokens` set to the fleet's CPU tier: what an
  operator who knows the offload size configures).
- llm-d's guide pipelines, loaded through our loader: `llmd-agentic` (bench/agentic/configs/
  llmd-agentic.yaml, written from the agentic-serving guide's facts) and `llmd-optimized-baseline`
  (the routing benchmark's, where it is registered). A pipeline our loader refuses is reported
  unavailable with the loader's reason (`refusal`), and runs once the loader takes it.
- The peers' session-affinity policies (vllm-router 0.1.17: `consistent_hash`,
  `sticky_least_loaded`, kv_aware with its session affinity, program scheduling; sglang-router
  0.3.2: `manual` with min-load assignment) beside their cache-aware ones. These read the session
  from their own header (vllm-router: `x-session-id` first; sglang-router: `x-smg-routing-key`), not
  from the agents' headers, so the replay adds that header for them (`ALIASES`), as a gateway in
  front of them would; every contender gets the same request bodies.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from bench.routing.contenders import CONTENDERS, Contender, Tuning, epp_config
from bench.routing.experiments import known, lookup
from bench.routing.summary import ContenderResult
from bench.routing.validity import COVERAGE, Validity, check, metric_sum
from epp.config.loader import load_config_text
from epp.framework.errors import ConfigError

CONFIGS = Path(__file__).resolve().parent / "configs"
REFERENCES = ("epp-random", "epp-load")  # default epp contenders that are references, not recommendations
_KV_FLEET = {"kv_topic": "", "enable_scale_out": True}  # what vllm-router's kv_aware needs of the replicas
# vllm-router's program scheduling, taking the agents' own headers (Claude Code, Codex/opencode `session-id`,
# `x-session-id`) as program identity ("auto") and resuming a paused program on another replica when its own is
# full (global_queue, the recommended mode); the rest at its defaults (its reference calibration).
_PROGRAM = json.dumps({"program_scheduling_enable_key": "auto", "global_queue": True}, separators=(",", ":"))

AGENTIC_CONTENDERS: dict[str, Contender] = {c.name: c for c in (
    Contender("epp-agentic", "epp", "sample:agentic",
              "our EPP: examples/configs/agentic.yaml (agent-identity, session-affinity-cost-scorer on learned costs, "
              "LAS flow control with aging), cpuTierTokens = the fleet's CPU tier"),
    Contender("llmd-agentic", "epp", f"file:{CONFIGS / 'llmd-agentic.yaml'}",
              "llm-d's agentic-serving guide pipeline through our loader (agent-identity, program-aware-fairness LAS "
              "0.8/0.2/0.99997 under concurrency-detector, GPU and CPU approximate prefix scorers 4 and 2, queue/kv/"
              "active-request 2, no-hit-lru 1)"),
    Contender("epp-agentic-precise", "epp", "sample:agentic+precise+events",
              "experiment: epp-agentic with the precise prefix producer (KV events, the fleet's tokenizer), the "
              "session scorer reading its sessions' tiers from the events (tierSource: events)"),
    Contender("epp-agentic+llmd-load", "epp", "sample:agentic+llmd-load",
              "experiment: epp-agentic with llm-d's agentic load scorers added (queue, KV utilisation, active requests "
              "2; no-hit-lru 1)"),
    Contender("epp-agentic+no-prefix-scorer", "epp", "sample:agentic+no-prefix-scorer",
              "experiment: epp-agentic without its prefix-cache-scorer (the session scorer's costs price the prefix; "
              "first-turn ties go to the picker's most-free-cache tie-break)"),
    Contender("vllm-router-consistent-hash", "vllm-router", "consistent_hash",
              "vllm-router --policy consistent_hash (session id from x-session-id)"),
    Contender("vllm-router-sticky-least-loaded", "vllm-router", "sticky_least_loaded",
              "vllm-router --policy sticky_least_loaded (a session sticks to the least loaded replica it got)"),
    Contender("vllm-router-kv-aware-session", "vllm-router", "kv_aware",
              "vllm-router --policy kv_aware --kv-aware-session-affinity-ttl-secs 3600 (KV events, session affinity)",
              fleet_options=_KV_FLEET, peer_args=("--kv-aware-session-affinity-ttl-secs", "3600")),
    Contender("vllm-router-program", "vllm-router", "consistent_hash",
              "vllm-router --enable-program-scheduling (agent headers as program identity, global queue; "
              "consistent_hash for requests without one)",
              peer_args=("--enable-program-scheduling", "--program-scheduling-config-json", _PROGRAM)),
    Contender("sglang-router-manual", "sglang-router", "manual",
              "sglang-router --policy manual --assignment-mode min_load (sticky routing key x-smg-routing-key)",
              peer_args=("--assignment-mode", "min_load")),
)}

# Header names that carry the session id for a contender that reads only its own (added by the replay).
ALIASES: dict[str, tuple[str, ...]] = {
    "vllm-router-consistent-hash": ("x-session-id",),
    "vllm-router-sticky-least-loaded": ("x-session-id",),
    "vllm-router-kv-aware-session": ("x-session-id",),
    "vllm-router-program": ("x-session-id",),
    "sglang-router-manual": ("x-smg-routing-key",),
}

PEERS = ("sglang-router-cache-aware", "sglang-router-manual", "vllm-router-cache-aware", "vllm-router-kv-aware",
         "vllm-router-consistent-hash", "vllm-router-sticky-least-loaded", "vllm-router-kv-aware-session",
         "vllm-router-program")
LLMD = ("llmd-agentic", "llmd-optimized-baseline")


def recommended() -> list[str]:
    """Our recommended pipelines in the routing benchmark's default list (the references left out)."""
    return [n for n, c in CONTENDERS.items() if c.default and c.kind == "epp" and n not in REFERENCES]


def default_contenders() -> list[str]:
    """The agentic comparison: round-robin, ours, llm-d's pipelines, the peers."""
    return ["round-robin", *recommended(), "epp-agentic", *LLMD, *PEERS]


def is_ours(name: str) -> bool:
    """One of our pipelines (not a reference, not llm-d's, not a peer)."""
    return name.startswith("epp-") and name not in REFERENCES


def is_peer(name: str) -> bool:
    """Another project's router (not llm-d's pipelines, which run on our picker)."""
    return name.startswith(("vllm-router-", "sglang-router-")) and not name.endswith("-rr")


def resolve(name: str) -> Contender | None:
    """The contender of that name (ours here first, then the routing benchmark's and its experiments); None: unknown."""
    if name in AGENTIC_CONTENDERS:
        return AGENTIC_CONTENDERS[name]
    return lookup(name) if name in known() else None


def known_names() -> list[str]:
    """Every name a run may give."""
    return [*AGENTIC_CONTENDERS, *(n for n in known() if n not in AGENTIC_CONTENDERS)]


def with_cpu_tier(c: Contender, cpu_tier_tokens: int, t: Tuning, workdir: Path) -> Contender:
    """`c` (an epp contender) with every session-affinity-cost-scorer told the replicas' CPU tier size in tokens."""
    doc = yaml.safe_load(epp_config(c.variant, t))
    touched = False
    for entry in doc.get("plugins", []):
        if entry.get("type") == "session-affinity-cost-scorer":
            entry.setdefault("parameters", {})["cpuTierTokens"] = cpu_tier_tokens
            touched = True
    if not touched:
        return c
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / f"{c.name}-config.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return Contender(c.name, c.kind, f"file:{path}", c.description, c.default, dict(c.fleet_options), c.workers,
                     c.pods, c.responses, c.serve_args, c.peer_args)


def validity(c: Contender, row: ContenderResult) -> Validity:
    """bench/routing/validity.py's check; vllm-router's program scheduling decides in its own layer, whose
    admissions (one per request it placed) count beside the fallback policy's decisions."""
    verdict = check(c, row)
    if "--enable-program-scheduling" not in c.peer_args or row.overall is None or not row.router_metrics:
        return verdict
    m = row.router_metrics
    placed = metric_sum(m, "vllm_router_agent_aware_admission_required_tokens_count") or 0.0
    fallback = metric_sum(m, "vllm_router_policy_decisions_total", policy=c.variant) or 0.0
    if placed + fallback < COVERAGE * row.overall.requests:
        return Validity("invalid", f"program scheduling placed {placed:g} and {c.variant} decided {fallback:g} of "
                                   f"{row.overall.requests} requests")
    return Validity("valid", f"program scheduling placed {placed:g} requests, {c.variant} {fallback:g}")


def refusal(c: Contender, t: Tuning) -> str | None:
    """Why our loader refuses an epp contender's config (its own words), or None."""
    if c.kind != "epp":
        return None
    try:
        load_config_text(epp_config(c.variant, t), source=c.name)
    except ConfigError as exc:
        return f"the config loader refuses it: {exc}"
    return None


__all__ = ["AGENTIC_CONTENDERS", "ALIASES", "CONFIGS", "LLMD", "PEERS", "REFERENCES", "default_contenders", "is_ours",
           "is_peer", "known_names", "recommended", "refusal", "resolve", "validity", "with_cpu_tier"]
