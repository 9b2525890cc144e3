"""`--metrics-endpoint-auth`: the metrics port answers only bearer tokens the Kubernetes API accepts,
as the llm-d EPP's does (controller-runtime's authentication and authorization filter).

Each request's `Authorization: Bearer <token>` is reviewed with a TokenReview (who is it?) and a
SubjectAccessReview (may that user `<method>` the non-resource URL `<path>`, e.g. `get` on
`/metrics`). No token, or one the API does not accept: 401. Accepted but not allowed: 403. The API
not answering: 500. Answers are cached as controller-runtime caches them: tokens 1 minute, an
allowed access 5 minutes, a denied one 30 seconds; each cache holds at most `capacity` entries and
evicts the least recently used (`epp_metrics_auth_cache_entries`, `_evictions_total`).

The reviews run on the picker's event loop (an async API client); the metrics server's threads wait
for them there (`guard_wsgi`), the worker supervisor's aiohttp server awaits them (`aiohttp_guard`).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from epp.kube.reviews import AccessDecision, KubernetesReviews, ReviewError, UserInfo
from epp.logutil import Throttled

log = logging.getLogger(__name__)

# controller-runtime's TTLs for the metrics filter's caches.
TOKEN_TTL_S = 60.0
ALLOWED_TTL_S = 300.0
DENIED_TTL_S = 30.0
DEFAULT_CAPACITY = 1024
# A bearer token longer than this is refused without asking the API (service account tokens are ~1 KiB).
MAX_TOKEN_CHARS = 16 * 1024
# How long a metrics-server thread waits for a review on the event loop.
REVIEW_WAIT_S = 15.0

WsgiApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


@dataclass(frozen=True)
class AuthAnswer:
    """What to do with one request: pass it on (status 200), or answer `status` with `message`."""

    status: int
    message: str = ""

    @property
    def allowed(self) -> bool:
        """Whether the request goes on to the page."""
        return self.status == 200


_MISSING = object()


class TtlCache:
    """A bounded map whose entries expire: least recently used out first when full."""

    def __init__(self, name: str, capacity: int, entries: Gauge, evictions: Counter,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if capacity < 1:
            raise ValueError("a cache needs a capacity of at least 1")
        self.capacity = capacity
        self._clock = clock
        self._items: OrderedDict[Hashable, tuple[float, Any]] = OrderedDict()
        self._entries = entries.labels(name)
        self._evictions = evictions.labels(name)

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: Hashable) -> Any:
        """The live value of `key`, or `_MISSING`."""
        item = self._items.get(key)
        if item is None:
            return _MISSING
        if item[0] <= self._clock():
            del self._items[key]
            self._entries.set(len(self._items))
            return _MISSING
        self._items.move_to_end(key)
        return item[1]

    def put(self, key: Hashable, value: Any, ttl_s: float) -> None:
        """Keep `value` for `ttl_s` seconds, evicting the least recently used entry if full."""
        self._items[key] = (self._clock() + ttl_s, value)
        self._items.move_to_end(key)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)
            self._evictions.inc()
        self._entries.set(len(self._items))


class MetricsAuth:
    """Decides, for each request to the metrics port, whether its bearer token may read the path."""

    def __init__(self, reviews: KubernetesReviews, registry: CollectorRegistry, *,
                 capacity: int = DEFAULT_CAPACITY, clock: Callable[[], float] = time.monotonic) -> None:
        self.reviews = reviews
        entries = Gauge("epp_metrics_auth_cache_entries", "Cached review answers of --metrics-endpoint-auth.",
                        ["cache"], registry=registry)
        evictions = Counter("epp_metrics_auth_cache_evictions", "Review answers evicted from a full cache.",
                            ["cache"], registry=registry)
        self._reviewed = Counter("epp_metrics_auth_reviews",
                                 "TokenReviews and SubjectAccessReviews sent to the Kubernetes API, by outcome.",
                                 ["review", "outcome"], registry=registry)
        self._answers = Counter("epp_metrics_auth_requests", "Requests to the metrics port, by the status "
                                "--metrics-endpoint-auth gave them (200: passed on).", ["code"], registry=registry)
        self.tokens = TtlCache("tokens", capacity, entries, evictions, clock)
        self.access = TtlCache("access", capacity, entries, evictions, clock)
        self._failures = Throttled(log)

    async def check(self, authorization: str | None, method: str, path: str) -> AuthAnswer:
        """The answer for a request with this `Authorization` header, HTTP method and path."""
        answer = await self._decide(authorization, method.lower(), path)
        self._answers.labels(str(answer.status)).inc()
        return answer

    async def _decide(self, authorization: str | None, verb: str, path: str) -> AuthAnswer:
        scheme, _, token = (authorization or "").strip().partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token or len(token) > MAX_TOKEN_CHARS:
            return AuthAnswer(401, "Unauthorized")
        # The cache never holds a token itself, only its digest.
        key = hashlib.sha256(token.encode()).hexdigest()
        user = self.tokens.get(key)
        if user is _MISSING:
            try:
                user = await self.reviews.authenticate(token)
            except ReviewError as exc:
                self._reviewed.labels("token", "error").inc()
                self._failures.log(logging.ERROR, "token", "metrics auth: %s", exc)
                return AuthAnswer(500, "Authentication failed")
            self._reviewed.labels("token", "authenticated" if user is not None else "refused").inc()
            self.tokens.put(key, user, TOKEN_TTL_S)
        if user is None:
            return AuthAnswer(401, "Unauthorized")
        assert isinstance(user, UserInfo)
        access_key = (user, verb, path)
        decision = self.access.get(access_key)
        if decision is _MISSING:
            try:
                decision = await self.reviews.authorize(user, verb, path)
            except ReviewError as exc:
                self._reviewed.labels("access", "error").inc()
                self._failures.log(logging.ERROR, "access", "metrics auth: %s", exc)
                return AuthAnswer(500, f"Authorization for user {user.username} failed")
            assert isinstance(decision, AccessDecision)
            self._reviewed.labels("access", "allowed" if decision.allowed else "denied").inc()
            self.access.put(access_key, decision, ALLOWED_TTL_S if decision.allowed else DENIED_TTL_S)
        if not decision.allowed:
            return AuthAnswer(403, f"Authorization denied for user {user.username}")
        return AuthAnswer(200)

    async def close(self) -> None:
        """Close the API client."""
        await self.reviews.close()


def _refusal(start_response: Callable[..., Any], answer: AuthAnswer) -> list[bytes]:
    body = (answer.message + "\n").encode()
    headers = [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(body))),
               ("X-Content-Type-Options", "nosniff")]
    if answer.status == 401:
        headers.append(("WWW-Authenticate", "Bearer"))
    start_response(f"{answer.status} {HTTPStatus(answer.status).phrase}", headers)
    return [body]


def guard_wsgi(app: WsgiApp, auth: MetricsAuth, loop: asyncio.AbstractEventLoop) -> WsgiApp:
    """`app` behind `auth`: each request (on a server thread) waits for its review on `loop`."""

    def guarded(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        check = auth.check(environ.get("HTTP_AUTHORIZATION"), environ.get("REQUEST_METHOD", "GET"),
                           environ.get("PATH_INFO", "/"))
        try:
            answer = asyncio.run_coroutine_threadsafe(check, loop).result(REVIEW_WAIT_S)
        except RuntimeError:  # the loop is closed: the picker is stopping
            check.close()
            answer = AuthAnswer(503, "the picker is shutting down")
        except TimeoutError:
            answer = AuthAnswer(503, "the review did not finish in time")
        if answer.allowed:
            return app(environ, start_response)
        return _refusal(start_response, answer)

    return guarded


def aiohttp_guard(auth: MetricsAuth) -> Any:
    """An aiohttp middleware putting every route of an application behind `auth`."""
    from aiohttp import web

    @web.middleware
    async def middleware(request: web.Request, handler: Any) -> web.StreamResponse:
        answer = await auth.check(request.headers.get("Authorization"), request.method, request.path)
        if answer.allowed:
            return await handler(request)
        headers = {"WWW-Authenticate": "Bearer"} if answer.status == 401 else {}
        return web.Response(status=answer.status, text=answer.message + "\n", headers=headers)

    return middleware


async def metrics_auth_from(kubeconfig: str | None, registry: CollectorRegistry) -> MetricsAuth:
    """A `MetricsAuth` reviewing through the API server the picker's credentials reach."""
    from epp.kube.client import load_api_client

    return MetricsAuth(KubernetesReviews(await load_api_client(kubeconfig)), registry)
