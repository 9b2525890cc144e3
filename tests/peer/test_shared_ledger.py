"""The shared in-flight ledger as tables: own bookings published, peers' bookings counted beside them."""

from __future__ import annotations

from epp.peer.ledger import SharedInflightLedger
from tests.support.scheduling import endpoint


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


def test_peers_bookings_kept_up_to_date_match_a_model_after_any_sequence_of_events():
    import random

    from epp.framework import Endpoint, EndpointMetrics

    rng = random.Random(5)
    ledger = SharedInflightLedger(Recorder(), request_timeout_s=8.0, prefill_timeout_s=3.0)
    names = [endpoint(i).name for i in range(2)]
    model: dict[tuple[str, int], dict] = {}  # key -> endpoint, tokens, at, prefilling
    now, scraped_at, ticket = 0.0, dict.fromkeys(names, 0.0), 0
    for _ in range(2000):
        now += rng.uniform(0.0, 0.05)
        for key, held in list(model.items()):  # what expiry does, by the book
            if held["at"] + 8.0 <= now:
                del model[key]
            elif held["at"] + 3.0 <= now:
                held["prefilling"] = False
        event = rng.random()
        if event < 0.4:
            ticket += 1
            key, name, tokens = ("peer", ticket), rng.choice(names), rng.choice([0, 100, 2000])
            ledger.peer_booked("peer", ticket, name, tokens, now=now)
            model[key] = {"endpoint": name, "tokens": tokens, "at": now, "prefilling": True}
        elif event < 0.6 and model:
            key = rng.choice(list(model))
            prefill_only = rng.random() < 0.5
            ledger.peer_released(*key, prefill_only)
            if prefill_only:
                model[key]["prefilling"] = False
            else:
                del model[key]
        elif event < 0.7:
            scraped_at[rng.choice(names)] = now
        else:
            ledger.expire(now)
            name = rng.choice(names)
            host, port = name.split(":")
            load = ledger.load(Endpoint(host, int(port), metrics=EndpointMetrics(update_time=scraped_at[name])), now)
            mine = [held for held in model.values() if held["endpoint"] == name]
            unseen = [held for held in mine if held["at"] > scraped_at[name]]
            assert load.inflight_requests == len(mine)
            assert load.prefilling_requests == sum(held["prefilling"] for held in mine)
            assert load.prefill_tokens == sum(held["tokens"] for held in mine if held["prefilling"])
            assert load.unseen_requests == len(unseen)
            assert load.unseen_prefill_tokens == sum(held["tokens"] for held in unseen if held["prefilling"])
