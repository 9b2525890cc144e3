"""Continuous ramps: a stage hands its in-flight requests on to the next instead of draining them."""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web

from bench.routing.loadgen import Stage, drain_inflight, run_stage
from bench.routing.workloads import NoSharing
from tests.support.backends import completions_backend


async def test_stages_do_not_wait_for_in_flight_requests_and_the_end_drains_them():
    async def slow(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await asyncio.sleep(0.6)  # longer than a stage
        await resp.write(b'data: {"choices":[{"index":0,"text":"a"}]}\n\ndata: [DONE]\n\n')
        return resp

    inflight: set[asyncio.Task] = set()
    reqs = NoSharing(prompt_tokens=8).requests()
    async with completions_backend(slow) as base, aiohttp.ClientSession() as session:
        first = await run_stage(session, base, reqs, Stage(0.3, 10.0, "constant"), 0, progress=False,
                                inflight=inflight)
        # The stage returned at its end, with its requests still running.
        assert first.finished - first.started < 0.45
        assert inflight and all(r.e2e is None for r in first.records)
        second = await run_stage(session, base, reqs, Stage(0.3, 10.0, "constant"), 1, progress=False,
                                 inflight=inflight)
        assert second.started < min(r.sent for r in first.records) + 0.6  # began before any finished
        records = first.records + second.records
        await drain_inflight(inflight, records, drain=5.0)
    assert len(records) >= 4 and all(r.ok for r in records), [r.error for r in records]
    # Drained stages would have serialised: here the second stage's requests overlap the first's.
    assert max(r.sent for r in second.records) < max(r.sent + r.e2e for r in first.records)


def test_the_bursty_scenario_alternates_calm_and_bursts_past_the_knee_without_draining():
    from bench.routing.scenarios import get_scenario

    for scale in ("tiny", "small", "medium"):
        sc = get_scenario("bursty", scale)
        rates = [s.rate for s in sc.stages]
        assert sc.continuous and len(rates) >= 4
        calm, burst = rates[0::2], rates[1::2]
        assert len(set(calm)) == 1 and len(set(burst)) == 1 and burst[0] >= 6 * calm[0]
    # The small scale's bursts are twice its shared-prefix ramp's top rate (12 req/s).
    assert get_scenario("bursty", "small").stages[1].rate >= 2 * get_scenario("shared-prefix", "small").stages[-1].rate
