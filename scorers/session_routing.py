"""session-affinity-cost-scorer: a session's turn stays where its KV is until moving is predicted to pay.

For each candidate endpoint e the scorer predicts what the turn costs there, in seconds:

    cost(e) = T(e) + D(e) + C(e)   (predicted-ttft-scorer's `cost_terms`, with the tiers below)

    T(e)  the predicted time to first token on e (predicted-ttft-scorer's model, self-calibrated
          from the replicas' own first tokens): the prefill queued ahead of the turn on e, plus
          the prefill of the prompt tokens e does not hold, plus loading those it holds in its CPU
          or disk tier back
    D(e)  displacement, predicted-ttft-scorer's one term (its `displacementWeight`): the turn's new
          GPU blocks on e beyond the blocks the prefix producer sees free there evict cached work,
          read again as often as the fleet's recent prompt tokens hit cache, at e's prefill (or CPU
          load) cost per token. There is no second displacement charge here, so a move is charged
          its evictions once; `displacement: false` leaves D out of this scorer's cost.
    C(e)  crowding (`crowding`, default true): D sees this turn's blocks against what the index holds
          now; C sees the session against the sessions that will come back. The sessions active
          within `activeWindow` (default 120 s) keep their contexts on their homes between turns,
          where no queue shows them (`SessionFootprint`). Adding this session's context (its own
          for a move, the active sessions' mean for a first turn, at least the prompt) to e's sum
          pushes the part beyond e's GPU tokens to its CPU (then disk) tier and the part beyond all
          tiers out: each such token is read again with the fleet's reuse rate, at e's CPU-load (disk:
          disk-load) or prefill cost per token. The home pays none (the session is counted there).
          Without it a first turn saw only queues, alike on every replica while sessions pause, and
          a move only the turn's own blocks (at the agentic knee, with it: 9-13 % of the later turns
          moved instead of 15-19 %, bench/notes/2026-12-round4-measurements.md).

Where the turn's tokens are cached on each endpoint:
- `tierSource: events`: `PREFIX_TIER_MATCH` as the precise producer publishes it from the
  replicas' KV events (GPU, CPU and disk tiers, offload and eviction included): exact.
- `tierSource: history` (default): from this picker's own history. The scorer remembers, per
  session (`SESSION`, from `agent-identity`), the endpoint that served its last turn (its home),
  how many tokens its context holds (the last turn's prompt from its pick on, its prompt and
  output once its response ends) and how many tokens that endpoint has written into its KV
  cache since (the prompt tokens it computed and the output of every request this picker sent
  there). With least-recently-used eviction the session's blocks are still on the GPU while
  the tokens written since fit beside them (`written + context <= GPU tokens`), then in the CPU
  tier (`<= GPU + CPU tokens`), then on disk, then gone. The GPU tier's size is the scraped cache
  size (blocks x block size) or `gpuTierTokens`; `cpuTierTokens` and `diskTierTokens` give the
  offload tiers (0: none). Other endpoints hold what the prefix producer matched there (GPU).
  With no capacity known the home is taken to still hold the context.

The decision (sticky until it pays to move): the session's home h is the turn's default; another
endpoint wins only when its cost is lower than h's by more than the typical error of h's
prediction (the calibration's residual, learned, not a fixed threshold). So a turn waits behind
h's queue while that wait is predicted to cost less than recomputing its uncached part elsewhere
plus what the recompute would evict there, and moves as soon as it is not. A request with no
session (or a session's first turn) is scored on cost alone, costs within the fits' typical error
of the cheapest counting as equal (the predictor's `tiesWithinError`), so calibration noise does
not choose a new session's home. A sub-agent's first turn prefers
its parent's home among equal costs (they share the agent's prefix).

Scores: min cost / cost(e) in (0, 1] (home's cost less the margin), like predicted-ttft-scorer.

Costs come from `ttftScorerName` (a predicted-ttft-scorer of the config, sharing its
calibration) or, without it, from a calibrating predictor of the scorer's own. Bounded: the
session table holds at most `maxSessions` sessions (default 100,000, least recently used out)
and forgets those idle for `sessionTtl` (default 1h); the per-endpoint counters follow the pool;
the active sessions' footprints, as many and idle for at most `activeWindow`.
Metrics: `epp_session_routing_decisions_total{plugin,decision=stay|move|new|none}` and the
tables' `epp_session_table_*{table=<plugin>|<plugin>:active}`.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter

from epp.framework import (
    PREFIX_MATCH_INFO,
    PREFIX_TIER_MATCH,
    PROMPT_TOKENS,
    SESSION,
    ConfigError,
    CycleState,
    Endpoint,
    InferenceRequest,
    Plugin,
    PluginContext,
    PluginParams,
    PluginRegistry,
    PreRequestHook,
    ResponseCompleteHook,
    ResponseInfo,
    SchedulingResult,
    Scorer,
    SessionKey,
    TierMatch,
    estimate_prompt_tokens,
    once_per_registry,
)
from epp.scorers.predicted_ttft import PredictedTTFTScorer
from epp.scorers.session_footprint import SessionFootprint
from epp.scorers.session_table import DEFAULT_CAPACITY, SessionTable

TIER_SOURCES = ("history", "events")
DECISIONS = ("stay", "move", "new", "none")
DEFAULT_SESSION_TTL_S = 3600.0
# A session idle longer than this no longer counts in its home's footprint: on a busy replica its KV has
# mostly aged out of the GPU by then, and an agent that ended never says so.
DEFAULT_ACTIVE_WINDOW_S = 120.0
# A parent's home wins ties among a sub-agent's first-turn candidates by this share of a score.
PARENT_TIE_BREAK = 1e-6


@dataclass(slots=True)
class SessionHome:
    """Where a session's last turn ran and what it left there."""

    endpoint: str
    context_tokens: int = 0  # prompt + output of the last finished turn, or the prompt of one still running (its KV)
    written_at: float = 0.0  # the endpoint's written-token counter when that turn finished
    inflight: int = 0  # turns of the session running now (their KV is certainly resident)


@dataclass(frozen=True, slots=True)
class _Pending:
    """What pre_request recorded for the completion hook."""

    session: str | None
    endpoint: str
    prompt_tokens: int
    cached_tokens: int


def _decisions(registry: CollectorRegistry | None) -> Counter:
    return once_per_registry(registry, "epp_session_routing_decisions", lambda r: Counter(
        "epp_session_routing_decisions", "Turns routed by session-affinity-cost-scorer's pipeline: stay (the "
        "session's home), move (elsewhere), new (a session's first turn), none (no session).",
        ["plugin", "decision"], registry=r))


def _token_count(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


class SessionAffinityCostScorer(Scorer, PreRequestHook, ResponseCompleteHook):
    """Keeps a session on the endpoint holding its KV until the predicted wait there costs more than moving."""

    type_name = "session-affinity-cost-scorer"

    def __init__(self, name: str, params: PluginParams, context: PluginContext) -> None:
        super().__init__(name)
        self.tier_source = params.str("tierSource", "history", choices=TIER_SOURCES)
        self.gpu_tier_tokens = params.int("gpuTierTokens", 0, minimum=0)
        self.cpu_tier_tokens = params.int("cpuTierTokens", 0, minimum=0)
        self.disk_tier_tokens = params.int("diskTierTokens", 0, minimum=0)
        self.displacement = params.bool("displacement", True)
        self.crowding = params.bool("crowding", True)
        active_window_s = params.duration("activeWindow", DEFAULT_ACTIVE_WINDOW_S)
        ttft = params.str("ttftScorerName", None)
        self.refs = {"ttftScorerName": ttft} if ttft else {}
        capacity = params.int("maxSessions", DEFAULT_CAPACITY, minimum=1)
        ttl_s = params.duration("sessionTtl", DEFAULT_SESSION_TTL_S)
        # Without a named predicted-ttft-scorer: a calibrating predictor of its own, learning from the same ledger.
        self.predictor: PredictedTTFTScorer | None = (
            None if ttft else PredictedTTFTScorer(name, PluginParams(name, {}), context))
        self.sessions: SessionTable[SessionHome] = SessionTable(name, capacity=capacity, ttl_s=ttl_s,
                                                                registry=context.metrics_registry)
        self.footprint = SessionFootprint(name, window_s=active_window_s, capacity=capacity,
                                          registry=context.metrics_registry)
        # Tokens written into each endpoint's KV cache by this picker's requests (monotonic).
        self.written: dict[str, float] = {}
        counter = _decisions(context.metrics_registry)
        self._decisions = {d: counter.labels(name, d) for d in DECISIONS}
        self.decisions = dict.fromkeys(DECISIONS, 0)

    def describe(self) -> str:
        source = self.refs.get("ttftScorerName", "own calibration")
        return (f"tierSource={self.tier_source} gpuTierTokens={self.gpu_tier_tokens or 'scraped'} "
                f"cpuTierTokens={self.cpu_tier_tokens} diskTierTokens={self.disk_tier_tokens} "
                f"displacement={str(self.displacement).lower()} crowding={str(self.crowding).lower()} "
                f"activeWindow={self.footprint.sessions.ttl_s:g}s costs={source} maxSessions={self.sessions.capacity}")

    def debug_state(self) -> Mapping[str, Any]:
        """Sessions held and decisions taken (never session ids)."""
        return {"sessions": self.sessions.debug_state(), "decisions": dict(self.decisions),
                "endpoints": len(self.written), "active": self.footprint.debug_state()}

    def plugin_refs(self) -> Mapping[str, str]:
        """The predicted-ttft-scorer `ttftScorerName` names (resolved by the loader)."""
        return self.refs

    def bind_plugins(self, plugins: Mapping[str, Plugin]) -> None:
        """Take the named predicted-ttft-scorer's calibrated predictor."""
        for param, plugin in plugins.items():
            if not isinstance(plugin, PredictedTTFTScorer):
                raise ConfigError(f"plugin {self.name!r}: parameter {param!r} names {plugin.name!r} (type "
                                  f"{plugin.type_name}); name a predicted-ttft-scorer")
            self.predictor = plugin

    # -- where the turn's tokens are cached ---------------------------------------------------

    def _gpu_tokens(self, endpoint: Endpoint) -> int:
        if self.gpu_tier_tokens:
            return self.gpu_tier_tokens
        m = endpoint.metrics
        return m.cache_num_blocks * m.cache_block_size

    def home_tier(self, home: SessionHome, endpoint: Endpoint, cached: int) -> TierMatch:
        """Where `cached` tokens of the session's context are on its home now (least recently used model)."""
        if home.inflight > 0:
            return TierMatch(cached, 0, 0, 0)
        gpu = self._gpu_tokens(endpoint)
        if gpu <= 0:
            return TierMatch(cached, 0, 0, 0)  # capacity unknown: assume it is still there
        displaced = self.written.get(endpoint.name, 0.0) - home.written_at
        need = displaced + home.context_tokens
        if need <= gpu:
            return TierMatch(cached, 0, 0, 0)
        if self.cpu_tier_tokens and need <= gpu + self.cpu_tier_tokens:
            return TierMatch(0, cached, 0, 0)
        if self.disk_tier_tokens and need <= gpu + self.cpu_tier_tokens + self.disk_tier_tokens:
            return TierMatch(0, 0, cached, 0)
        return TierMatch(0, 0, 0, 0)

    def _matched(self, state: CycleState, endpoint: str) -> TierMatch | None:
        tier = state.endpoint_data(PREFIX_TIER_MATCH, endpoint)
        if tier is not None:
            return tier
        info = state.endpoint_data(PREFIX_MATCH_INFO, endpoint)
        if info is None:
            return None
        tokens = int(info.matched_blocks * info.block_size_tokens)
        return TierMatch(tokens, 0, 0, info.total_blocks * info.block_size_tokens)

    def placement(self, state: CycleState, request: InferenceRequest, endpoints: Sequence[Endpoint],
                  home: SessionHome | None) -> tuple[int, dict[str, TierMatch]]:
        """The prompt's tokens and, per endpoint, those cached there by tier."""
        total = 0
        for ep in endpoints:
            match = self._matched(state, ep.name)
            if match is not None:
                total = max(total, match.total_tokens)
        if total <= 0:
            tokens = state.get(PROMPT_TOKENS)
            total = len(tokens.token_ids) if tokens is not None else estimate_prompt_tokens(request)
        out: dict[str, TierMatch] = {}
        for ep in endpoints:
            match = self._matched(state, ep.name)
            gpu, cpu, disk = (match.gpu_tokens, match.cpu_tokens, match.disk_tokens) if match else (0, 0, 0)
            if self.tier_source == "history" and home is not None and ep.name == home.endpoint:
                # The session's context on its home (at most what the prefix match there says, when it knows).
                cached = min(home.context_tokens, total)
                if match is not None and match.total_tokens > 0:
                    cached = min(cached, gpu + cpu + disk)  # less after a compaction rewrote the context
                estimate = self.home_tier(home, ep, cached)
                gpu, cpu, disk = estimate.gpu_tokens, estimate.cpu_tokens, estimate.disk_tokens
            out[ep.name] = TierMatch(min(gpu, total), min(cpu, total), min(disk, total), total)
        return total, out

    # -- costs --------------------------------------------------------------------------------

    def costs(self, state: CycleState, request: InferenceRequest, endpoints: Sequence[Endpoint],
              home: SessionHome | None, now: float | None = None) -> dict[str, float]:
        """Predicted seconds per endpoint: time to first token plus displacement (the predictor's one term)."""
        predictor = self.predictor
        if predictor is None:
            return {}
        now = time.monotonic() if now is None else now
        model = request.target_model
        total, placed = self.placement(state, request, endpoints, home)
        if self.crowding:
            self.footprint.sweep(now)
            context = home.context_tokens if home is not None and home.context_tokens else self.footprint.mean_tokens()
            joining = max(total, int(context))
        costs = {}
        for ep in endpoints:
            match = placed[ep.name]
            if self.displacement:
                t = predictor.cost_terms(state, ep, match, total, model, now)
                costs[ep.name] = t.ttft_s + t.displacement_s
            else:
                costs[ep.name] = predictor.predict(ep, match, total, model, now)
            if self.crowding and (home is None or ep.name != home.endpoint):
                costs[ep.name] += self.crowding_s(ep, joining, model, now)
        return costs

    def crowding_s(self, endpoint: Endpoint, joining: int, model: str, now: float) -> float:
        """C(e): the expected reload and recompute of the active sessions' contexts that `joining` more tokens of
        session context on `endpoint` push down a KV tier or out of all of them (seconds)."""
        predictor = self.predictor
        gpu = self._gpu_tokens(endpoint)
        if predictor is None or gpu <= 0 or joining <= 0:
            return 0.0
        held = self.footprint.tokens_on(endpoint.name)

        def pushed_past(capacity: int) -> int:
            return max(0, held + joining - capacity) - max(0, held - capacity)

        cpu_end = gpu + self.cpu_tier_tokens
        disk_end = cpu_end + self.disk_tier_tokens
        below_gpu, below_cpu, out = pushed_past(gpu), pushed_past(cpu_end), pushed_past(disk_end)
        if not below_gpu:
            return 0.0
        prefill, cpu_load, disk_load = predictor.token_costs(endpoint, model, now)
        seconds = (below_gpu - below_cpu) * cpu_load + (below_cpu - out) * disk_load + out * prefill
        return predictor.reuse.rate() * seconds

    def margin_s(self, home: str, model: str) -> float:
        """How much cheaper another endpoint must be to take a session from its home: the home's prediction error."""
        predictor = self.predictor
        if predictor is None or not predictor.calibrate:
            return 0.0
        fit = predictor.calibrator.fit(home, model)
        return fit.residual_scale_s if fit is not None else 0.0

    def score(self, state: CycleState, request: InferenceRequest,
              endpoints: Sequence[Endpoint]) -> Mapping[str, float]:
        key: SessionKey | None = state.get(SESSION)
        home = self.sessions.get(key.session, touch=False) if key is not None else None
        costs = self.costs(state, request, endpoints, home)
        if not costs:
            return {}
        if home is not None and home.endpoint in costs:
            # Sticky: the home's cost counts less by the prediction's typical error.
            margin = min(self.margin_s(home.endpoint, request.target_model), 0.5 * costs[home.endpoint])
            costs[home.endpoint] -= margin
        elif self.predictor is not None:
            # A first turn: costs within the fits' error are a tie, not a preference (the predictor's rule).
            costs = self.predictor.level_within_error(costs, request.target_model)
        best = min(costs.values())
        scores = {name: best / cost if cost > 0 else 1.0 for name, cost in costs.items()}
        if home is None and key is not None and key.parent is not None:
            parent = self.sessions.get(key.parent, touch=False)
            if parent is not None and parent.endpoint in scores:
                scores = {name: value if name == parent.endpoint else value * (1.0 - PARENT_TIE_BREAK)
                          for name, value in scores.items()}
        return scores

    # -- history ------------------------------------------------------------------------------

    def pre_request(self, state: CycleState, request: InferenceRequest, result: SchedulingResult) -> None:
        if not result.targets:
            return
        target = result.targets[0].name
        key: SessionKey | None = state.get(SESSION)
        total = 0
        match = self._matched(state, target)
        if match is not None:
            total = match.total_tokens
        if total <= 0:
            total = estimate_prompt_tokens(request)
        cached = min(match.cached_tokens, total) if match is not None else 0
        state.put(self.name, _Pending(key.session if key is not None else None, target, total, cached))
        if key is None:
            self._decide("none")
            return
        # The turn's prompt is in the target's KV once prefilled, before its completion is reported: the
        # next turn can reach the picker first (the client has the whole answer while the picker still
        # reads the response's end), and must find its home holding at least this prompt.
        home = self.sessions.get(key.session)
        if home is None:
            self._decide("new")
            home = SessionHome(target, 0, self.written.get(target, 0.0))
            self.sessions.put(key.session, home)
        else:
            self._decide("stay" if home.endpoint == target else "move")
            if home.endpoint != target:
                home.endpoint, home.context_tokens, home.inflight = target, 0, 0
        home.inflight += 1
        home.context_tokens = max(home.context_tokens, total)
        self.footprint.record(key.session, target, home.context_tokens)

    def on_response_complete(self, state: CycleState, request: InferenceRequest, response: ResponseInfo,
                             target: Endpoint | None) -> None:
        pending: _Pending | None = state.get(self.name)
        if pending is None:
            return
        state.put(self.name, None)  # counted once
        usage = response.usage if isinstance(response.usage, dict) else {}
        prompt = _token_count(usage.get("prompt_tokens", usage.get("input_tokens"))) or pending.prompt_tokens
        completion = _token_count(usage.get("completion_tokens", usage.get("output_tokens"))) or 0
        details = usage.get("prompt_tokens_details")
        cached = _token_count(details.get("cached_tokens")) if isinstance(details, dict) else None
        cached = pending.cached_tokens if cached is None else cached
        written = self.written.get(pending.endpoint, 0.0) + max(0, prompt - cached) + completion
        self.written[pending.endpoint] = written
        if len(self.written) > 4 * max(1, len(self.sessions)) + 1024:
            self._forget_endpoints()
        if pending.session is None:
            return
        home = self.sessions.get(pending.session)
        if home is None or home.endpoint != pending.endpoint:
            return  # forgotten, or the session moved since
        home.inflight = max(0, home.inflight - 1)
        if response.status.startswith("2") or completion:
            home.context_tokens = prompt + completion
            self.footprint.record(pending.session, pending.endpoint, home.context_tokens)
        home.written_at = written

    def _forget_endpoints(self) -> None:
        """Keep the counters of endpoints some session still calls home (a pool's churn cannot grow them)."""
        homes = {home.endpoint for _, home in self.sessions.items()}
        self.written = {ep: n for ep, n in self.written.items() if ep in homes}

    def _decide(self, decision: str) -> None:
        self.decisions[decision] += 1
        self._decisions[decision].inc()


def register(registry: PluginRegistry) -> None:
    """Register `session-affinity-cost-scorer`."""
    registry.register_class(SessionAffinityCostScorer)
