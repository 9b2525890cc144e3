"""Pickers: max score (ties to the most free prefix cache, then random), random, weighted random (A-Res)."""

from collections import Counter

import pytest

from epp.config.compose import endpoint_picker_config
from epp.framework import ConfigError, CycleState, ScoredEndpoint
from epp.framework.datakeys import PREFIX_CACHE_FREE_BLOCKS
from tests.support.scheduling import DirectorHarness, endpoint, make_plugin, request


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


def state_with_free_blocks(*free):
    """A cycle state where the prefix producer found `free[i]` unindexed blocks on endpoint i."""
    state = CycleState()
    for i, blocks in enumerate(free):
        state.put_endpoint_data(PREFIX_CACHE_FREE_BLOCKS, endpoint(i).name, blocks)
    return state


def pick_in(picker, state, candidates):
    return [ep.name for ep in picker.pick(state, request(), candidates).targets]


def test_a_tie_goes_to_the_endpoint_with_the_most_free_prefix_cache():
    picker = make_plugin("max-score-picker")
    state = state_with_free_blocks(100, 900, 400)
    assert pick_in(picker, state, scored(1.0, 1.0, 1.0)) == ["192.168.1.2:8000"]
    assert pick_in(picker, state, scored(1.0, 0.5, 1.0)) == ["192.168.1.3:8000"]
    # Room only breaks ties: a higher score wins however full its cache is.
    assert pick_in(picker, state, scored(1.0, 0.5, 0.9)) == ["192.168.1.1:8000"]


def test_full_caches_tie_at_random_again():
    picker = make_plugin("max-score-picker")
    state = state_with_free_blocks(0, 0, 0)
    counts = Counter(pick_in(picker, state, scored(1.0, 1.0, 1.0))[0] for _ in range(600))
    assert len(counts) == 3 and min(counts.values()) > 120


def test_fallbacks_with_equal_scores_come_most_free_cache_first():
    picker = make_plugin("max-score-picker", {"maxNumOfEndpoints": 4})
    assert pick_in(picker, state_with_free_blocks(100, 900, 400, 1000), scored(1.0, 1.0, 1.0, 0.2)) == [
        "192.168.1.2:8000", "192.168.1.3:8000", "192.168.1.1:8000", "192.168.1.4:8000"]


def test_tie_break_random_is_gies_choice_whatever_the_room():
    picker = make_plugin("max-score-picker", {"tieBreak": "random"})
    state = state_with_free_blocks(0, 900, 0)
    counts = Counter(pick_in(picker, state, scored(1.0, 1.0, 1.0))[0] for _ in range(600))
    assert len(counts) == 3 and min(counts.values()) > 120
    with pytest.raises(ConfigError, match="'tieBreak' must be one of"):
        make_plugin("max-score-picker", {"tieBreak": "oldest"})


# Eight prompts no replica holds, one at a time on four idle replicas: nothing but the tie-break
# tells the replicas apart. Each new prefix goes to a replica whose cache holds the fewest, two
# per replica (GIE's random choice gives an even split about 4 % of the time), and each prefix's
# next request follows its cache.
async def test_new_prefixes_on_an_idle_pool_spread_over_every_replica():
    picker = DirectorHarness(endpoint_picker_config(
        ["approx-prefix-cache-producer", "prefix-cache-scorer", "queue-scorer", "kv-cache-utilization-scorer",
         "max-score-picker"],
        {"prefix-cache-scorer": 3, "queue-scorer": 2, "kv-cache-utilization-scorer": 2, "max-score-picker": None}))
    picker.set_pool([endpoint(i, block_size=16, num_blocks=1000) for i in range(4)])
    placed: dict[int, str] = {}
    for rounds in range(2):
        for group in range(8):
            prompt = f"group {group}: " + f"a system prompt of group {group} " * 40 + f"question {rounds}"
            result, _ = await picker.cycle(request(prompt, request_id=f"r{rounds}-{group}"))
            placed.setdefault(group, result.targets[0].name)
            assert result.targets[0].name == placed[group]
    assert sorted(Counter(placed.values()).values()) == [2, 2, 2, 2]


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
