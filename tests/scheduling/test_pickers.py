"""Pickers: max score with random tie-break, random, weighted random (A-Res)."""

from collections import Counter

import pytest

from epp.framework import ConfigError, CycleState, ScoredEndpoint
from tests.scheduling.sched_fixtures import endpoint, make_plugin, request


def scored(*values):
    return [ScoredEndpoint(endpoint(i), v) for i, v in enumerate(values)]


def pick_names(picker, candidates):
    return [ep.name for ep in picker.pick(CycleState(), request(), candidates).targets]


def test_max_score_picker_takes_the_highest():
    picker = make_plugin("max-score-picker")
    assert pick_names(picker, scored(0.2, 1.7, 0.9)) == ["192.168.1.2:8000"]


def test_max_score_picker_returns_fallbacks_in_score_order():
    picker = make_plugin("max-score-picker", {"maxNumOfEndpoints": 3})
    assert pick_names(picker, scored(0.2, 1.7, 0.9, 0.1)) == ["192.168.1.2:8000", "192.168.1.3:8000",
                                                               "192.168.1.1:8000"]


def test_max_score_picker_breaks_ties_at_random():
    picker = make_plugin("max-score-picker")
    counts = Counter(pick_names(picker, scored(1.0, 0.5, 1.0, 1.0))[0] for _ in range(600))
    assert set(counts) == {"192.168.1.1:8000", "192.168.1.3:8000", "192.168.1.4:8000"}
    assert min(counts.values()) > 120  # about 200 each


def test_pickers_return_at_most_the_candidates():
    for type_name in ("max-score-picker", "random-picker", "weighted-random-picker"):
        picker = make_plugin(type_name, {"maxNumOfEndpoints": 5})
        assert len(pick_names(picker, scored(1.0, 0.0))) == 2


def test_random_picker_is_uniform_and_ignores_scores():
    picker = make_plugin("random-picker")
    counts = Counter(pick_names(picker, scored(5.0, 0.0, 0.0))[0] for _ in range(900))
    assert len(counts) == 3 and min(counts.values()) > 200


def test_weighted_random_picker_follows_scores():
    picker = make_plugin("weighted-random-picker")
    counts = Counter(pick_names(picker, scored(3.0, 1.0, 0.0))[0] for _ in range(2000))
    # P = 3/4 and 1/4; a zero score is never picked while a positive one exists.
    assert counts["192.168.1.3:8000"] == 0
    assert 1350 < counts["192.168.1.1:8000"] < 1650


def test_weighted_random_picker_falls_back_to_uniform_when_no_score_is_positive():
    picker = make_plugin("weighted-random-picker")
    counts = Counter(pick_names(picker, scored(0.0, 0.0, 0.0))[0] for _ in range(900))
    assert len(counts) == 3 and min(counts.values()) > 200


def test_weighted_random_picker_distinct_fallbacks():
    picker = make_plugin("weighted-random-picker", {"maxNumOfEndpoints": 3})
    names = pick_names(picker, scored(1.0, 2.0, 0.0))
    assert len(set(names)) == 3 and names[2] == "192.168.1.3:8000"


@pytest.mark.parametrize("value, message", [
    (0, "'maxNumOfEndpoints' must be >= 1, got 0"),
    ("2", "'maxNumOfEndpoints' must be an integer, got '2'"),
])
def test_max_num_of_endpoints_is_validated(value, message):
    with pytest.raises(ConfigError, match=message):
        make_plugin("max-score-picker", {"maxNumOfEndpoints": value})
