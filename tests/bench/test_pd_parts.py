"""Parts of the P/D benchmark: its prompts, per-load summary and crossover."""

from __future__ import annotations

from bench.pd.run import LoadResult, Settings, TopologyResult, crossover, long_prompts, summarize
from bench.routing.loadgen import RequestRecord
from bench.routing.workloads import tokenizer


def test_prompts_are_long_unique_and_reproducible():
    s = Settings(prompt_tokens=1024, output_tokens=8)
    first = long_prompts(s, 3)
    assert [r.body["prompt"] for r in first] == [r.body["prompt"] for r in long_prompts(s, 3)]
    assert len({r.body["prompt"][:64] for r in first + long_prompts(s, 3, start=3)}) == 6  # no shared prefix
    tok = tokenizer()
    assert all(1000 <= len(tok.tokenizer.encode(r.body["prompt"]).ids) <= 1030 for r in first)
    assert all(r.body["max_tokens"] == 8 and r.body["stream"] for r in first)


def test_summary_is_in_simulated_seconds_and_per_replica():
    s = Settings(time_scale=2.0)
    ok = RequestRecord(stage=0, group="g", sent=0.0, ttft=0.4, e2e=2.0, itl=[0.02] * 99 + [0.6], output_tokens=100)
    failed = RequestRecord(stage=0, group="g", sent=0.0, error="timeout")
    load = summarize("x", 2.0, [ok, failed], busy_wall=10.0, s=s)
    assert load.errors == 1 and load.requests == 2
    assert load.ttft_p90 == 0.2 and load.itl_p50 == 0.01
    assert load.tokens_per_s_per_replica == 100 / 5.0 / 4


def load(topology, rate, ttft, itl, errors=0):
    return LoadResult(topology, rate, 10, errors, ttft, ttft, itl, itl, 100.0)


def test_crossover_names_the_loads_where_pd_wins():
    agg = TopologyResult("4 aggregated", [load("a", 1, 0.3, 0.01), load("a", 4, 0.5, 0.2), load("a", 8, 2.0, 0.3)])
    pd = TopologyResult("2P+2D", [load("p", 1, 0.4, 0.02), load("p", 4, 0.45, 0.01), load("p", 8, 1.0, 0.01, 3)])
    assert crossover([agg, pd]) == {"2P+2D": "ITL p99: 4 req/s; TTFT p90: 4 req/s; both: 4 req/s"}
