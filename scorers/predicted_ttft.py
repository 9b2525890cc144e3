"""predicted-ttft-scorer: prefer the endpoint with the lowest predicted time to first token.

Per endpoint e, from `PREFIX_TIER_MATCH` (tokens cached by tier, consecutive from the start),
the picker's own in-flight work on e (`PluginContext.load`: prefill tokens it sent there whose
first token has not come back) and e's scraped metrics:

    T(e) = base
         + queuedPrefill(e) * ahead(e)                  (prefill queued ahead, in tokens)
         + prefill(e) * uncached(e)                     (our own prefill)
         + queueCost(e) * waiting(e)                    (requests queued ahead, e.g. for KV space)
         + runningCost(e) * running(e)                  (decoding requests share each step)
         + cpuLoad(e) * cpu(e) + diskLoad(e) * disk(e)  (load offloaded blocks back)

    ahead(e) = prefill tokens in flight on e (first token not seen yet) still to do now, as the
               ledger's backlog model estimates it (`epp.framework.load`)
    waiting(e) = e's scraped waiting queue (requests the engine holds back, e.g. for KV space; the
                 picker's own unseen and prefilling requests are already in ahead(e))

    score(e) = min over endpoints of T / T(e)     in (0, 1]; the fastest scores 1.

**Self-calibration** (default): the coefficients are learned per endpoint and model from the
picker's own requests (dispatch to first streamed token, see `ttft_calibration.py`), starting
from sane defaults (`prefill 2e-4 s/token`, ...) before the first observation. `queuedPrefill`
is learned apart from `prefill` (tokens in flight ahead are partly prefilled already when a
request arrives); before any observation it is `prefill`. They are exported
as `epp_ttft_calibration{plugin,endpoint,model,term}` and shown by `epp calibration`.

**Configured constants** (`prefillSecondsPerToken`, `queueSecondsPerWaitingRequest`,
`secondsPerRunningRequest`, `cpuLoadSecondsPerToken`, `diskLoadSecondsPerToken`, `baseSeconds`)
override learning: when any is given, `calibrate` defaults to false and the fixed formula is

    T(e) = base + max(waiting * queueSecondsPerWaitingRequest + running * secondsPerRunningRequest,
                      ahead(e) * prefillSecondsPerToken)
         + uncached * prefillSecondsPerToken + cpu * cpuLoad + disk * diskLoad

(the max, not the sum, because once scraped the same work shows in both; `trackPendingPrefill:
false` drops the in-flight term). With `calibrate: true` the given constants are the prior.

**Stickiness that pays** (`stickiness`, default 0 = off): an endpoint that holds fewer of the
request's prompt tokens than the best-matching endpoint is charged `stickiness` times the
prefill of the tokens it would throw away (`prefill(e) * (cached(best) - cached(e))`, in the
same seconds as T). At 1, a conversation's later turn moves from the replica holding its
history only when the predicted TTFT gain exceeds the recompute cost of the move: the request's
own T already pays its longer prefill, the charge adds the fleet's cost of doing that work again.

**Gaps within the prediction's error are ties** (`tiesWithinError`, default true, learned costs
only): an endpoint predicted within the smaller of its own and the best endpoint's fit error (the
running residual, at most half the best) of the best scores 1 too, and the other scorers and the
picker's tie-break decide; otherwise calibration noise sent every new prefix to the replica whose
fit had drifted lowest.

**What a pick displaces** (`displacementWeight`, default 1; 0 = off): a request's new KV blocks
evict others once the endpoint's cache is full, and an evicted block someone reads again is
computed again. Each candidate is charged

    D(e) = displacementWeight * reuse * max(0, newBlocks(e) - freeBlocks(e)) * blockSize * cost(e)

    newBlocks(e)  = prompt tokens not in e's GPU cache / block size (cache_config_info's block_size)
    freeBlocks(e) = the prefix producer's PREFIX_CACHE_FREE_BLOCKS: e's KV capacity (num_gpu_blocks)
                    less what its index sees resident
    reuse         = the share of the fleet's recent prompt tokens served from cache (usage's cached_tokens):
                    how likely an evicted block is to be read again (0 where nothing is shared); the
                    fleet's, not e's own, because e's own rate is lowest where e thrashes and made the
                    thrashing replica the cheapest place to evict
    cost(e)       = e's prefill seconds per token; its CPU-load seconds per token when e has a CPU
                    offload tier (num_cpu_blocks), where evicted blocks go and come back from

Without it, a prefix no replica held predicted the same TTFT everywhere and calibration noise sent
it to the replica already full of hot prefixes, evicting one of them: the loop that put 38 of 48
shared-prefix requests on one real vLLM replica (bench/notes/2026-12-capacity-aware-prediction.md).
This is the picker's one displacement term: `session-affinity-cost-scorer` charges a turn the same
D(e) through `cost_terms` (with the tiers its session history gives), so no pick pays it twice.

**The prediction trace** (`traceCapacity`, default 0 = off): the last N picks, each candidate's
terms beside the outcome on the one picked, in `debug_state` (bench/routing/pick_trace.py reads it).

**Predictions for flow control** (`predict_latency`): the request's own prefill on its cheapest
endpoint (base, uncached tokens, tier loads; no queue ahead) and the best T over the endpoints,
which `slo-deadline-ordering-policy` orders and sheds by. With calibration the scorer also makes
the picker learn TPOT (`predicted_tpot.py`), so `epp calibration` shows it.

The ratio keeps a 5 % slower endpoint at 0.95 instead of stretching small differences to 0..1
as min-max would; `base` (> 0) keeps it finite. Without tier data for a request (no producer,
or an untokenizable prompt) every endpoint is charged the whole prompt as uncached.
"""

from __future__ import annotations

import bisect
import math
import time
import weakref
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from epp.framework import (
    PREFIX_CACHE_FREE_BLOCKS,
    PREFIX_MATCH_INFO,
    PREFIX_TIER_MATCH,
    Booking,
    CycleState,
    Endpoint,
    InferenceRequest,
    InflightLedger,
    PluginContext,
    PluginParams,
    PluginRegistry,
    PrefixMatchInfo,
    ResponseInfo,
    Scorer,
    TierMatch,
    estimate_prompt_tokens,
    once_per_registry,
)
from epp.scorers.predicted_tpot import TPOTObjectiveFilter, tpot_learner
from epp.scorers.ttft_calibration import TERMS, TTFTCalibrator, features

DEFAULTS = {"baseSeconds": 0.01, "prefillSecondsPerToken": 2e-4, "secondsPerRunningRequest": 0.005,
            "cpuLoadSecondsPerToken": 2e-5, "diskLoadSecondsPerToken": 1e-4, "queueSecondsPerWaitingRequest": 0.1}
# Fits `debug_state` lists (the calibrator keeps up to 1,024; the metrics page has them all).
DEBUG_FITS = 32
# Parameter names in TERMS order.
TERM_PARAMS = ("baseSeconds", "prefillSecondsPerToken", "secondsPerRunningRequest",
               "cpuLoadSecondsPerToken", "diskLoadSecondsPerToken", "queueSecondsPerWaitingRequest")


@dataclass(slots=True)
class Terms:
    """One candidate's predicted TTFT, term by term (seconds; tokens where named so)."""

    base_s: float
    prefill_s_per_token: float
    uncached: int  # prompt tokens not cached on the endpoint, as the prefix producer sees it
    ahead_tokens: float = 0.0  # prefill tokens in flight ahead of it (the ledger's backlog)
    queue_s: float = 0.0  # what those tokens ahead cost
    waiting_s: float = 0.0  # the scraped waiting queue's share
    running_s: float = 0.0  # the running requests' share of each step
    tiers_s: float = 0.0  # loading CPU / disk tier blocks back
    stickiness_s: float = 0.0  # the recompute charged for leaving the endpoint holding the most of the prompt
    free_blocks: int | None = None  # KV blocks the index sees free on the endpoint (None: unknown)
    evicted_blocks: int = 0  # blocks the request's new blocks would push out
    reuse: float = 0.0  # the chance a pushed-out block is read again (the fleet's recent token hit rate)
    displacement_s: float = 0.0  # the expected recompute of what those blocks held

    @property
    def prefill_s(self) -> float:
        """The request's own prefill of its uncached tokens."""
        return self.prefill_s_per_token * self.uncached

    @property
    def ahead_s(self) -> float:
        """Work ahead of the request on the endpoint."""
        return self.queue_s + self.waiting_s + self.running_s

    @property
    def own_s(self) -> float:
        """The request's own seconds: base, prefill, tier loads."""
        return self.base_s + self.prefill_s + self.tiers_s

    @property
    def ttft_s(self) -> float:
        """The predicted time to the first token."""
        return self.ahead_s + self.own_s

    @property
    def total_s(self) -> float:
        """What the score compares: the TTFT and the charges beside it (stickiness, displacement)."""
        return self.ttft_s + self.stickiness_s + self.displacement_s


class ReuseTracker:
    """How likely a cached block is to be read again: the share of the fleet's recent prompt tokens served from cache.

    One decayed pair of sums over every endpoint (prompt tokens, those found cached: the response's
    `cached_tokens`, else the prefix match the pick was booked with), `decay` per completed request.
    Fleet-wide on purpose: an endpoint's own rate is lowest exactly where its cache thrashes (its
    blocks are evicted before they are read again), so a per-endpoint chance made the thrashing
    replica look the cheapest place to evict and sent it every new prefix, which fed the thrash
    (traced per pick on the multi-turn shape: bench/notes/2026-12-round4-measurements.md, "Multi-turn moves").
    """

    def __init__(self, decay: float = 0.995) -> None:
        self.decay = decay
        self.cached = 0.0
        self.prompt = 0.0

    def observe(self, booking: Booking, response: Any) -> None:
        """The ledger's observer: one completed request's prompt and cached tokens."""
        prompt, cached = booking.prompt_tokens, booking.prompt_tokens - booking.uncached_tokens
        usage = getattr(response, "usage", None) if isinstance(response, ResponseInfo) else None
        if isinstance(usage, dict):
            details = usage.get("prompt_tokens_details")
            real_prompt = usage.get("prompt_tokens")
            real_cached = details.get("cached_tokens") if isinstance(details, dict) else None
            if isinstance(real_prompt, int) and isinstance(real_cached, int) and 0 <= real_cached <= real_prompt:
                prompt, cached = real_prompt, real_cached
        if prompt <= 0:
            return
        self.cached = self.decay * self.cached + max(0, cached)
        self.prompt = self.decay * self.prompt + prompt

    def rate(self) -> float:
        """The fleet's recent token hit rate in [0, 1]; 0 before anything was served (no evidence of reuse)."""
        return self.cached / self.prompt if self.prompt > 0 else 0.0


class PredictionTrace:
    """The last `capacity` picks: every candidate's predicted terms beside what happened on the one picked.

    A pick is held as pending from scoring until its response completes (the ledger's observer),
    then moved to the completed ring; both are bounded by `capacity`, oldest first out, and a
    pending pick pushed out unanswered counts in `dropped` (`epp_ttft_prediction_trace_*`). The
    booking that completes is matched to the last pick scored before it was booked: scoring and
    booking run in one step of the event loop, so nothing else is scored in between.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.pending: dict[float, dict[str, Any]] = {}  # scored_at -> entry, in time order
        self._times: list[float] = []
        self.done: deque[dict[str, Any]] = deque(maxlen=capacity)
        self.dropped = 0

    def scored(self, now: float, request_id: str, tokens: int, terms: Mapping[str, Terms],
               scores: Mapping[str, float]) -> None:
        """Hold one pick's candidates until its outcome comes back."""
        if self._times and now <= self._times[-1]:
            now = math.nextafter(self._times[-1], math.inf)  # one entry per pick, in time order
        self.pending[now] = {"scored_at": now, "request": request_id, "tokens": tokens,
                             "candidates": {name: {**asdict(t), "ttft_s": t.ttft_s, "total_s": t.total_s,
                                                   "score": scores[name]}
                                            for name, t in terms.items()}}
        self._times.append(now)
        while len(self._times) > self.capacity:
            self.pending.pop(self._times.pop(0), None)
            self.dropped += 1

    def completed(self, booking: Booking, response: Any) -> None:
        """The ledger's observer: the outcome of a pick (TTFT as the picker saw it, cached tokens from usage)."""
        i = bisect.bisect_right(self._times, booking.picked_at) - 1
        if i < 0:
            return
        entry = self.pending.pop(self._times.pop(i), None)
        if entry is None or booking.endpoint not in entry["candidates"]:
            return
        usage = getattr(response, "usage", None) if isinstance(response, ResponseInfo) else None
        details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
        entry["picked"] = booking.endpoint
        entry["ttft_s"] = (booking.first_token_at - booking.picked_at
                           if booking.ttft_observed and booking.first_token_at is not None else None)
        entry["prompt_tokens"] = usage.get("prompt_tokens") if isinstance(usage, dict) else None
        entry["cached_tokens"] = details.get("cached_tokens") if isinstance(details, dict) else None
        self.done.append(entry)

    def debug_state(self) -> dict[str, Any]:
        """The completed picks, oldest first, and how many wait or were dropped."""
        return {"capacity": self.capacity, "pending": len(self.pending), "dropped": self.dropped,
                "picks": list(self.done)}


class PredictedTTFTScorer(Scorer):
    """min(T) / T(e), T = queue + prefill of uncached tokens + running share + CPU/disk loads; self-calibrating."""

    type_name = "predicted-ttft-scorer"

    def __init__(self, name: str, params: PluginParams, context: PluginContext) -> None:
        super().__init__(name)
        given = {key: params.float(key, math.nan, minimum=0.0)  # NaN: not configured
                 for key in TERM_PARAMS}
        given = {k: v for k, v in given.items() if not math.isnan(v)}
        values = {**DEFAULTS, **given}
        if values["baseSeconds"] <= 0:
            values["baseSeconds"] = 1e-6  # keeps T > 0
        self.base_s = values["baseSeconds"]
        self.prefill_s_per_token = values["prefillSecondsPerToken"]
        self.s_per_running = values["secondsPerRunningRequest"]
        self.cpu_load_s_per_token = values["cpuLoadSecondsPerToken"]
        self.disk_load_s_per_token = values["diskLoadSecondsPerToken"]
        self.queue_s_per_waiting = values["queueSecondsPerWaitingRequest"]
        self.track_pending = params.bool("trackPendingPrefill", True)
        self.stickiness = params.float("stickiness", 0.0, minimum=0.0)
        # Learned predictions closer than their typical error score alike (see `level_within_error`).
        self.ties_within_error = params.bool("tiesWithinError", True)
        self.calibrate = params.bool("calibrate", not given)
        self.ledger: InflightLedger = context.load
        self.calibrator = TTFTCalibrator(tuple(values[k] for k in TERM_PARAMS),
                                         decay=params.float("calibrationDecay", 0.95, minimum=0.5, maximum=0.9999))
        # What a pick displaces: the expected recompute of the prefixes its new blocks evict (0: not counted).
        self.displacement_weight = params.float("displacementWeight", 1.0, minimum=0.0)
        self.reuse = ReuseTracker()
        if self.displacement_weight > 0:
            self.ledger.add_observer(self.reuse.observe)
        trace_capacity = params.int("traceCapacity", 0, minimum=0)
        # Off by default: what each pick predicted, term by term, beside what happened (debug state).
        self.trace: PredictionTrace | None = PredictionTrace(trace_capacity) if trace_capacity else None
        if self.calibrate:
            self.ledger.add_observer(self._observe)
            tpot_learner(context)  # TPOT is learned next to TTFT (epp calibration shows both)
        if self.trace is not None:
            self.ledger.add_observer(self.trace.completed)
        if self.calibrate or self.trace is not None or self.displacement_weight > 0:
            _collector(context.metrics_registry).scorers.add(self)

    def describe(self) -> str:
        return (f"calibrate={str(self.calibrate).lower()} trackPendingPrefill={str(self.track_pending).lower()} "
                f"stickiness={self.stickiness:g} displacementWeight={self.displacement_weight:g} "
                f"tiesWithinError={str(self.ties_within_error).lower()}")

    def consumes(self) -> frozenset[str]:
        return frozenset({PREFIX_TIER_MATCH})

    def debug_state(self) -> Mapping[str, Any]:
        """The learned fits, most recently updated first (at most `DEBUG_FITS`), and the prediction trace if kept."""
        fits = self.calibrator.fits()
        state: dict[str, Any] = {
            "calibrate": self.calibrate, "fits": len(fits), "evicted": self.calibrator.evicted,
            "recent": [{"endpoint": ep, "model": model, "observations": fit.observations,
                        "residual_s": fit.residual_scale_s, "resets": fit.resets,
                        "coefficients": dict(zip(TERMS, fit.coefficients()))}
                       for ep, model, fit in reversed(fits[-DEBUG_FITS:])]}
        if self.trace is not None:
            state["trace"] = self.trace.debug_state()
        return state

    # -- prediction ---------------------------------------------------------------------------

    def terms(self, endpoint: Endpoint, match: TierMatch | None, total_tokens: int, model: str = "",
              now: float | None = None) -> Terms:
        """The predicted TTFT of this request on `endpoint`, term by term."""
        if match is None:
            uncached, cpu, disk = total_tokens, 0, 0
        else:
            uncached = max(0, match.total_tokens - match.cached_tokens)
            cpu, disk = match.cpu_tokens, match.disk_tokens
        load = self.ledger.load(endpoint, now)
        m = endpoint.metrics
        own_ahead = load.prefill_backlog_tokens if self.track_pending else 0.0
        if not self.calibrate:
            scraped = m.waiting_queue_size * self.queue_s_per_waiting + m.running_requests_size * self.s_per_running
            return Terms(base_s=self.base_s, prefill_s_per_token=self.prefill_s_per_token, uncached=uncached,
                         ahead_tokens=own_ahead, queue_s=max(scraped, own_ahead * self.prefill_s_per_token),
                         tiers_s=cpu * self.cpu_load_s_per_token + disk * self.disk_load_s_per_token)
        base, prefill, running_cost, cpu_cost, disk_cost, queue_cost, queued_prefill = self.calibrator.coefficients(
            endpoint.name, model, now)
        return Terms(base_s=max(base, 1e-6), prefill_s_per_token=prefill, uncached=uncached, ahead_tokens=own_ahead,
                     queue_s=queued_prefill * own_ahead,
                     waiting_s=queue_cost * m.waiting_queue_size, running_s=running_cost * m.running_requests_size,
                     tiers_s=cpu_cost * cpu + disk_cost * disk)

    def _split(self, endpoint: Endpoint, match: TierMatch | None, total_tokens: int, model: str,
               now: float | None) -> tuple[float, float, float]:
        """(seconds of work ahead, the request's own seconds, prefill seconds per token) on `endpoint`."""
        t = self.terms(endpoint, match, total_tokens, model, now)
        return t.ahead_s, t.own_s, t.prefill_s_per_token

    def predict(self, endpoint: Endpoint, match: TierMatch | None, total_tokens: int, model: str = "",
                now: float | None = None) -> float:
        """Predicted seconds to the first token of this request on `endpoint`."""
        return self.terms(endpoint, match, total_tokens, model, now).ttft_s

    def cost_terms(self, state: CycleState, endpoint: Endpoint, match: TierMatch | None, total_tokens: int,
                   model: str = "", now: float | None = None) -> Terms:
        """The request's predicted TTFT on `endpoint` with the displacement charge (D), as `score` weighs them.

        `match` may be another plugin's estimate of where the prompt is cached (a session's history);
        the room and block size come from the prefix producer's data in `state`. Stickiness is not
        included: it is this scorer's own preference, not a cost of the endpoint.
        """
        t = self.terms(endpoint, match, total_tokens, model, now)
        if self.displacement_weight > 0:
            free = state.endpoint_data(PREFIX_CACHE_FREE_BLOCKS, endpoint.name)
            if free is not None:
                self._displacement(t, endpoint, match, total_tokens, free,
                                   state.endpoint_data(PREFIX_MATCH_INFO, endpoint.name), model, now)
        return t

    def _displacement(self, t: Terms, endpoint: Endpoint, match: TierMatch | None, total_tokens: int,
                      free_blocks: int | None, info: PrefixMatchInfo | None, model: str, now: float | None) -> None:
        """Charge `t` the expected recompute of what the request's new blocks would evict on `endpoint`.

        New GPU blocks: the prompt tokens not in its GPU cache (uncached ones are prefilled, CPU and
        disk ones loaded back), in the index's block size (the model server's, else the producer's).
        Beyond the free blocks the index sees (capacity from `vllm:cache_config_info` less what it
        holds), each new block evicts one; an evicted block is read again with the chance `reuse` (the
        fleet's recent token hit rate) and then costs its prefill again, or, where the endpoint
        has a CPU offload tier (`num_cpu_blocks`), its load back from there.
        """
        if free_blocks is None:
            return
        t.free_blocks = free_blocks
        block = endpoint.metrics.cache_block_size or (info.block_size_tokens if info is not None else 0)
        if block <= 0:
            return
        gpu = match.gpu_tokens if match is not None else 0
        new_blocks = -(-max(0, total_tokens - gpu) // block)
        t.evicted_blocks = max(0, new_blocks - free_blocks)
        if not t.evicted_blocks:
            return
        t.reuse = self.reuse.rate()
        if endpoint.metrics.cache_num_cpu_blocks > 0:
            per_token = self.token_costs(endpoint, model, now)[1]
        else:
            per_token = t.prefill_s_per_token
        t.displacement_s = self.displacement_weight * t.reuse * t.evicted_blocks * block * per_token

    def token_costs(self, endpoint: Endpoint, model: str = "", now: float | None = None) -> tuple[float, float, float]:
        """(prefill, CPU-tier load, disk-tier load) seconds per token on `endpoint`: learned, or the configured ones."""
        if not self.calibrate:
            return self.prefill_s_per_token, self.cpu_load_s_per_token, self.disk_load_s_per_token
        c = self.calibrator.coefficients(endpoint.name, model, now)
        return (c[TERMS.index("prefill_seconds_per_token")], c[TERMS.index("cpu_load_seconds_per_token")],
                c[TERMS.index("disk_load_seconds_per_token")])

    def predict_latency(self, state: CycleState, request: InferenceRequest,
                        endpoints: Sequence[Endpoint]) -> tuple[float, float]:
        """(the request's own prefill on its cheapest endpoint, the best predicted TTFT now), seconds, for flow control."""
        data = state.all_endpoint_data(PREFIX_TIER_MATCH)
        total = max((m.total_tokens for m in data.values()), default=0) if data else estimate_prompt_tokens(request)
        now = time.monotonic()
        splits = [self._split(ep, data.get(ep.name), total, request.target_model, now) for ep in endpoints]
        return min(own for _, own, _ in splits), min(ahead + own for ahead, own, _ in splits)

    def score(self, state: CycleState, request: InferenceRequest,
              endpoints: Sequence[Endpoint]) -> Mapping[str, float]:
        data = state.all_endpoint_data(PREFIX_TIER_MATCH)
        total = max((m.total_tokens for m in data.values()), default=0)
        if not data:
            total = estimate_prompt_tokens(request)
        now = time.monotonic()
        model = request.target_model
        best_cached = max((m.cached_tokens for m in data.values()), default=0) if self.stickiness else 0
        # (Read when tracing too: a trace of the before shows what the term would have seen.)
        free = state.all_endpoint_data(PREFIX_CACHE_FREE_BLOCKS) if self.displacement_weight > 0 or self.trace \
            else {}
        blocks = state.all_endpoint_data(PREFIX_MATCH_INFO) if free else {}
        predicted = {}
        traced: dict[str, Terms] | None = {} if self.trace is not None else None
        for ep in endpoints:
            match = data.get(ep.name)
            t = self.terms(ep, match, total, model, now)
            # The recompute cost of leaving the endpoint that holds the most of this prompt (0 there).
            thrown_away = best_cached - (match.cached_tokens if match is not None else 0)
            if thrown_away > 0 and self.stickiness:
                t.stickiness_s = self.stickiness * t.prefill_s_per_token * thrown_away
            if free:
                self._displacement(t, ep, match, total, free.get(ep.name), blocks.get(ep.name), model, now)
            predicted[ep.name] = t.total_s
            if traced is not None:
                traced[ep.name] = t
        if not predicted:
            return {}
        predicted = self.level_within_error(predicted, model)
        best = min(predicted.values())
        scores = {name: best / t for name, t in predicted.items()}
        if self.trace is not None and traced is not None:
            self.trace.scored(now, request.request_id, total, traced, scores)
        return scores

    def level_within_error(self, predicted: dict[str, float], model: str) -> dict[str, float]:
        """`predicted` (seconds per endpoint) with every endpoint within the fits' typical error of the best set to it.

        A gap smaller than what the learned fits typically miss by is calibration noise, not evidence;
        an argmax over it is a bias that sends every new prefix to whichever replica's fit drifted
        lowest (measured: bench/notes/2026-12-round4-measurements.md, "Multi-turn moves"). Tied, the other
        scorers and the picker's tie-break (the most free prefix cache, then random) decide. The error
        is the smaller of the two endpoints' residual scales, at most half the best prediction. Off
        (`tiesWithinError: false`) or with configured constants, `predicted` comes back as it is.
        """
        if not (self.calibrate and self.ties_within_error and predicted):
            return predicted
        best_name = min(predicted, key=predicted.__getitem__)
        best = predicted[best_name]
        best_fit = self.calibrator.fit(best_name, model)
        if best_fit is None:
            return predicted
        out = dict(predicted)
        for name, total in predicted.items():
            fit = self.calibrator.fit(name, model)
            if fit is not None and total - best <= min(fit.residual_scale_s, best_fit.residual_scale_s, 0.5 * best):
                out[name] = best
        return out

    # -- learning -----------------------------------------------------------------------------

    def _observe(self, booking: Booking, response: Any) -> None:
        """Learn from a completed request whose first streamed token was timed."""
        if not booking.ttft_observed or booking.first_token_at is None:
            return
        uncached = booking.uncached_tokens
        usage = getattr(response, "usage", None) if isinstance(response, ResponseInfo) else None
        if usage and not booking.cpu_tokens and not booking.disk_tokens:
            prompt = usage.get("prompt_tokens")
            details = usage.get("prompt_tokens_details")
            cached = details.get("cached_tokens") if isinstance(details, dict) else None
            if isinstance(prompt, int) and isinstance(cached, int) and 0 <= cached <= prompt:
                uncached = prompt - cached  # what the server really computed
        x = features(uncached, booking.running, booking.cpu_tokens, booking.disk_tokens, booking.waiting,
                     ahead=booking.ahead_tokens)
        self.calibrator.observe(booking.endpoint, booking.model, x, booking.first_token_at - booking.picked_at,
                                now=booking.first_token_at)


class _CalibrationCollector(Collector):
    """`epp_ttft_calibration*` series of every calibrating scorer on one registry."""

    def __init__(self) -> None:
        self.scorers: weakref.WeakSet[PredictedTTFTScorer] = weakref.WeakSet()

    def collect(self) -> Iterator[GaugeMetricFamily]:
        coef = GaugeMetricFamily("epp_ttft_calibration",
                                 "Learned predicted-TTFT coefficient per endpoint and model (seconds, per token "
                                 "or per request, by term).", labels=["plugin", "endpoint", "model", "term"])
        count = GaugeMetricFamily("epp_ttft_calibration_observations",
                                  "Requests the predicted-TTFT calibration learned from.",
                                  labels=["plugin", "endpoint", "model"])
        scale = GaugeMetricFamily("epp_ttft_calibration_residual_seconds",
                                  "Typical absolute error of the calibrated TTFT prediction (running mean).",
                                  labels=["plugin", "endpoint", "model"])
        resets = GaugeMetricFamily("epp_ttft_calibration_resets",
                                   "Step changes the calibration detected (old observations forgotten).",
                                   labels=["plugin", "endpoint", "model"])
        traced = GaugeMetricFamily("epp_ttft_prediction_trace_entries",
                                   "Picks the predicted-TTFT trace holds, completed or waiting for their outcome "
                                   "(traceCapacity each).", labels=["plugin", "state"])
        dropped = CounterMetricFamily("epp_ttft_prediction_trace_dropped",
                                      "Traced picks evicted before their outcome came back (the trace was full).",
                                      labels=["plugin"])
        reuse = GaugeMetricFamily("epp_ttft_displacement_reuse",
                                  "Share of the fleet's recent prompt tokens served from cache: the chance the "
                                  "predicted-TTFT displacement term gives an evicted block of being read again.",
                                  labels=["plugin"])
        for scorer in list(self.scorers):
            if scorer.displacement_weight > 0:
                reuse.add_metric([scorer.name], scorer.reuse.rate())
            if scorer.trace is not None:
                traced.add_metric([scorer.name, "completed"], len(scorer.trace.done))
                traced.add_metric([scorer.name, "pending"], len(scorer.trace.pending))
                dropped.add_metric([scorer.name], scorer.trace.dropped)
            for endpoint, model, fit in scorer.calibrator.fits():
                labels = [scorer.name, endpoint, model]
                for term, value in zip(TERMS, fit.coefficients()):
                    coef.add_metric([*labels, term], value)
                count.add_metric(labels, fit.observations)
                scale.add_metric(labels, fit.residual_scale_s)
                resets.add_metric(labels, fit.resets)
        yield from (coef, count, scale, resets, traced, dropped, reuse)


def _new_collector(registry: CollectorRegistry | None) -> _CalibrationCollector:
    collector = _CalibrationCollector()
    if registry is not None:
        registry.register(collector)
    return collector


def _collector(registry: CollectorRegistry | None) -> _CalibrationCollector:
    """The calibration collector of `registry` (none: a private one, exported nowhere)."""
    return once_per_registry(registry, "epp_predicted_ttft_calibration", _new_collector)


def register(registry: PluginRegistry) -> None:
    """Register `predicted-ttft-scorer` and `tpot-slo-filter` (its TPOT counterpart)."""
    registry.register_class(PredictedTTFTScorer)
    registry.register_class(TPOTObjectiveFilter)
