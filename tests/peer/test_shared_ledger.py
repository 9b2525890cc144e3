"""The shared in-flight ledger as tables: own bookings published, peers' bookings counted beside them."""

from __future__ import annotations

from epp.peer.ledger import SharedInflightLedger
from tests.scheduling.sched_fixtures import endpoint


class Recorder:
    def __init__(self) -> None:
        self.sent: list[tuple] = []

    def publish_booked(self, ticket, endpoint, uncached_tokens):
        self.sent.append(("booked", ticket, endpoint, uncached_tokens))

    def publish_released(self, ticket, prefill_only):
        self.sent.append(("released", ticket, prefill_only))


def loads(ledger, endpoints, now):
    return [(ld.inflight_requests, ld.unseen_requests, ld.prefilling_requests, ld.prefill_tokens)
            for ld in (ledger.load(ep, now) for ep in endpoints)]


def test_own_bookings_are_published_as_booked_prefill_done_and_released():
    peers = Recorder()
    ledger = SharedInflightLedger(peers)
    a = endpoint(0)
    booking = ledger.pick(a.name, prompt_tokens=300, uncached_tokens=100, now=1.01)
    ledger.first_token(booking, now=1.02)
    ledger.first_token(booking, now=1.03)  # a second first token is no news
    ledger.complete(booking)
    assert peers.sent == [("booked", booking.ticket, a.name, 100), ("released", booking.ticket, True),
                          ("released", booking.ticket, False)]


def test_peer_bookings_table():
    ledger = SharedInflightLedger(Recorder(), request_timeout_s=10, prefill_timeout_s=5)
    a, b = endpoint(0), endpoint(1)  # scraped at t = 1.0
    # action                                         -> (inflight, unseen, prefilling, prefill tokens) for a, b
    ledger.peer_booked("p1", 1, a.name, 200, now=0.5)  # arrived before the scrape: the scrape shows it
    ledger.peer_booked("p1", 2, a.name, 50, now=1.5)
    ledger.pick(a.name, prompt_tokens=10, now=1.6)
    assert loads(ledger, [a, b], 1.7) == [(3, 2, 3, 260), (0, 0, 0, 0)]
    ledger.peer_booked("p2", 1, b.name, 70, now=1.8)  # same ticket, another picker: another booking
    ledger.peer_released("p1", 2, prefill_only=True)
    assert loads(ledger, [a, b], 1.9) == [(3, 2, 2, 210), (1, 1, 1, 70)]
    ledger.peer_released("p1", 1, prefill_only=False)
    ledger.peer_released("p1", 1, prefill_only=False)  # twice is harmless
    assert loads(ledger, [a, b], 1.9) == [(2, 2, 1, 10), (1, 1, 1, 70)]
    ledger.forget_peer("p2")  # its link dropped
    assert loads(ledger, [a, b], 1.9) == [(2, 2, 1, 10), (0, 0, 0, 0)]
    ledger.expire(now=7.0)  # prefill timeout (5 s) passed for every booking
    assert loads(ledger, [a, b], 7.0) == [(2, 2, 0, 0), (0, 0, 0, 0)]
    ledger.expire(now=12.0)  # request timeout (10 s)
    assert loads(ledger, [a, b], 12.0) == [(0, 0, 0, 0), (0, 0, 0, 0)]
    assert ledger.remote_bookings == 0


def test_peer_bookings_are_bounded_by_the_capacity_oldest_first():
    ledger = SharedInflightLedger(Recorder(), capacity=3)
    a = endpoint(0)
    for ticket in range(5):
        ledger.peer_booked("p", ticket, a.name, 10, now=2.0 + ticket)
    assert ledger.remote_bookings == 3
    assert loads(ledger, [a], 9.0) == [(3, 3, 3, 30)]
    ledger.remove_endpoint(a.name)
    assert ledger.remote_bookings == 0 and loads(ledger, [a], 9.0) == [(0, 0, 0, 0)]


def test_the_prefill_backlog_counts_own_and_peers_prefills_in_the_order_they_arrived():
    import pytest

    from epp.framework.load import PRIOR_PREFILL_S_PER_TOKEN as S

    ledger = SharedInflightLedger(Recorder())
    a, b = endpoint(0), endpoint(1)
    ledger.peer_booked("p1", 1, a.name, 1000, now=10.0)  # a peer's prefill alone: a has no own booking
    assert ledger.load(a, 10.0 + 500 * S).prefill_backlog_tokens == pytest.approx(500)
    ledger.pick(a.name, prompt_tokens=1000, now=10.0 + 500 * S)  # own, queued behind the peer's
    load = ledger.load(a, 10.0 + 500 * S)
    assert (load.prefill_backlog_tokens, load.prefill_backlog_requests) == (pytest.approx(1500), pytest.approx(1.5))
    ledger.pick(b.name, prompt_tokens=1000, now=10.0)  # own only
    assert ledger.load(b, 10.0 + 500 * S).prefill_backlog_tokens == pytest.approx(500)
