"""Fuzz the ext_proc server over real gRPC: a few thousand seeded random streams, every invariant held.

bench/fuzz.py runs the same harness (bench/support/fuzz_harness.py) for 100,000+ streams against an
`epp serve` process.
"""

from __future__ import annotations

import logging

import pytest

from bench.support.fuzz_harness import PREFIX_CONFIG, Fuzzer, Target
from epp.limits import Limits
from epp.server.runner import EppServer
from tests.support.extproc import options

POOL = ("10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000", "10.0.0.4:8000")
STREAMS = 2500
SEED = 18


@pytest.mark.slow
async def test_seeded_random_streams_keep_every_invariant(caplog):
    caplog.set_level(logging.WARNING)
    limits = Limits(stream_idle_timeout_s=1.0)
    server = EppServer(options(",".join(POOL), config_text=PREFIX_CONFIG, limits=limits))
    await server.start()
    fuzzer = Fuzzer(Target(server.grpc_port, server.health_port, server.metrics_port, POOL,
                           limits.stream_idle_timeout_s), seed=SEED)
    try:
        report = await fuzzer.run(STREAMS)
    finally:
        await fuzzer.close()
        await server.stop(0)
    assert report.violations == [], report.violations[:20]
    assert report.streams == STREAMS
    outcomes = report.outcomes
    # The mix really happened: picks, client errors of each kind, idle answers, garbage, cancellations.
    for seen in ("ordered:picked", "ordered:400", "ordered:431", "ordered:503", "idle:408", "garbage_rejected",
                 "cancelled", "invalid_order:picked"):
        assert outcomes[seen] > 0, (seen, outcomes)
    # Hostile input is not a reason to log tracebacks.
    assert not [r for r in caplog.records if r.exc_info], [r.getMessage() for r in caplog.records if r.exc_info]
