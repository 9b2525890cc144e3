"""An in-flight ledger that also counts the peers' bookings (received over the peer link).

A picker alone books its own picks (`epp.framework.load`); with peers, each of its bookings is
published (booked, prefill done, released) and the peers' ones are held here beside its own, so
load-aware scorers see the pool's whole in-flight work, not the own share of it. A peer's picks
count as unseen by a scrape when they arrived after that scrape. Bounded like the own bookings:
the same timeouts and capacity, and all of a peer's bookings go when its link drops (its work
then shows only through the scrape, as without a link).
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any, Protocol

from epp.framework.load import Booking, EndpointLoad, InflightLedger, UnseenPicks
from epp.framework.types import Endpoint


class BookingPublisher(Protocol):
    """What the ledger needs of the peer link."""

    def publish_booked(self, ticket: int, endpoint: str, uncached_tokens: int) -> None: ...

    def publish_released(self, ticket: int, prefill_only: bool) -> None: ...


class _RemoteBooking:
    __slots__ = ("key", "endpoint", "uncached", "received_at", "prefilling")

    def __init__(self, key: tuple[str, int], endpoint: str, uncached: int, received_at: float) -> None:
        self.key = key  # (picker, ticket)
        self.endpoint = endpoint
        self.uncached = uncached
        self.received_at = received_at
        self.prefilling = True


class _RemoteBook:
    __slots__ = ("bookings", "prefills", "cache_hits", "prefill_tokens", "unseen")

    def __init__(self) -> None:
        self.bookings: OrderedDict[tuple[str, int], _RemoteBooking] = OrderedDict()  # arrival order
        # Still prefilling, apart, so that reads and expiry never walk decoding requests.
        self.prefills: OrderedDict[tuple[str, int], _RemoteBooking] = OrderedDict()  # with tokens to do
        self.cache_hits: OrderedDict[tuple[str, int], _RemoteBooking] = OrderedDict()  # no token to do
        self.prefill_tokens = 0
        self.unseen = UnseenPicks()

    @property
    def prefilling(self) -> int:
        return len(self.prefills) + len(self.cache_hits)

    def newest_first(self) -> Iterator[tuple[float, int]]:
        return ((r.received_at, r.uncached if r.prefilling else 0) for r in reversed(self.bookings.values()))


class SharedInflightLedger(InflightLedger):
    """The picker's own bookings, published to its peers, plus the peers' bookings."""

    def __init__(self, publisher: BookingPublisher, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.publisher = publisher
        self._remote: OrderedDict[tuple[str, int], _RemoteBooking] = OrderedDict()
        self._remote_books: dict[str, _RemoteBook] = {}

    @property
    def remote_bookings(self) -> int:
        """Peers' bookings held now."""
        return len(self._remote)

    # -- own bookings, published ---------------------------------------------------------------

    def pick(self, endpoint: str, **kwargs: Any) -> Booking:
        booking = super().pick(endpoint, **kwargs)
        self.publisher.publish_booked(booking.ticket, endpoint, booking.uncached_tokens)
        return booking

    def first_token(self, booking: Booking | None, *, observed: bool = True, now: float | None = None) -> None:
        was_prefilling = booking is not None and booking.prefilling
        super().first_token(booking, observed=observed, now=now)
        if booking is not None and was_prefilling and not booking.prefilling:
            self.publisher.publish_released(booking.ticket, True)

    def complete(self, booking: Booking | None, response: Any = None, *, response_seen: bool = True) -> None:
        super().complete(booking, response, response_seen=response_seen)
        if booking is not None:  # an unanswered one too: the peers' scrapes will show it
            self.publisher.publish_released(booking.ticket, False)

    # -- peers' bookings -----------------------------------------------------------------------

    def peer_booked(self, picker: str, ticket: int, endpoint: str, uncached_tokens: int,
                    now: float | None = None) -> None:
        """A peer sent a request to `endpoint` with this many uncached tokens."""
        now = time.monotonic() if now is None else now
        key = (picker, ticket)
        if key in self._remote:
            return
        remote = _RemoteBooking(key, endpoint, uncached_tokens, now)
        self._remote[key] = remote
        book = self._remote_books.get(endpoint)
        if book is None:
            book = self._remote_books[endpoint] = _RemoteBook()
        book.bookings[key] = remote
        (book.prefills if uncached_tokens > 0 else book.cache_hits)[key] = remote
        book.prefill_tokens += uncached_tokens
        book.unseen.added(now, uncached_tokens)
        while len(self._remote) > self.capacity:
            oldest_key, oldest = self._remote.popitem(last=False)
            self._drop(oldest_key, oldest)

    def peer_released(self, picker: str, ticket: int, prefill_only: bool) -> None:
        """A peer's booking ended its prefill, or ended."""
        key = (picker, ticket)
        remote = self._remote.get(key)
        if remote is None:
            return
        if prefill_only:
            self._end_remote_prefill(remote)
            return
        del self._remote[key]
        self._drop(key, remote)

    def forget_peer(self, picker: str) -> None:
        """A peer's link dropped: its work shows through the scrape only, as without a link."""
        for key in [k for k in self._remote if k[0] == picker]:
            self._drop(key, self._remote.pop(key))

    def expire(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        super().expire(now)
        while self._remote:
            key, remote = next(iter(self._remote.items()))
            if remote.received_at + self.request_timeout_s > now:
                break
            del self._remote[key]
            self._drop(key, remote)
        for book in self._remote_books.values():
            for prefilling in (book.prefills, book.cache_hits):
                expired = list(itertools.takewhile(lambda r: r.received_at + self.prefill_timeout_s <= now,
                                                   prefilling.values()))
                for remote in expired:
                    self._end_remote_prefill(remote)

    def remove_endpoint(self, endpoint: str) -> None:
        super().remove_endpoint(endpoint)
        book = self._remote_books.pop(endpoint, None)
        if book is not None:
            for key in book.bookings:
                self._remote.pop(key, None)

    def load(self, endpoint: Endpoint, now: float | None = None) -> EndpointLoad:
        own = super().load(endpoint, now)
        book = self._remote_books.get(endpoint.name)
        if book is None:
            return own
        scraped_at = endpoint.metrics.update_time
        unseen, unseen_tokens = book.unseen.read(scraped_at, book.newest_first)
        now = time.monotonic() if now is None else now
        if own.scrape_age_s == math.inf and scraped_at > 0:  # NO_LOAD carries no age
            age = now - scraped_at
        else:
            age = own.scrape_age_s
        if own.inflight_requests:  # the base load ran the backlog model over own and peers' prefills
            backlog_tokens, backlog_requests = own.prefill_backlog_tokens, own.prefill_backlog_requests
        else:
            backlog_tokens, backlog_requests = self.backlog(endpoint.name, now)
        return EndpointLoad(own.inflight_requests + len(book.bookings), own.unseen_requests + unseen,
                            own.prefilling_requests + book.prefilling, own.prefill_tokens + book.prefill_tokens,
                            own.unseen_prefill_tokens + unseen_tokens, age, backlog_tokens, backlog_requests)

    def _prefills(self, endpoint: str) -> Iterator[tuple[float, int]]:
        """Own and peers' unfinished prefills on `endpoint`, in the order they reached this picker."""
        own = super()._prefills(endpoint)
        book = self._remote_books.get(endpoint)
        if book is None or not book.prefilling:
            return own
        remote = ((r.received_at, r.uncached) for r in book.prefills.values())
        return heapq.merge(own, remote, key=lambda item: item[0])

    def _prefill_totals(self, endpoint: str) -> tuple[int, int, int]:
        tokens, with_tokens, cache_hits = super()._prefill_totals(endpoint)
        book = self._remote_books.get(endpoint)
        if book is None:
            return tokens, with_tokens, cache_hits
        return tokens + book.prefill_tokens, with_tokens + len(book.prefills), cache_hits + len(book.cache_hits)

    def _end_remote_prefill(self, remote: _RemoteBooking) -> None:
        if not remote.prefilling:
            return
        remote.prefilling = False
        book = self._remote_books.get(remote.endpoint)
        if book is not None:
            (book.prefills if remote.uncached > 0 else book.cache_hits).pop(remote.key, None)
            book.prefill_tokens -= remote.uncached
            book.unseen.prefill_ended(remote.received_at, remote.uncached)

    def _drop(self, key: tuple[str, int], remote: _RemoteBooking) -> None:
        """Remove a booking (already out of `_remote`) from its endpoint's book."""
        self._end_remote_prefill(remote)
        book = self._remote_books.get(remote.endpoint)
        if book is None:
            return
        if book.bookings.pop(key, None) is not None:
            book.unseen.removed(remote.received_at)
        if not book.bookings:
            del self._remote_books[remote.endpoint]
