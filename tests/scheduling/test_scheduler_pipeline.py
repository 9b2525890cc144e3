"""Whole scheduling cycles through loaded configs: GIE reference vectors, weights, failures, fallbacks."""

from collections import Counter

import pytest

from epp.framework import ErrorCode, InferenceError
from tests.support.configs import endpoint_picker_config, gie_test_config, plugin
from tests.support.scheduling import DirectorHarness, builtin_registry, endpoint, request

GIE_TEST_CONFIG = gie_test_config()


@pytest.mark.parametrize("case, pods, model, target, expected", [
    ("lower queue+kv wins",
     [(3, 0.2, ()), (0, 0.1, ()), (10, 0.2, ())], "my-model", "my-model-12345", "192.168.1.2:8000"),
    ("LoRA active wins",
     [(0, 0.2, ("foo", "bar")), (0, 0.1, ("foo", "sql-lora-1fdg2")), (10, 0.2, ("foo",))],
     "sql-lora", "sql-lora-1fdg2", "192.168.1.2:8000"),
    ("LoRA beats KV",
     [(10, 0.2, ()), (10, 0.4, ("sql-lora-1fdg2",)), (10, 0.3, ())], "sql-lora", "sql-lora-1fdg2",
     "192.168.1.2:8000"),
    ("loaded adapter outweighs queue and KV",
     [(6, 0.2, ("sql-lora-1fdg2",)), (0, 0.85, ()), (10, 0.9, ())], "sql-lora", "sql-lora-1fdg2",
     "192.168.1.1:8000"),
])
async def test_gie_reference_vectors(case, pods, model, target, expected):
    picker = DirectorHarness(GIE_TEST_CONFIG)
    picker.set_pool([endpoint(i, queue=q, kv=kv, active=active) for i, (q, kv, active) in enumerate(pods)])
    for _ in range(20):  # no ties here: the same endpoint every time
        result, _ = await picker.cycle(request("hello world", model=model, target=target))
        assert [ep.name for ep in result.targets] == [expected], case


async def test_weights_decide_between_scorers():
    # Endpoint 0 has the shorter queue, endpoint 1 the freer KV cache.
    eps = [endpoint(0, queue=0, kv=0.9), endpoint(1, queue=10, kv=0.0)]

    def weighted(queue: float, kv: float) -> DirectorHarness:
        weights = {"queue-scorer": queue, "kv-cache-utilization-scorer": kv}
        return DirectorHarness(endpoint_picker_config(list(weights), weights))

    result, _ = await weighted(2, 1).cycle(request(), eps)
    assert result.targets[0].name == "192.168.1.1:8000"   # 2*1 + 0.1 vs 0 + 1
    result, _ = await weighted(1, 2).cycle(request(), eps)
    assert result.targets[0].name == "192.168.1.2:8000"   # 1 + 0.2 vs 0 + 2
    result, _ = await weighted(0, 0.5).cycle(request(), eps)
    assert result.targets[0].name == "192.168.1.2:8000"   # weight 0 turns the queue off


async def test_filter_leaving_nothing_fails_the_profile_with_429():
    picker = DirectorHarness(endpoint_picker_config(
        [plugin("by-label", label="pool", validValues=["blue"]), "queue-scorer"], ["by-label", "queue-scorer"]))
    with pytest.raises(InferenceError) as err:
        await picker.cycle(request(), [endpoint(0, labels={"pool": "green"}), endpoint(1)])
    assert err.value.code is ErrorCode.RESOURCE_EXHAUSTED and err.value.code.http_status == 429
    result, _ = await picker.cycle(request(), [endpoint(0, labels={"pool": "blue"}), endpoint(1)])
    assert result.targets[0].name == "192.168.1.1:8000"


async def test_no_candidates_is_503():
    with pytest.raises(InferenceError) as err:
        await DirectorHarness().cycle(request(), [])
    assert err.value.code.http_status == 503


async def test_fallbacks_come_in_score_order():
    picker = DirectorHarness(endpoint_picker_config(
        ["queue-scorer", plugin("max-score-picker", maxNumOfEndpoints=3)], ["queue-scorer", "max-score-picker"]))
    eps = [endpoint(0, queue=8), endpoint(1, queue=0), endpoint(2, queue=4), endpoint(3, queue=10)]
    result, _ = await picker.cycle(request(), eps)
    assert [ep.name for ep in result.targets] == ["192.168.1.2:8000", "192.168.1.3:8000", "192.168.1.1:8000"]


async def test_equal_totals_are_picked_at_random():
    picker = DirectorHarness(GIE_TEST_CONFIG)
    picker.set_pool([endpoint(i, queue=1, kv=0.5) for i in range(4)])
    counts = Counter()
    for i in range(400):
        # A distinct short prompt per request: below one block, so no prefix affinity builds up.
        result, _ = await picker.cycle(request(f"{i}"))
        counts[result.targets[0].name] += 1
    assert len(counts) == 4 and min(counts.values()) > 50


async def test_default_pipeline_sticks_to_the_prefix_holder_and_spreads_new_prefixes():
    picker = DirectorHarness()
    picker.set_pool([endpoint(i) for i in range(4)])
    first = {}
    for group in range(8):
        prompt = f"group {group} " + "shared system prompt " * 40
        for turn in range(3):
            result, _ = await picker.cycle(request(prompt + f"question {turn}"))
            first.setdefault(group, result.targets[0].name)
            assert result.targets[0].name == first[group]
    assert len(set(first.values())) > 1  # new prefixes tie at 0 and land at random


async def test_scores_are_clamped_into_0_1_before_weighting():
    from epp.framework import Scorer

    class Wild(Scorer):
        """Returns out-of-range scores."""
        type_name = "wild-scorer"

        def __init__(self, name, params, context):
            super().__init__(name)

        def score(self, state, request, endpoints):
            values = [5.0, -3.0, float("nan"), 0.25]
            return {ep.name: v for ep, v in zip(endpoints, values)}

    reg = builtin_registry()
    reg.register_class(Wild)
    picker = DirectorHarness(endpoint_picker_config(
        ["wild-scorer", plugin("max-score-picker", maxNumOfEndpoints=5)], {"wild-scorer": 2, "max-score-picker": None}),
        plugins=reg)
    picker.set_pool([endpoint(i) for i in range(5)])  # the fifth gets no score at all: 0
    seen = Counter()
    for _ in range(60):
        result, _ = await picker.cycle(request())
        names = [ep.name for ep in result.targets]
        assert names[:2] == ["192.168.1.1:8000", "192.168.1.4:8000"]   # 2 x 1.0, then 2 x 0.25
        seen[tuple(names[2:])] += 1
    assert len(seen) == 6  # the three zero totals (-3, NaN, missing) tie and come in every order
