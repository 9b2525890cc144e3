"""In-flight load accounting: the picker's own work that scraped metrics cannot show yet.

Scraped gauges (`num_requests_waiting`, KV usage) are up to one scrape interval old, and a
replica in mid-prefill reports its request as *running*, so it looks as idle as one that is only
decoding. The director books every pick here (`pick`), marks its prefill done when the first
token (or, for a non-streamed response, the response headers) comes back (`first_token`), and
releases it when the response ends (`complete`). A stream that ends before any response header
reached the picker (Envoy set to keep responses from it, a client that left) may leave its request
running on the endpoint: `complete(..., response_seen=False)` keeps it counted until a scrape
taken after the pick, which shows it. Load-aware scorers read `load(endpoint)`:

- `unseen_requests`: picks sent after the endpoint's last scrape (the scrape cannot show them);
- `prefilling_requests` / `prefill_tokens`: picks whose first token has not been seen, and their
  uncached prompt tokens (prompt minus the prefix match the picker predicted);
- `inflight_requests`: picks not yet complete; `scrape_age_s`: how old the scrape is;
- `prefill_backlog_tokens` / `prefill_backlog_requests`: the part of those prefills still to do
  now. Two endpoints each with one prefill in flight are not equally busy when one started it a
  moment ago and the other is about to finish; the ledger models each endpoint as working through
  its picks' prefills in pick order at a speed it learns from its own uncontended first tokens,
  and counts each unfinished prefill at least `BACKLOG_FLOOR` of its tokens (the endpoint may be
  slower than learned). Round-robin gets this right by construction with equal requests (the next
  endpoint in turn is the one that started its last prefill longest ago); a load-aware picker that
  counts whole requests ties the two and loses to it. The predicted-TTFT scorer reads the backlog;
  the min-max load scorers keep whole requests (see `waiting_estimate`).

The `*_estimate` helpers combine them with the scrape so that no signal is stale in the
picker's favour: `waiting = max(scraped waiting + unseen, own prefilling)` (max, not sum: once
scraped, the picker's own requests show in both), likewise for running requests and KV usage.

Several pickers: each one knows its own work exactly and the others' only through the scrape,
so its view of an endpoint misses at most the other pickers' picks of the last
`scrape_age_s + interval` seconds (their request rate times that window); a single picker's
view misses nothing it sent.

Bounded: at most `capacity` requests are tracked (oldest dropped first); a request whose
completion is never seen expires after `request_timeout_s`, its prefill after `prefill_timeout_s`.
"""

from __future__ import annotations

import itertools
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from epp.framework.types import Endpoint, EndpointMetrics, InferenceRequest

CHARACTERS_PER_TOKEN = 4
# An unfinished prefill counts at least this share of its tokens as still to do.
BACKLOG_FLOOR = 0.1
# Prefill seconds per token assumed for an endpoint before its first uncontended first token
# (an 8B model on one GPU does ~5e-5; assuming slower keeps in-flight prefills counted longer).
PRIOR_PREFILL_S_PER_TOKEN = 2e-4
# Uncontended first tokens of shorter prefills are mostly fixed latency: they teach no speed.
MIN_SPEED_SAMPLE_TOKENS = 256
SPEED_EWMA_WEIGHT = 0.2


def prefill_backlog(prefills: Iterable[tuple[float, int]], s_per_token: float, now: float,
                    totals: tuple[int, int] | None = None) -> tuple[float, float]:
    """Tokens and requests (fractional) still to prefill of `(sent_at, uncached tokens)` in send order.

    The endpoint works through them one after the other at `s_per_token`; each unfinished one
    counts between `BACKLOG_FLOOR` and all of itself (a whole-prompt cache hit, 0 tokens, only the
    floor). Everything behind the first prefill not yet done waits in full, so the walk stops there
    and counts the rest from `totals`: the tokens and number of `prefills`, which then must hold no
    cache hits (the caller adds their floor, so that they never lengthen the walk). On the request
    path this costs the prefills the model has done but whose first token was not seen yet, plus one.
    """
    if totals is None:
        listed = list(prefills)
        prefills = [p for p in listed if p[1] > 0]
        tokens, requests = prefill_backlog(prefills, s_per_token, now, (sum(u for _, u in prefills), len(prefills)))
        return tokens, requests + BACKLOG_FLOOR * (len(listed) - len(prefills))
    free_at = -math.inf
    tokens = requests = 0.0
    seen_tokens = seen = 0
    for sent_at, uncached in prefills:
        duration = uncached * s_per_token
        free_at = max(free_at, sent_at) + duration
        seen_tokens += uncached
        seen += 1
        if free_at > now:
            left = max(BACKLOG_FLOOR, min(1.0, (free_at - now) / duration))
            return (tokens + left * uncached + (totals[0] - seen_tokens),
                    requests + left + (totals[1] - seen))
        tokens += BACKLOG_FLOOR * uncached
        requests += BACKLOG_FLOOR
    return tokens, requests


@dataclass(frozen=True, slots=True)
class EndpointLoad:
    """The picker's own work on one endpoint, next to how old that endpoint's scrape is."""

    inflight_requests: int = 0
    unseen_requests: int = 0
    prefilling_requests: int = 0
    prefill_tokens: int = 0
    unseen_prefill_tokens: int = 0
    scrape_age_s: float = math.inf
    prefill_backlog_tokens: float = 0.0
    prefill_backlog_requests: float = 0.0

    def waiting_estimate(self, metrics: EndpointMetrics) -> float:
        """Requests ahead of a new one: scraped queue plus unseen picks, at least the own prefills."""
        # Whole requests, not the backlog's fractions: min-max scorers (GIE's queue-scorer) stretch
        # any difference to the full 0..1, and fractions let them outvote a partial prefix match
        # (shared-prefix, GIE's precise weights: TTFT p90 0.80 -> 2.15 s with fractions).
        return float(max(metrics.waiting_queue_size + self.unseen_requests, self.prefilling_requests))

    def running_estimate(self, metrics: EndpointMetrics) -> float:
        """Requests on the endpoint: scraped running plus unseen picks, at least the own in-flight."""
        return float(max(metrics.running_requests_size + self.unseen_requests, self.inflight_requests))

    def kv_usage_estimate(self, metrics: EndpointMetrics) -> float:
        """Scraped KV usage plus the blocks unseen picks will take (when the cache size is known)."""
        usage = metrics.kv_cache_usage
        if self.unseen_prefill_tokens > 0 and metrics.cache_num_blocks > 0 and metrics.cache_block_size > 0:
            usage += self.unseen_prefill_tokens / (metrics.cache_block_size * metrics.cache_num_blocks)
        return min(1.0, usage)


NO_LOAD = EndpointLoad()


@dataclass(slots=True, eq=False)
class Booking:
    """One pick as the ledger tracks it; `first_token_at` is set when its prefill is seen done."""

    ticket: int
    endpoint: str
    model: str
    picked_at: float
    prompt_tokens: int
    uncached_tokens: int
    cpu_tokens: int = 0
    disk_tokens: int = 0
    # What was ahead of it on its endpoint when it was picked (for calibrating queue costs).
    ahead_tokens: int = 0
    ahead_requests: int = 0
    running: int = 0
    waiting: float = 0.0  # the endpoint's scraped waiting queue when it was picked
    first_token_at: float | None = None
    ttft_observed: bool = False  # first_token_at is a first token, not the end of a whole response
    prompt_characters: int = 0  # of the prompt text (with usage.prompt_tokens: characters per token)

    @property
    def prefilling(self) -> bool:
        return self.first_token_at is None


Observer = Callable[[Booking, Any], None]


class UnseenPicks:
    """Picks an endpoint's latest scrape cannot show yet (sent after it), and their prefill tokens.

    Kept up to date as picks arrive, end their prefill and leave, so that a read walks the picks
    only when a new scrape arrived since the last read (newest first, to the first one it shows):
    without scrapes a read costs nothing however many picks are held.
    """

    __slots__ = ("since", "count", "tokens")

    def __init__(self) -> None:
        self.since = -math.inf  # the scrape time `count` and `tokens` refer to
        self.count = 0
        self.tokens = 0

    def added(self, at: float, tokens: int) -> None:
        if at > self.since:
            self.count += 1
            self.tokens += tokens

    def prefill_ended(self, at: float, tokens: int) -> None:
        if at > self.since:
            self.tokens -= tokens

    def removed(self, at: float) -> None:
        if at > self.since:
            self.count -= 1

    def read(self, scraped_at: float, newest_first: Callable[[], Iterable[tuple[float, int]]]) -> tuple[int, int]:
        """(picks, prefill tokens) after `scraped_at`; `newest_first` yields (sent at, tokens still to prefill)."""
        if scraped_at != self.since:
            count = tokens = 0
            for at, prefill_tokens in newest_first():
                if at <= scraped_at:
                    break
                count += 1
                tokens += prefill_tokens
            self.since, self.count, self.tokens = scraped_at, count, tokens
        return self.count, self.tokens


class _EndpointBook:
    __slots__ = ("inflight", "prefills", "prefill_tokens", "prefilling", "unanswered", "unseen")

    def __init__(self) -> None:
        self.inflight: OrderedDict[int, Booking] = OrderedDict()  # pick order
        # The unfinished prefills with tokens to do, so that the backlog model walks neither
        # decoding requests nor cache hits.
        self.prefills: OrderedDict[int, Booking] = OrderedDict()  # pick order
        self.prefilling = 0
        self.prefill_tokens = 0
        # Ended without a response the picker saw: counted until a scrape taken after the pick.
        self.unanswered: OrderedDict[int, Booking] = OrderedDict()  # pick order
        self.unseen = UnseenPicks()

    def newest_first(self) -> Iterator[tuple[float, int]]:
        return ((b.picked_at, b.uncached_tokens if b.first_token_at is None else 0)
                for b in reversed(self.inflight.values()))


class InflightLedger:
    """Per-endpoint requests and prefill tokens this picker sent and has not seen finish."""

    def __init__(self, *, request_timeout_s: float = 300.0, prefill_timeout_s: float = 60.0,
                 capacity: int = 100_000) -> None:
        if request_timeout_s <= 0 or prefill_timeout_s <= 0 or capacity < 1:
            raise ValueError("timeouts must be > 0 and capacity >= 1")
        self.request_timeout_s = request_timeout_s
        self.prefill_timeout_s = prefill_timeout_s
        self.capacity = capacity
        self._all: OrderedDict[int, Booking] = OrderedDict()  # pick order, every endpoint
        self._prefilling: OrderedDict[int, Booking] = OrderedDict()
        self._books: dict[str, _EndpointBook] = {}
        self._ids = itertools.count(1)
        self._observers: list[Observer] = []
        self._s_per_token: dict[str, float] = {}  # learned prefill speed per endpoint
        self.dropped = 0  # bookings dropped at capacity or timeout (their end was never seen)

    def __len__(self) -> int:
        return len(self._all)

    # -- reading ----------------------------------------------------------------------------

    def load(self, endpoint: Endpoint, now: float | None = None) -> EndpointLoad:
        """The picker's own load on `endpoint` against its latest scrape."""
        now = time.monotonic() if now is None else now
        scraped_at = endpoint.metrics.update_time
        age = now - scraped_at if scraped_at > 0 else math.inf
        book = self._books.get(endpoint.name)
        if book is not None and book.unanswered:
            self._settle_unanswered(book, scraped_at)
            book = self._books.get(endpoint.name)
        if book is None:
            return EndpointLoad(scrape_age_s=age) if age != math.inf else NO_LOAD
        unseen, unseen_tokens = book.unseen.read(scraped_at, book.newest_first)
        backlog_tokens, backlog_requests = self.backlog(endpoint.name, now)
        return EndpointLoad(len(book.inflight), unseen, book.prefilling, book.prefill_tokens, unseen_tokens,
                            age, backlog_tokens, backlog_requests)

    def prefill_seconds_per_token(self, endpoint: str) -> float:
        """The prefill speed the backlog model uses for `endpoint` (learned, or the prior)."""
        return self._s_per_token.get(endpoint, PRIOR_PREFILL_S_PER_TOKEN)

    def backlog(self, endpoint: str, now: float) -> tuple[float, float]:
        """Prefill tokens and (fractional) requests on `endpoint` still to do now (see `prefill_backlog`)."""
        tokens, with_tokens, cache_hits = self._prefill_totals(endpoint)
        if not with_tokens and not cache_hits:
            return 0.0, 0.0
        backlog_tokens, backlog_requests = prefill_backlog(
            self._prefills(endpoint), self.prefill_seconds_per_token(endpoint), now, (tokens, with_tokens))
        return backlog_tokens, backlog_requests + BACKLOG_FLOOR * cache_hits

    def _prefills(self, endpoint: str) -> Iterator[tuple[float, int]]:
        """`(sent_at, uncached tokens)` of the unfinished prefills on `endpoint` with tokens to do, in send order."""
        book = self._books.get(endpoint)
        if book is None or not book.prefills:
            return iter(())
        return ((b.picked_at, b.uncached_tokens) for b in book.prefills.values())

    def _prefill_totals(self, endpoint: str) -> tuple[int, int, int]:
        """Uncached tokens and number of the unfinished prefills `_prefills` yields, and of the cache hits."""
        book = self._books.get(endpoint)
        if book is None:
            return 0, 0, 0
        return book.prefill_tokens, len(book.prefills), book.prefilling - len(book.prefills)

    def bookings(self) -> Iterator[Booking]:
        """Every tracked booking, oldest first."""
        return iter(list(self._all.values()))

    def endpoints(self) -> list[str]:
        """Endpoints with work in flight."""
        return list(self._books)

    def debug_state(self) -> dict[str, Any]:
        """Counts, bounds and the learned prefill speeds, for `GET /debug/state` (per-endpoint loads: `load`)."""
        return {"bookings": len(self._all), "prefilling": len(self._prefilling), "capacity": self.capacity,
                "dropped": self.dropped, "request_timeout_s": self.request_timeout_s,
                "prefill_timeout_s": self.prefill_timeout_s,
                "learned_prefill_s_per_token": dict(self._s_per_token)}

    # -- writing ----------------------------------------------------------------------------

    def add_observer(self, observer: Observer) -> None:
        """Call `observer(booking, response)` when a booking completes (calibrators learn from it)."""
        self._observers.append(observer)

    def pick(self, endpoint: str, *, model: str = "", prompt_tokens: int = 0, uncached_tokens: int | None = None,
             cpu_tokens: int = 0, disk_tokens: int = 0, running: int = 0, waiting: float = 0.0,
             prompt_characters: int = 0, now: float | None = None) -> Booking:
        """Book a request sent to `endpoint`; its uncached tokens count as prefill until its first token."""
        now = time.monotonic() if now is None else now
        self.expire(now)
        uncached = prompt_tokens if uncached_tokens is None else max(0, min(uncached_tokens, prompt_tokens))
        ahead_tokens, _ = self.backlog(endpoint, now)
        book = self._books.get(endpoint)
        if book is None:
            book = self._books[endpoint] = _EndpointBook()
        booking = Booking(next(self._ids), endpoint, model, now, prompt_tokens, uncached, cpu_tokens, disk_tokens,
                          ahead_tokens=round(ahead_tokens), ahead_requests=book.prefilling, running=running,
                          waiting=waiting, prompt_characters=prompt_characters)
        self._all[booking.ticket] = booking
        self._prefilling[booking.ticket] = booking
        book.inflight[booking.ticket] = booking
        book.unseen.added(now, uncached)
        if uncached > 0:
            book.prefills[booking.ticket] = booking
        book.prefilling += 1
        book.prefill_tokens += uncached
        while len(self._all) > self.capacity:
            _, oldest = self._all.popitem(last=False)
            self._forget(oldest)
            self.dropped += 1
        return booking

    def first_token(self, booking: Booking | None, *, observed: bool = True, now: float | None = None) -> None:
        """The booking's prefill is done (its first token, or its whole response, came back)."""
        if booking is None or not booking.prefilling or booking.ticket not in self._all:
            return
        booking.first_token_at = time.monotonic() if now is None else now
        booking.ttft_observed = observed
        self._end_prefill(booking)
        if observed and booking.ahead_requests == 0 and booking.uncached_tokens >= MIN_SPEED_SAMPLE_TOKENS:
            self._learn_speed(booking.endpoint, (booking.first_token_at - booking.picked_at) / booking.uncached_tokens)

    def _learn_speed(self, endpoint: str, s_per_token: float) -> None:
        """Move the endpoint's prefill speed towards one uncontended request's (a moving average)."""
        old = self._s_per_token.get(endpoint)
        self._s_per_token[endpoint] = s_per_token if old is None else old + SPEED_EWMA_WEIGHT * (s_per_token - old)

    def complete(self, booking: Booking | None, response: Any = None, *, response_seen: bool = True) -> None:
        """The booking's stream ended: stop counting it (once scraped, if its response was never seen)."""
        if booking is None or booking.ticket not in self._all:
            return
        book = self._books.get(booking.endpoint)
        if response_seen or book is None:
            del self._all[booking.ticket]
            self._forget(booking)
        elif booking.ticket in book.unanswered:
            return
        else:
            book.unanswered[booking.ticket] = booking
        for observer in self._observers:
            observer(booking, response)

    def _settle_unanswered(self, book: _EndpointBook, scraped_at: float) -> None:
        """Stop counting unanswered requests that a scrape taken after their pick already shows."""
        unanswered = book.unanswered
        while unanswered:
            booking = next(iter(unanswered.values()))
            if booking.picked_at > scraped_at:
                break
            del unanswered[booking.ticket]
            if self._all.pop(booking.ticket, None) is not None:
                self._forget(booking)

    def expire(self, now: float | None = None) -> None:
        """Drop bookings past their timeouts (their first token or end was never seen)."""
        now = time.monotonic() if now is None else now
        prefilling = self._prefilling
        while prefilling:
            booking = next(iter(prefilling.values()))
            if booking.picked_at + self.prefill_timeout_s > now:
                break
            booking.first_token_at = now
            self._end_prefill(booking)
        entries = self._all
        while entries:
            booking = next(iter(entries.values()))
            if booking.picked_at + self.request_timeout_s > now:
                break
            del entries[booking.ticket]
            self._forget(booking)
            self.dropped += 1

    def remove_endpoint(self, endpoint: str) -> None:
        """Forget an endpoint that left the pool."""
        self._s_per_token.pop(endpoint, None)
        book = self._books.pop(endpoint, None)
        if book is None:
            return
        for ticket in book.inflight:
            self._all.pop(ticket, None)
            self._prefilling.pop(ticket, None)

    def _end_prefill(self, booking: Booking) -> None:
        if self._prefilling.pop(booking.ticket, None) is None:
            return
        book = self._books.get(booking.endpoint)
        if book is not None:
            book.prefills.pop(booking.ticket, None)
            book.prefilling -= 1
            book.prefill_tokens -= booking.uncached_tokens
            book.unseen.prefill_ended(booking.picked_at, booking.uncached_tokens)

    def _forget(self, booking: Booking) -> None:
        self._end_prefill(booking)
        book = self._books.get(booking.endpoint)
        if book is None:
            return
        if book.inflight.pop(booking.ticket, None) is not None:
            book.unseen.removed(booking.picked_at)
        book.unanswered.pop(booking.ticket, None)
        if not book.inflight:
            del self._books[booking.endpoint]


# The body fields that hold prompt text: OpenAI's, Anthropic's `system`, rerank's `query` and `documents`.
_PROMPT_FIELDS = ("system", "prompt", "messages", "input", "instructions", "items", "query", "documents")


def _text_length(value: Any, budget: int, depth: int = 0) -> int:
    """Characters of the strings inside `value` (at most `budget`, nesting at most 8 deep)."""
    if isinstance(value, str):
        return min(len(value), budget)
    if depth >= 8:
        return 0
    total = 0
    items: Iterable[Any] = value.values() if isinstance(value, Mapping) else value if isinstance(value, list) else ()
    # Strings and token ids are counted in place, and so is one level of plain dicts: a chat's
    # messages are hundreds of dicts of strings (a call per value tripled the cost of a long chat).
    for item in items:
        if total >= budget:
            break
        cls = type(item)
        if cls is str:
            rest = budget - total
            total += len(item) if len(item) < rest else rest
        elif cls is dict and depth < 7:
            for child in item.values():
                if total >= budget:
                    break
                kind = type(child)
                if kind is str:
                    rest = budget - total
                    total += len(child) if len(child) < rest else rest
                elif kind is int or (isinstance(child, int) and not isinstance(child, bool)):
                    total += CHARACTERS_PER_TOKEN  # a token id
                else:
                    total += _text_length(child, budget - total, depth + 2)
        elif cls is int or (isinstance(item, int) and not isinstance(item, bool)):
            total += CHARACTERS_PER_TOKEN  # a token id
        else:
            total += _text_length(item, budget - total, depth + 1)
    return total


def body_prompt_characters(body: Mapping[str, Any], limit: int = 1 << 22,
                           fields: tuple[str, ...] = _PROMPT_FIELDS) -> int:
    """Characters of a request body's prompt text: the strings of its prompt `fields` (a token id counts 4)."""
    parts = [body.get(key) for key in fields if key in body]
    return _text_length(parts, limit)


def prompt_characters(request: InferenceRequest, limit: int = 1 << 22) -> int:
    """Characters of the request's prompt text (strings of its prompt fields, any API; a token id counts 4).

    Counted once per request when the parser did (`request.prompt_chars`): a count below `limit`
    is what the walk up to `limit` gives too, so only a prompt as long as the limit is walked again.
    """
    counted = request.prompt_chars
    if counted is not None and counted < limit:
        return counted
    return body_prompt_characters(request.body, limit)


def estimate_prompt_tokens(request: InferenceRequest, limit_tokens: int = 1 << 20) -> int:
    """Prompt tokens guessed from the request's text at 4 characters a token (no tokenizer)."""
    return prompt_characters(request, limit_tokens * CHARACTERS_PER_TOKEN) // CHARACTERS_PER_TOKEN
