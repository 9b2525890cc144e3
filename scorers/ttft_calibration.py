"""Online calibration of predicted TTFT: per endpoint and model, learned from the picker's own requests.

Model (seconds, from the picker's dispatch to the first streamed token):

    ttft = base + prefill * uncached + queued_prefill * ahead + queue_cost * waiting
         + running_cost * running + cpu_load * cpu + disk_load * disk

`uncached`: the request's prompt tokens not in the prefix cache (from the response's
`cached_tokens` when the server reports it, else the picker's own prefix match); `ahead`: prefill
tokens in flight on that endpoint still to do when the request was sent (the ledger's backlog
model: in-flight prefills worked through in pick order, so one about to finish counts little).
`ahead` has its own coefficient: a continuous-batching engine interleaves a new request's prefill
chunks with those ahead, so the tokens ahead need not cost what its own uncached tokens do. One
coefficient for both (the sum) fitted a blend of the two and learned a prefill cost 20-40 %
below the true one;
`waiting`: the endpoint's scraped waiting queue (a request can wait for KV space, which costs
time that prefill tokens do not explain);
`running`: the scraped running requests (they share each step); `cpu`/`disk`: tokens loaded back
from offload tiers.

The fit is a ridge-regularised, exponentially forgetting, Huber-weighted least squares:
- observations with prefill in flight ahead count less (`ahead_weight`: their TTFT is noisier);
- forgetting (`decay` per observation) lets it follow an endpoint that slows down or speeds up;
- Huber weights (residuals past `huber_k` times the running residual scale count less; 1.345 is
  the textbook constant, 95 % efficient on Gaussian noise: 2.5 let 5 % stalls move a fit 20 %+) keep one
  stalled request from moving it; but residuals that stay on one side (their moving average
  past `step_threshold` scales) are a step change, not noise, and make it forget the old data;
- the ridge pulls towards a prior: the configured constants for the pooled fit of a model (all
  endpoints together), and the pooled fit for each endpoint, so an endpoint with few
  observations predicts like its pool and a fresh picker predicts like its configuration; an
  endpoint's base and per-request terms stay near the pool's (they describe the traffic), its
  per-token speeds are its own.
Coefficients are kept non-negative. Features are scaled (thousands of tokens, tens of requests)
so that one prior weight suits every term.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

TERMS = ("base_seconds", "prefill_seconds_per_token", "seconds_per_running_request",
         "cpu_load_seconds_per_token", "disk_load_seconds_per_token", "seconds_per_waiting_request",
         "queued_prefill_seconds_per_token")
# Feature i enters the fit as x_i * SCALE[i], so coefficients are comparable in size.
SCALE = (1.0, 1e-3, 0.1, 1e-3, 1e-3, 0.1, 1e-3)
N = len(TERMS)
# An endpoint's own fit stays close to its pool's in the terms that describe the fleet and the
# traffic (base, per queued and per running request: one slow burst must not make one replica
# look slow for good) and follows the endpoint freely in its per-token speeds.
ENDPOINT_PRIOR_WEIGHTS = (20.0, 0.05, 20.0, 0.05, 0.05, 20.0, 0.05)

AHEAD = TERMS.index("queued_prefill_seconds_per_token")
# How much of the prefill in flight ahead of a request is still to do when it arrives is unknown
# (anywhere from none to all of it), so the spread of its TTFT grows with the tokens ahead. The
# fit weights each observation by the inverse of that variance: with AHEAD_NOISE_TOKENS ahead it
# counts a quarter. Unweighted, a few requests behind long prompts moved a replica's learned
# prefill cost by 20-40 %.
AHEAD_NOISE_TOKENS = 1000.0


def ahead_weight(ahead_tokens: float) -> float:
    """Inverse-variance weight of an observation with `ahead_tokens` prefill tokens in flight ahead."""
    return 1.0 / (1.0 + max(0.0, ahead_tokens) / AHEAD_NOISE_TOKENS) ** 2


def _ahead_weight_of(x: Sequence[float]) -> float:
    return ahead_weight(x[AHEAD])


def full_prior(prior: Sequence[float]) -> tuple[float, ...]:
    """A prior in TERMS order; one without the queued-prefill term charges queued tokens the prefill cost.

    (Before any evidence, tokens ahead are assumed to cost what the request's own tokens do: the
    cautious guess, which spreads load rather than piling it up.)
    """
    if len(prior) == N - 1:
        return (*prior, prior[TERMS.index("prefill_seconds_per_token")])
    if len(prior) != N:
        raise ValueError(f"a TTFT prior has {N} terms ({', '.join(TERMS)}), got {len(prior)}")
    return tuple(prior)


@dataclass(frozen=True, slots=True)
class Observation:
    """One request: its features (in TERMS order, the first is 1) and its measured TTFT."""

    features: tuple[float, ...]
    ttft_s: float


def features(uncached: float, running: float, cpu_tokens: float, disk_tokens: float,
             waiting: float = 0.0, ahead: float = 0.0) -> tuple[float, ...]:
    """The feature vector of the TTFT model (unscaled, TERMS order)."""
    return (1.0, float(uncached), float(running), float(cpu_tokens), float(disk_tokens), float(waiting),
            float(ahead))


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Solve a small dense system by Gaussian elimination with partial pivoting; None if singular."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-12:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            if f:
                for c in range(col, n + 1):
                    m[r][c] -= f * m[col][c]
    out = [0.0] * n
    for r in range(n - 1, -1, -1):
        out[r] = (m[r][n] - sum(m[r][c] * out[c] for c in range(r + 1, n))) / m[r][r]
    return out


class RobustLinearFit:
    """Exponentially forgetting, Huber-weighted ridge regression of a latency on a model's features.

    By default the TTFT model (`TERMS`, `SCALE`, observations weighted by `ahead_weight`); another
    model passes its own feature `scale` (one per term) and `weight_of` (an observation's weight).
    """

    def __init__(self, prior: Sequence[float], *, prior_weight: float | Sequence[float] = 0.05, decay: float = 0.95,
                 huber_k: float = 1.345, initial_scale_s: float = 0.05, step_threshold: float = 1.5,
                 scale: Sequence[float] = SCALE, weight_of: Callable[[Sequence[float]], float] | None = None) -> None:
        self.scale = tuple(scale)
        self.n = n = len(self.scale)
        self.weight_of = weight_of if weight_of is not None else _ahead_weight_of
        self.prior = [p / s for p, s in zip(self._full(prior), self.scale)]  # in scaled units
        # One weight per term (or one for all): how many observations' worth the prior counts.
        self.prior_weight = [float(prior_weight)] * n if isinstance(prior_weight, (int, float)) else \
            [float(w) for w in prior_weight]
        self.decay = decay
        self.huber_k = huber_k
        self.step_threshold = step_threshold
        self._s = [[0.0] * n for _ in range(n)]  # weighted X^T X
        self._b = [0.0] * n  # weighted X^T y
        self._theta = list(self.prior)
        self.residual_scale_s = initial_scale_s
        self.observations = 0
        self.weight = 0.0  # effective number of observations (decayed)
        self._bias = 0.0  # moving average of residuals in units of the residual scale
        self.resets = 0

    def _full(self, prior: Sequence[float]) -> tuple[float, ...]:
        if self.scale == SCALE:
            return full_prior(prior)
        if len(prior) != self.n:
            raise ValueError(f"a prior of this model has {self.n} terms, got {len(prior)}")
        return tuple(prior)

    def coefficients(self) -> tuple[float, ...]:
        """The fitted coefficients in TERMS order (seconds, seconds per token or per request)."""
        return tuple(t * s for t, s in zip(self._theta, self.scale))

    def predict(self, x: Sequence[float]) -> float:
        """Predicted TTFT in seconds for unscaled features `x`."""
        return sum(t * s * xi for t, s, xi in zip(self._theta, self.scale, x))

    def set_prior(self, prior: Sequence[float]) -> None:
        """Move the ridge target (the pooled fit, for an endpoint's own fit); refits."""
        self.prior = [p / s for p, s in zip(self._full(prior), self.scale)]
        self._refit()

    def observe(self, x: Sequence[float], y: float) -> float:
        """Learn from one request; returns its residual (seconds) against the fit before it."""
        predicted = self.predict(x)
        residual = y - predicted
        # A floor relative to the TTFT itself: a bias of a few percent is the ridge, not a step change.
        scale = max(self.residual_scale_s, 0.05 * abs(predicted), 1e-3)
        limit = self.huber_k * scale
        outlier = abs(residual) > limit
        # Residuals that stay on one side are a step change, not noise: forget what came before.
        self._bias = 0.7 * self._bias + 0.3 * max(-2.0, min(2.0, residual / scale))
        if abs(self._bias) > self.step_threshold:
            self._forget(0.25)
            self.resets += 1
            self._bias = 0.0
        w = (limit / abs(residual) if outlier else 1.0) * self.weight_of(x)
        z = [xi * s for xi, s in zip(x, self.scale)]
        d = self.decay
        s_, b_ = self._s, self._b
        n = self.n
        for i in range(n):
            b_[i] = d * b_[i] + w * z[i] * y
            row = s_[i]
            for j in range(n):
                row[j] = d * row[j] + w * z[i] * z[j]
        self.weight = d * self.weight + w
        self.observations += 1
        # The residual scale follows |residual| (clipped, so one stall cannot blow it up).
        self.residual_scale_s = 0.9 * self.residual_scale_s + 0.1 * min(abs(residual), 4 * limit)
        self._refit()
        return residual

    def _forget(self, keep: float) -> None:
        for i in range(self.n):
            self._b[i] *= keep
            for j in range(self.n):
                self._s[i][j] *= keep
        self.weight *= keep

    def _refit(self) -> None:
        lam = self.prior_weight
        # Fit the non-negative coefficients: drop a negative one (fixed at 0) and refit, at most N times.
        n = self.n
        free = list(range(n))
        theta = [0.0] * n
        for _ in range(n):
            a = [[self._s[i][j] + (lam[i] if i == j else 0.0) for j in free] for i in free]
            rhs = [self._b[i] + lam[i] * self.prior[i] for i in free]
            solved = _solve(a, rhs)
            if solved is None:
                return
            theta = [0.0] * n
            for k, i in enumerate(free):
                theta[i] = solved[k]
            negative = [i for i in free if theta[i] < 0]
            if not negative:
                break
            free = [i for i in free if i not in negative]
            if not free:
                break
        self._theta = [max(0.0, t) for t in theta]


class TTFTCalibrator:
    """Fits per (endpoint, model), each regularised towards the pooled fit of its model.

    An endpoint's own fit is trusted only while it keeps learning: one that has not seen a request
    for `stale_after_s` predicts like its pool again, so a replica that once looked slow (and was
    avoided since) is not avoided forever on old evidence.
    """

    # How close an endpoint's fit stays to its pool's, per term (see ENDPOINT_PRIOR_WEIGHTS).
    endpoint_prior_weights: Sequence[float] = ENDPOINT_PRIOR_WEIGHTS

    def __init__(self, prior: Sequence[float], *, capacity: int = 1024, decay: float = 0.95,
                 prior_weight: float = 0.05, stale_after_s: float = 30.0) -> None:
        self.prior = self._full_prior(prior)
        self.stale_after_s = stale_after_s
        self._last_seen: dict[tuple[str, str], float] = {}
        self.capacity = capacity
        self.decay = decay
        self.prior_weight = prior_weight
        self._pools: OrderedDict[str, RobustLinearFit] = OrderedDict()
        self._fits: OrderedDict[tuple[str, str], RobustLinearFit] = OrderedDict()
        self.evicted = 0

    def _full_prior(self, prior: Sequence[float]) -> tuple[float, ...]:
        return full_prior(prior)

    def _new_fit(self, prior: Sequence[float], weights: float | Sequence[float] | None = None) -> RobustLinearFit:
        return RobustLinearFit(prior, prior_weight=self.prior_weight if weights is None else weights,
                               decay=self.decay)

    def _pool(self, model: str) -> RobustLinearFit:
        pool = self._pools.get(model)
        if pool is None:
            pool = self._pools[model] = self._new_fit(self.prior)
            while len(self._pools) > self.capacity:
                self._pools.popitem(last=False)
                self.evicted += 1
        return pool

    def fit(self, endpoint: str, model: str) -> RobustLinearFit | None:
        """The endpoint's own fit, if it has observations."""
        return self._fits.get((endpoint, model))

    def coefficients(self, endpoint: str, model: str, now: float | None = None) -> tuple[float, ...]:
        """Coefficients (TERMS order) for an endpoint: its own fit, else its model's pool, else the prior."""
        key = (endpoint, model)
        fit = self._fits.get(key)
        if fit is not None and (now is None or now - self._last_seen.get(key, now) <= self.stale_after_s):
            return fit.coefficients()
        pool = self._pools.get(model)
        return pool.coefficients() if pool is not None else self.prior

    def observe(self, endpoint: str, model: str, x: Sequence[float], ttft_s: float,
                now: float | None = None) -> None:
        """Learn from one request served by `endpoint` (`now`: when, for the staleness of its fit)."""
        if not (ttft_s >= 0.0 and math.isfinite(ttft_s)):  # (the latency this model fits)
            return
        pool = self._pool(model)
        pool.observe(x, ttft_s)
        key = (endpoint, model)
        fit = self._fits.get(key)
        if fit is None:
            fit = self._fits[key] = self._new_fit(pool.coefficients(), self.endpoint_prior_weights)
            while len(self._fits) > self.capacity:
                old, _ = self._fits.popitem(last=False)
                self._last_seen.pop(old, None)
                self.evicted += 1
        else:
            self._fits.move_to_end(key)
            fit.set_prior(pool.coefficients())
        fit.observe(x, ttft_s)
        if now is not None:
            self._last_seen[key] = now

    def fits(self) -> list[tuple[str, str, RobustLinearFit]]:
        """Every per-endpoint fit: (endpoint, model, fit)."""
        return [(ep, model, fit) for (ep, model), fit in self._fits.items()]
