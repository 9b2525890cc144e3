"""JSON nesting is read from the bytes before parsing, so no parser of client or model-server JSON recurses deep."""

from __future__ import annotations

import gc
import json
import random
import sys
from typing import Any

import pytest

from epp.framework import UnreadableResponse, nesting_exceeds
from epp.framework.errors import InferenceError
from epp.metrics import EppMetrics, GcPauseRecorder
from epp.request.parsing import RequestParser


def _depth(value: Any) -> int:
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    return 0


def _random_value(rng: random.Random, depth: int) -> Any:
    """Nested objects and arrays whose strings are full of brackets, quotes and escapes."""
    if depth == 0 or rng.random() < 0.2:
        return rng.choice(["[{", '}]"', "\\", 'a"[b', "", "{\\\"[", 7, None, "\u2022]"])
    children = [_random_value(rng, depth - 1) for _ in range(rng.randint(1, 3))]
    if rng.random() < 0.5:
        return children
    return {rng.choice(["k[", 'q"{', "]"]) + str(i): child for i, child in enumerate(children)}


def test_the_byte_level_depth_agrees_with_the_parsed_depth_whatever_the_strings_hold():
    rng = random.Random(14)
    for _ in range(2000):
        value = _random_value(rng, rng.randint(1, 9))
        body = json.dumps(value, ensure_ascii=rng.random() < 0.5).encode()
        depth = _depth(value)
        for limit in (depth - 1, depth, depth + 1):
            assert nesting_exceeds(body, max(limit, 0)) == (depth > max(limit, 0)), body


def test_brackets_inside_strings_do_not_count():
    assert not nesting_exceeds(json.dumps({"prompt": "[" * 500 + '\\"{' * 500}).encode(), 4)


def test_text_that_is_not_json_counts_every_bracket_the_parser_could_reach():
    # The parser stops in an unterminated string: what follows its quote is never reached.
    assert not nesting_exceeds(b'["' + b"[" * 1000, 1)
    assert nesting_exceeds(b"[" * 1000 + b'"\\', 128)  # ends on a lone backslash inside a string
    assert nesting_exceeds(json.dumps([[[["x"]]]]).encode("utf-16"), 3)  # quotes' bytes not trusted


@pytest.fixture
def frequent_collections_timed_by_the_pause_metric():
    """The picker's gc callback (epp_gc_pause_seconds) installed, and a collection every 50 allocations."""
    metrics = EppMetrics()
    recorder = GcPauseRecorder(metrics)
    raised: list[Any] = []
    threshold = gc.get_threshold()
    gc.callbacks.append(recorder)
    sys.unraisablehook, hook = raised.append, sys.unraisablehook
    gc.set_threshold(50)
    try:
        yield raised
    finally:
        gc.set_threshold(*threshold)
        sys.unraisablehook = hook
        gc.callbacks.remove(recorder)
    assert metrics.registry.get_sample_value("epp_gc_pause_seconds_count", {"generation": "0"}) > 0


def test_deep_json_leaves_stack_for_the_garbage_collectors_callbacks(frequent_collections_timed_by_the_pause_metric):
    # Parsed as deep as it went, json.loads sat at the interpreter's recursion limit, and a
    # collection that started there failed in the callback (RecursionError, unraisable).
    parser = RequestParser()
    request, _ = parser.parse(request_id="r", headers={}, body=b'{"model":"m","prompt":"p"}', subset_hint=None)
    read = request.format
    deep_array = ("[" * 5000 + "]" * 5000).encode()
    deep_object = ('{"a":' * 3000 + "1" + "}" * 3000).encode()
    for _ in range(200):
        for body in (deep_array, deep_object):
            with pytest.raises(InferenceError, match="deeper than 128 levels"):
                parser.parse(request_id="r", headers={}, body=b'{"model":"m","prompt":' + body + b"}",
                             subset_hint=None)
            with pytest.raises(UnreadableResponse):
                read.usage(request, body, streamed=False)
            with pytest.raises(UnreadableResponse):
                read.usage(request, b"data: " + body + b" usage\n\n", streamed=True)
    assert frequent_collections_timed_by_the_pause_metric == []
