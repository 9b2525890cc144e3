"""Routing benchmark parts: seeded workloads, the oracle bound, the arrival schedule, statistics."""

from __future__ import annotations

import asyncio
import itertools

import aiohttp
import pytest
from aiohttp import web

from bench.routing.loadgen import Stage, build_ahead, ramp, run_stage, send_times
from bench.routing.measure import counter_sum, histogram, percentile
from bench.routing.oracle import belady_hits, oracle_hits, prompt_token_ids
from bench.routing.workloads import Agentic, MultiTurn, NoSharing, SharedPrefix
from tests.support.backends import completions_backend


def test_workloads_are_reproducible_from_their_seed():
    for w in (SharedPrefix(groups=3, users=2, system_tokens=64, question_tokens=16),
              MultiTurn(sessions=3, active=2, turns=2, system_tokens=32, user_tokens=8, answer_tokens=8),
              Agentic(agents=2, active=2, steps=2, context_tokens=64, tool_tokens=16), NoSharing(prompt_tokens=32)):
        first = [r.body for r in itertools.islice(w.requests(), 10)]
        again = [r.body for r in itertools.islice(w.requests(), 10)]
        assert first == again


def test_shared_prefix_prompts_have_the_asked_token_lengths_and_share_their_group_prefix():
    w = SharedPrefix(groups=2, users=3, system_tokens=200, question_tokens=40)
    reqs = list(itertools.islice(w.requests(), 20))
    by_group: dict[str, list[list[int]]] = {}
    for r in reqs:
        ids = prompt_token_ids(r)
        assert 200 + 40 - 2 <= len(ids) <= 200 + 40 + 4  # BOS, the joining newline, BPE merges at the cut
        by_group.setdefault(r.group, []).append(ids)
    assert len(by_group) == 2
    for prompts in by_group.values():
        assert all(p[:190] == prompts[0][:190] for p in prompts)
    a, b = (prompts[0] for prompts in by_group.values())
    assert a[1:20] != b[1:20]


def test_multi_turn_requests_extend_their_session_history():
    w = MultiTurn(sessions=2, active=1, turns=3, system_tokens=32, user_tokens=8, answer_tokens=8)
    reqs = list(itertools.islice(w.requests(), 3))
    assert len({r.group for r in reqs}) == 1
    lengths = [len(r.body["messages"]) for r in reqs]
    assert lengths == [2, 4, 6]
    assert reqs[2].body["messages"][:4] == reqs[1].body["messages"][:3] + [reqs[2].body["messages"][3]]


def test_belady_keeps_what_is_needed_soonest():
    # capacity 2, cyclic 1,2,3: MIN keeps {1,2}, bypasses 3: 4 hits of 9 (LRU would get none).
    assert sum(belady_hits([1, 2, 3] * 3, 2)) == 4
    assert belady_hits([5, 5, 5], 1) == [False, True, True]
    assert sum(belady_hits([1, 2, 3, 1, 2, 3], 3)) == 3


def test_oracle_counts_shared_prefix_blocks_and_never_the_last_token():
    w = SharedPrefix(groups=1, users=1, system_tokens=64, question_tokens=16)
    reqs = list(itertools.islice(w.requests(), 3))
    ids = prompt_token_ids(reqs[0])
    res = oracle_hits(reqs, block_size=16, capacity_blocks=1000)
    assert res.hits[0] == 0  # cold
    assert res.hits[1] == res.hits[2] == (len(ids) - 1) // 16 * 16
    assert 0.6 < res.rate() < 1.0
    tight = oracle_hits(reqs, block_size=16, capacity_blocks=1)
    assert tight.rate() <= res.rate()


def test_counter_sum_adds_every_labelled_sample():
    text = ('# TYPE vllm:request_success_total counter\n'
            'vllm:request_success_total{finished_reason="stop",model_name="m"} 3.0\n'
            'vllm:request_success_total{finished_reason="length",model_name="m"} 4.0\n'
            'vllm:prefix_cache_hits_total{model_name="m"} 16.0\n')
    assert counter_sum(text, "vllm:request_success_total") == 7.0
    assert counter_sum(text, "vllm:prefix_cache_hits_total") == 16.0
    assert counter_sum(text, "vllm:absent_total") == 0.0


def test_percentile_interpolates():
    assert percentile([], 90) is None
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 50) == 3.0
    assert abs(percentile(list(map(float, range(101))), 90) - 90.0) < 1e-9


def test_ramp_spreads_rates_evenly():
    assert [s.rate for s in ramp(2.0, 8.0, 4, 10.0)] == [2.0, 4.0, 6.0, 8.0]


def test_requests_of_open_loop_and_trace_stages_are_built_before_the_clock_starts():
    built: list[int] = []

    def counted():
        for i in itertools.count():
            built.append(i)
            yield i

    stages = [Stage(10.0, 4.0), Stage(5.0, 2.0, "constant")]
    planned = len(send_times(stages[0], 0)) + len(send_times(stages[1], 1))
    assert planned == len(send_times(stages[0], 0)) + 9  # a constant 2/s for 5 s: 0.5 s ... 4.5 s
    ahead = build_ahead(counted(), stages)
    assert len(built) == planned  # nothing left to build while a stage runs
    assert list(itertools.islice(ahead, planned + 2)) == list(range(planned + 2))  # same order, then lazily on
    built.clear()
    build_ahead(counted(), [Stage(5.0, 2.0, "constant"), Stage(5.0, concurrency=4), Stage(5.0, 2.0)])
    assert len(built) == 9  # a closed-loop stage's count is unknown: the look-ahead stops there
    trace = iter(range(7))
    assert list(build_ahead(trace, [Stage(3.0, 2.0, "trace")])) == list(range(7))


def test_poisson_send_times_follow_the_stage_rate_without_bunching():
    times = send_times(Stage(600.0, 8.0), 3)
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert 4400 < len(times) < 5200 and all(0 < t < 600 for t in times)
    assert sum(g < 0.002 for g in gaps) < 0.03 * len(gaps)  # P(gap < 2 ms) = 1.6 % at 8/s


async def test_open_loop_stage_streams_measures_ttft_and_is_bounded_in_time():
    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "x-sim-replica": "r0"})
        await resp.prepare(request)
        await asyncio.sleep(0.02)
        for tok in ("a", "b", "c"):
            await resp.write(b'data: {"choices":[{"index":0,"text":"' + tok.encode() + b'"}]}\n\n')
            await asyncio.sleep(0.005)
        await resp.write(b'data: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":3}}\n\n')
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async with completions_backend(handler) as url, aiohttp.ClientSession() as session:
        res = await run_stage(session, url, NoSharing(prompt_tokens=16).requests(), Stage(1.0, 20.0, "constant"), 0,
                              drain=5.0, progress=False)
    assert 18 <= len(res.records) <= 20
    assert res.issued_until - res.started < 1.5
    for rec in res.records:
        assert rec.ok, rec.error
        assert rec.output_tokens == 3 and len(rec.itl) == 2
        assert 0.015 < rec.ttft < rec.e2e
        assert rec.replica == "r0"


def test_no_home_contenders_turn_the_rendezvous_home_off_in_the_config_they_run():
    import yaml

    from bench.routing.contenders import Tuning, epp_config
    from bench.routing.experiments import known

    CONTENDERS = known()
    tuning = Tuning(tokenizer_dir="/tok", block_size=16, prefill_s_per_token=0.0, mean_prompt_tokens=0)
    for name in ("epp-approx-no-home", "epp-approx-w2-no-home", "epp-precise-w2-no-home"):
        doc = yaml.safe_load(epp_config(CONTENDERS[name].variant, tuning))
        producers = [p for p in doc["plugins"] if p["type"].endswith("prefix-cache-producer")]
        assert producers and all(p["parameters"]["rendezvousHome"] is False for p in producers), name
    # The pods contenders run the same configuration as their one-picker row, N times.
    assert CONTENDERS["epp-approx-pods2"].variant == CONTENDERS["epp-approx"].variant
    assert CONTENDERS["epp-approx-pods4"].pods == 4 and CONTENDERS["epp-approx-w4"].workers == 4
    assert CONTENDERS["epp-precise-pods4"].pods == 4 and CONTENDERS["epp-precise-pods4"].variant == CONTENDERS["epp-precise"].variant


def test_lru_sizing_contenders_change_only_the_approximate_producers_sizing():
    import yaml

    from bench.routing.contenders import Tuning, epp_config
    from bench.routing.experiments import known

    CONTENDERS = known()
    tuning = Tuning(tokenizer_dir="/tok", block_size=16, prefill_s_per_token=0.0, mean_prompt_tokens=0)
    base = yaml.safe_load(epp_config(CONTENDERS["epp-approx"].variant, tuning))
    for name, parameters in (("epp-approx-fixed-lru", {"autoTune": False}), ("epp-approx-4cpt", {"charsPerToken": 4.0})):
        doc = yaml.safe_load(epp_config(CONTENDERS[name].variant, tuning))
        [producer] = [p for p in doc["plugins"] if p["type"] == "approx-prefix-cache-producer"]
        assert producer["parameters"] == parameters, name
        assert [p for p in doc["plugins"] if p is not producer] == base["plugins"]
        assert doc["schedulingProfiles"] == base["schedulingProfiles"]


def test_histogram_of_a_page_sums_label_sets_subtracts_and_interpolates_quantiles():
    def page(a: tuple[int, int, int], b: tuple[int, int, int]) -> str:
        lines = []
        for replica, counts in (("0", a), ("1", b)):
            for le, n in zip(("0.1", "0.5", "+Inf"), counts):
                lines.append(f'vllm:time_to_first_token_seconds_bucket{{engine="{replica}",le="{le}"}} {n}')
            lines.append(f'vllm:time_to_first_token_seconds_sum{{engine="{replica}"}} {counts[-1] * 0.2}')
            lines.append(f'vllm:time_to_first_token_seconds_count{{engine="{replica}"}} {counts[-1]}')
        return "\n".join(lines) + "\n"

    before = histogram(page((1, 2, 2), (0, 0, 0)), "vllm:time_to_first_token_seconds")
    after = histogram(page((5, 8, 8), (2, 6, 12)), "vllm:time_to_first_token_seconds")
    delta = after.minus(before)
    assert delta.buckets == ((0.1, 6.0), (0.5, 12.0), (float("inf"), 18.0)) and delta.count == 18
    assert delta.mean == pytest.approx(0.2)
    assert delta.quantile(0.25) == pytest.approx(0.075)  # 4.5 of the 6 observations under 0.1
    assert delta.quantile(0.5) == pytest.approx(0.1 + 0.4 * 3 / 6)
    assert delta.quantile(0.9) == pytest.approx(0.5)  # in the +Inf bucket: its lower bound
    assert histogram("", "vllm:time_to_first_token_seconds").quantile(0.5) is None
