"""A serving picker times every garbage collection (the event loop stands still meanwhile), and stops when it stops."""

from __future__ import annotations

import gc

from tests.support.extproc import started


def _full_collections(server) -> float:
    return server.metrics.registry.get_sample_value("epp_gc_pause_seconds_count", {"generation": "2"}) or 0.0


async def test_a_serving_picker_reports_each_garbage_collection_pause_by_generation():
    server = await started()
    try:
        before = _full_collections(server)
        gc.collect()
        assert _full_collections(server) == before + 1
        assert server.metrics.registry.get_sample_value("epp_gc_pause_seconds_sum", {"generation": "2"}) > 0
    finally:
        await server.stop(0)
    stopped = _full_collections(server)
    gc.collect()
    assert _full_collections(server) == stopped  # a stopped picker leaves no callback behind
