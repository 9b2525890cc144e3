"""The in-flight ledger as tables: what load-aware scorers see between two scrapes."""

from __future__ import annotations

import math
import time

import pytest

from epp.config.compose import endpoint_picker_config
from epp.framework import CycleState, Endpoint, EndpointMetrics, InflightLedger, PluginContext
from epp.framework.load import estimate_prompt_tokens
from tests.support.scheduling import DirectorHarness, endpoint, make_plugin, request

SCRAPED_AT = 1.0  # tests/support/scheduling's endpoints were scraped at t = 1.0


def loads(ledger, endpoints, now):
    return [(ld.inflight_requests, ld.unseen_requests, ld.prefilling_requests, ld.prefill_tokens)
            for ld in (ledger.load(ep, now) for ep in endpoints)]


def test_bookings_table_pick_first_token_complete():
    ledger = InflightLedger()
    a, b = endpoint(0), endpoint(1)
    # step, action                             -> (inflight, unseen, prefilling, prefill tokens) for a, b
    r1 = ledger.pick(a.name, prompt_tokens=1000, uncached_tokens=200, now=1.01)
    assert loads(ledger, [a, b], 1.02) == [(1, 1, 1, 200), (0, 0, 0, 0)]
    r2 = ledger.pick(b.name, prompt_tokens=500, now=1.02)
    assert loads(ledger, [a, b], 1.03) == [(1, 1, 1, 200), (1, 1, 1, 500)]
    ledger.first_token(r1, now=1.04)
    assert loads(ledger, [a, b], 1.05) == [(1, 1, 0, 0), (1, 1, 1, 500)]
    ledger.complete(r1)
    ledger.complete(r1)  # twice is harmless
    assert loads(ledger, [a, b], 1.05) == [(0, 0, 0, 0), (1, 1, 1, 500)]
    ledger.complete(r2)  # completion also ends an unfinished prefill
    assert loads(ledger, [a, b], 1.05) == [(0, 0, 0, 0), (0, 0, 0, 0)]
    assert len(ledger) == 0


def test_a_request_whose_response_was_never_seen_counts_until_a_scrape_shows_it():
    # Request-only Envoy mode: the stream ends when the request is sent, the work has just begun.
    ledger = InflightLedger()
    ep = endpoint(0)
    sent_after_scrape = ledger.pick(ep.name, prompt_tokens=300, now=1.01)
    ledger.complete(sent_after_scrape, response_seen=False)
    ledger.complete(sent_after_scrape, response_seen=False)  # twice is harmless
    assert loads(ledger, [ep], 1.02) == [(1, 1, 1, 300)]
    rescraped = type(ep)(ep.address, ep.port, metrics=EndpointMetrics(update_time=1.5))
    assert loads(ledger, [rescraped], 1.6) == [(0, 0, 0, 0)]  # the scrape at 1.5 shows it now
    assert len(ledger) == 0


def test_an_answered_request_stops_counting_at_once():
    ledger = InflightLedger()
    ep = endpoint(0)
    ledger.complete(ledger.pick(ep.name, prompt_tokens=300, now=1.01), response_seen=True)
    assert loads(ledger, [ep], 1.02) == [(0, 0, 0, 0)]


@pytest.mark.parametrize(
    ("picked_at", "scraped_at", "unseen"),
    [
        (0.99, 1.0, 0),   # sent before the scrape: the scrape can show it
        (1.0, 1.0, 0),
        (1.01, 1.0, 1),   # sent after: only the ledger knows
        (1.01, 0.0, 1),   # never scraped
    ],
)
def test_a_pick_is_unseen_until_a_scrape_after_it(picked_at, scraped_at, unseen):
    ledger = InflightLedger()
    ep = endpoint(0)
    ep = type(ep)(ep.address, ep.port, metrics=EndpointMetrics(update_time=scraped_at))
    ledger.pick(ep.name, prompt_tokens=10, now=picked_at)
    assert ledger.load(ep, 1.02).unseen_requests == unseen


@pytest.mark.parametrize(
    ("scraped_waiting", "unseen", "prefilling", "expected"),
    [
        (0, 0, 0, 0),
        (0, 2, 2, 2),   # a burst after the scrape
        (3, 0, 1, 3),   # the scrape shows more than ours: other pickers' work counts
        (1, 0, 3, 3),   # ours in mid-prefill look "running" to vLLM, not waiting: still ahead of us
        (2, 1, 1, 3),   # scraped queue plus what it cannot show yet
    ],
)
def test_waiting_estimate_is_never_below_what_the_picker_knows(scraped_waiting, unseen, prefilling, expected):
    from epp.framework.load import EndpointLoad

    # Whole requests: a prefill three quarters done still counts 1 (fractions outvote prefix matches).
    load = EndpointLoad(unseen_requests=unseen, prefilling_requests=prefilling,
                        prefill_backlog_requests=0.25 * prefilling)
    assert load.waiting_estimate(EndpointMetrics(waiting_queue_size=scraped_waiting)) == expected


@pytest.mark.parametrize(
    ("prefills", "now", "tokens", "requests"),
    [
        ([], 1.0, 0, 0),
        ([(1.0, 1000)], 1.0, 1000, 1.0),               # just sent: all of it to do
        ([(1.0, 1000)], 1.05, 500, 0.5),               # halfway at 1e-4 s a token
        ([(1.0, 1000)], 1.5, 100, 0.1),                # overdue: the floor, it is not seen done yet
        ([(1.0, 1000), (1.0, 1000)], 1.05, 1500, 1.5),  # the second waits for the first
        ([(1.0, 1000), (1.2, 1000)], 1.25, 600, 0.6),   # the first finished at 1.1 (floor), the second half done
        ([(1.0, 0)], 1.0, 0, 0.1),                     # a whole-prompt cache hit: only the floor
        ([(1.0, 1000), (1.0, 0)], 1.05, 500, 0.6),      # ...also behind a prefill
    ],
)
def test_prefill_backlog_works_through_the_prefills_in_pick_order(prefills, now, tokens, requests):
    from epp.framework.load import prefill_backlog

    got_tokens, got_requests = prefill_backlog(prefills, 1e-4, now)
    assert (got_tokens, got_requests) == (pytest.approx(tokens), pytest.approx(requests))


def _backlog_walking_every_prefill(prefills, s_per_token, now):
    """The backlog model by its definition: every prefill's share left, one after the other."""
    free_at, tokens, requests = -math.inf, 0.0, 0.0
    for sent_at, uncached in prefills:
        duration = uncached * s_per_token
        free_at = max(free_at, sent_at) + duration
        left = min(1.0, max(0.1, (free_at - now) / duration)) if duration > 0 else 0.1
        tokens += left * uncached
        requests += left
    return tokens, requests


def test_the_backlog_stops_at_the_first_unfinished_prefill_and_counts_the_rest_whole():
    import random

    from epp.framework.load import prefill_backlog

    rng = random.Random(7)
    for _ in range(500):
        now = rng.uniform(0.0, 3.0)
        sent = sorted(rng.uniform(0.0, now) for _ in range(rng.randint(1, 30)))  # every prefill sent by now
        prefills = [(t, rng.choice([0, 16, 500, 3000])) for t in sent]
        with_tokens = [p for p in prefills if p[1] > 0]  # as the ledger passes them: cache hits apart
        cache_hits = len(prefills) - len(with_tokens)
        tokens, requests = prefill_backlog(iter(with_tokens), 2e-4, now,
                                           (sum(u for _, u in with_tokens), len(with_tokens)))
        expected = _backlog_walking_every_prefill(prefills, 2e-4, now)
        assert (tokens, requests + 0.1 * cache_hits) == pytest.approx(expected)
        assert prefill_backlog(prefills, 2e-4, now) == pytest.approx(expected)  # totals summed from a list


def test_an_endpoint_about_to_finish_its_prefill_looks_less_busy_than_one_that_just_started():
    ledger = InflightLedger()
    scraped = EndpointMetrics(update_time=10.32, running_requests_size=1)  # a scrape that shows both
    early, late = (Endpoint(f"192.168.1.{i}", 8000, metrics=scraped) for i in (1, 2))
    ledger.pick(early.name, prompt_tokens=2000, now=10.0)
    ledger.pick(late.name, prompt_tokens=2000, now=10.3)
    early_load, late_load = ledger.load(early, 10.35), ledger.load(late, 10.35)
    assert early_load.prefilling_requests == late_load.prefilling_requests == 1
    assert early_load.prefill_backlog_tokens < late_load.prefill_backlog_tokens
    assert early_load.prefill_backlog_requests < late_load.prefill_backlog_requests


def test_the_ledger_learns_each_endpoints_prefill_speed_from_uncontended_first_tokens():
    from epp.framework.load import PRIOR_PREFILL_S_PER_TOKEN

    ledger = InflightLedger()
    ep = endpoint(0)
    assert ledger.prefill_seconds_per_token(ep.name) == PRIOR_PREFILL_S_PER_TOKEN
    t = 100.0
    for _ in range(30):  # 2,000 tokens in 0.1 s: 5e-5 s a token
        booking = ledger.pick(ep.name, prompt_tokens=2000, now=t)
        ledger.first_token(booking, now=t + 0.1)
        ledger.complete(booking)
        t += 1.0
    assert ledger.prefill_seconds_per_token(ep.name) == pytest.approx(5e-5)
    # Behind another prefill the wait says nothing about speed; short prompts neither.
    ahead = ledger.pick(ep.name, prompt_tokens=2000, now=t)
    behind = ledger.pick(ep.name, prompt_tokens=2000, now=t)
    ledger.first_token(ahead, now=t + 0.1)
    ledger.first_token(behind, now=t + 5.0)
    short = ledger.pick(ep.name, prompt_tokens=10, now=t + 6)
    ledger.first_token(short, now=t + 7)
    assert ledger.prefill_seconds_per_token(ep.name) == pytest.approx(5e-5)


def test_kv_usage_estimate_adds_the_blocks_unseen_picks_will_take():
    ledger = InflightLedger()
    ep = endpoint(0, kv=0.25, block_size=16, num_blocks=1000)
    ledger.pick(ep.name, prompt_tokens=1600, now=1.5)  # 100 blocks of 1,000
    assert ledger.load(ep, 1.6).kv_usage_estimate(ep.metrics) == pytest.approx(0.35)


def test_timeouts_and_capacity_drop_lost_bookings():
    ledger = InflightLedger(request_timeout_s=10, prefill_timeout_s=2, capacity=2)
    a = endpoint(0)
    ledger.pick(a.name, prompt_tokens=100, now=1.0)
    assert ledger.load(a, 2.0).prefill_tokens == 100
    ledger.expire(3.5)  # prefill timed out, request still in flight
    assert loads(ledger, [a], 3.5) == [(1, 0, 0, 0)]  # picked at the scrape's time: seen
    ledger.pick(a.name, prompt_tokens=100, now=4.0)
    ledger.pick(a.name, prompt_tokens=100, now=4.1)  # over capacity: the oldest goes
    assert ledger.load(a, 4.2).inflight_requests == 2 and ledger.dropped == 1
    ledger.expire(20.0)
    assert len(ledger) == 0 and ledger.dropped == 3
    assert ledger.load(a, 20.0).scrape_age_s == pytest.approx(19.0)
    never_scraped = type(a)("192.168.9.9", 8000)
    assert math.isinf(ledger.load(never_scraped, 20.0).scrape_age_s)


# A burst of requests within one scrape interval, all endpoints idle at the scrape, through GIE's
# default load scorers (queue 2, kv 2): with the ledger they spread evenly. (Scrape-only, every
# request of the burst sees the same stale view: see test_scorers_read_the_ledger_... below and
# tests/integration/test_inflight_burst.py.)
@pytest.mark.parametrize(
    ("burst", "max_per_endpoint"),
    [
        (4, 1),    # 4 requests over 4 idle endpoints: one each
        (8, 2),
        (12, 3),
    ],
)
async def test_a_burst_within_one_scrape_interval_spreads(burst, max_per_endpoint):
    picker = DirectorHarness(endpoint_picker_config(
        ["queue-scorer", "kv-cache-utilization-scorer", "max-score-picker"],
        {"queue-scorer": 2, "kv-cache-utilization-scorer": 2, "max-score-picker": None}))
    picker.set_pool([endpoint(i, block_size=16, num_blocks=1000) for i in range(4)])
    picks: dict[str, int] = {}
    for i in range(burst):  # ~2,000-token prompts, nothing cached, none answered yet
        result, _ = await picker.pick(request("x" * 8000, request_id=f"r{i}"))
        picks[result.targets[0].name] = picks.get(result.targets[0].name, 0) + 1
    assert max(picks.values()) == max_per_endpoint and len(picks) == min(burst, 4)


def test_estimate_prompt_tokens_reads_prompts_and_chats():
    assert estimate_prompt_tokens(request("abcd" * 100)) == 100
    chat = request(body={"model": "m", "messages": [{"role": "user", "content": "abcd" * 50}] * 2})
    assert estimate_prompt_tokens(chat) == 100 + 2  # the two role names count too
    assert estimate_prompt_tokens(request([1, 2, 3])) == 3  # token ids


def test_scorers_read_the_ledger_through_the_plugin_context():
    context = PluginContext()
    scorer = make_plugin("queue-scorer", context=context)
    a, b = endpoint(0), endpoint(1)
    context.load.pick(a.name, prompt_tokens=100, now=1.5)
    assert scorer.score(CycleState(), request(), [a, b]) == {a.name: 0.0, b.name: 1.0}
    gie = make_plugin("queue-scorer", {"useInflight": False}, context=context)
    assert gie.score(CycleState(), request(), [a, b]) == {a.name: 1.0, b.name: 1.0}


def test_the_ledger_exports_each_endpoints_backlog_and_prefill_speed():
    from prometheus_client import CollectorRegistry

    from epp.datalayer.registry import EndpointRegistry, EndpointSpec
    from epp.framework.load import PRIOR_PREFILL_S_PER_TOKEN
    from epp.load_metrics import register_ledger_metrics

    endpoints = EndpointRegistry()
    endpoints.set_endpoints([EndpointSpec("127.0.0.1", 8000)])
    name = endpoints.snapshot()[0].name
    ledger, registry = InflightLedger(), CollectorRegistry()
    register_ledger_metrics(ledger, endpoints, registry)
    ledger.pick(name, prompt_tokens=1000)
    assert 100 <= registry.get_sample_value("epp_inflight_prefill_backlog_tokens", {"endpoint": name}) <= 1000
    assert registry.get_sample_value("epp_prefill_seconds_per_token", {"endpoint": name}) == PRIOR_PREFILL_S_PER_TOKEN
    endpoints.set_endpoints([])  # an endpoint that leaves takes its learned speed along
    assert registry.get_sample_value("epp_prefill_seconds_per_token", {"endpoint": name}) is None


@pytest.mark.parametrize(
    ("waiting", "backlog", "expected"),
    [
        ([1, 1], [100, 1000], [1.0, 0.9]),             # a tie: the one about to finish wins
        ([1, 1], [500, 500], [1.0, 1.0]),              # no difference in backlog: GIE's scores
        ([0, 1, 1], [0, 100, 1000], [1.0, 0.1, 0.0]),  # the tie is ordered, still below the shorter queue
        ([0, 2, 2], [0, 100, 1000], [1.0, 0.05, 0.0]),  # two requests apart: half the share
        ([1, 1, 0], [900, 100, 0], [0.0, 0.1, 1.0]),
        ([0, 0, 3], [50, 950, 10], [1.0, 0.966667, 0.0]),  # a span of 3 requests: a third of the share
    ],
)
def test_queue_scorer_breaks_ties_on_whole_requests_by_prefill_backlog(waiting, backlog, expected):
    from scorers.load import backlog_tie_break, min_max_inverted

    got = backlog_tie_break(min_max_inverted(waiting), waiting, backlog, 0.1)
    assert [round(s, 6) for s in got] == expected


def test_the_queue_scorer_prefers_the_endpoint_whose_prefill_is_nearly_done():
    context = PluginContext()
    near_done, just_started = endpoint(0), endpoint(1)
    now = time.monotonic()
    # 2,000 tokens at the prior speed take 0.4 s: one was sent 0.35 s ago, the other just now.
    context.load.pick(near_done.name, prompt_tokens=2000, now=now - 0.35)
    context.load.pick(just_started.name, prompt_tokens=2000, now=now)
    scores = make_plugin("queue-scorer", context=context).score(CycleState(), request(), [near_done, just_started])
    assert scores[near_done.name] == 1.0 and 0.7 <= scores[just_started.name] < 1.0
    gie = make_plugin("queue-scorer", {"backlogTieBreak": 0}, context=context)
    assert gie.score(CycleState(), request(), [near_done, just_started]) == {near_done.name: 1.0,
                                                                            just_started.name: 1.0}


def test_unseen_picks_kept_up_to_date_match_a_recount_after_any_sequence_of_events():
    import random

    rng = random.Random(11)
    ledger = InflightLedger(prefill_timeout_s=5.0, request_timeout_s=20.0)
    names = [endpoint(i).name for i in range(3)]
    open_bookings, now, scraped_at = [], 0.0, {n: 0.0 for n in names}
    for _ in range(3000):
        now += rng.uniform(0.0, 0.05)
        event = rng.random()
        if event < 0.4:
            name = rng.choice(names)
            open_bookings.append(ledger.pick(name, prompt_tokens=rng.choice([0, 100, 2000]), now=now))
        elif event < 0.55 and open_bookings:
            ledger.first_token(rng.choice(open_bookings), now=now)
        elif event < 0.75 and open_bookings:
            booking = open_bookings.pop(rng.randrange(len(open_bookings)))
            ledger.complete(booking, response_seen=rng.random() < 0.7)
        elif event < 0.85:
            scraped_at[rng.choice(names)] = now
        else:
            name = rng.choice(names)
            ep = Endpoint(name.split(":")[0], int(name.split(":")[1]), metrics=EndpointMetrics(update_time=scraped_at[name]))
            load = ledger.load(ep, now)
            mine = [b for b in ledger.bookings() if b.endpoint == name and b.picked_at > scraped_at[name]]
            assert load.unseen_requests == len(mine)
            assert load.unseen_prefill_tokens == sum(b.uncached_tokens for b in mine if b.prefilling)
