"""approx-prefix-cache-producer learns the tokenizer's characters per token; GIE's algorithm stays as it was."""

from __future__ import annotations

import pytest

from epp.framework import CycleState, PluginContext, ProfileRunResult, ResponseInfo, SchedulingResult
from epp.framework.datakeys import PREFIX_TIER_MATCH
from tests.support.scheduling import endpoint, make_plugin, request


def completed(context: PluginContext, characters: int, prompt_tokens: int) -> None:
    """A request the director booked and that completed with this usage."""
    booking = context.load.pick("192.168.1.1:8000", prompt_tokens=characters // 4, prompt_characters=characters)
    context.load.complete(booking, ResponseInfo(usage={"prompt_tokens": prompt_tokens}))


def test_learns_characters_per_token_and_sizes_the_lru_to_the_real_cache():
    context = PluginContext()
    producer = make_plugin("approx-prefix-cache-producer", context=context)
    ep = endpoint(0, block_size=16, num_blocks=1000)
    assert producer.chars_per_token == 4.0  # GIE's assumption until a response says otherwise
    assert producer._capacity_for(ep) == 1000
    for _ in range(200):
        completed(context, characters=10_400, prompt_tokens=4_600)  # ~2.26 characters a token
    assert producer.chars_per_token == pytest.approx(2.26, rel=0.02)
    # A 64-character hash block covers ~28 tokens: 1,000 cache blocks of 16 tokens hold ~565 of them.
    assert producer._capacity_for(ep) == pytest.approx(565, rel=0.02)


@pytest.mark.parametrize("usage", [{}, {"prompt_tokens": 3}, {"prompt_tokens": "many"}, {"prompt_tokens": 10**9}])
def test_useless_usage_teaches_nothing(usage):
    context = PluginContext()
    producer = make_plugin("approx-prefix-cache-producer", context=context)
    booking = context.load.pick("192.168.1.1:8000", prompt_tokens=100, prompt_characters=400)
    context.load.complete(booking, ResponseInfo(usage=usage))
    assert producer.chars_per_token == 4.0


def test_gie_algorithm_keeps_four_characters_per_token():
    context = PluginContext()
    gie = make_plugin("gie-approx-prefix-cache-producer", context=context)
    fixed = make_plugin("approx-prefix-cache-producer", {"charsPerToken": 3.0}, context=context)
    for _ in range(50):
        completed(context, characters=10_400, prompt_tokens=4_600)
    ep = endpoint(0, block_size=16, num_blocks=1000)
    assert gie.chars_per_token == 4.0 and gie._capacity_for(ep) == 1000
    assert fixed.chars_per_token == 3.0 and fixed._capacity_for(ep) == 750


async def test_publishes_token_matches_for_predicted_ttft_when_asked():
    producer = make_plugin("approx-prefix-cache-producer",
                           {"publishTierMatch": True, "charsPerToken": 2.0, "autoTune": False, "blockSizeTokens": 4})
    a, b = endpoint(0), endpoint(1)
    prompt = "x" * 160  # 10 hash blocks of 16 characters; 80 tokens at 2 characters a token
    state = CycleState()
    await producer.prepare(state, request(prompt), [a, b])
    assert state.endpoint_data(PREFIX_TIER_MATCH, a.name).total_tokens == 80
    producer.pre_request(state, request(prompt), SchedulingResult({"default": ProfileRunResult((a,))}, "default"))
    state = CycleState()
    await producer.prepare(state, request(prompt + "y" * 40), [a, b])
    match = state.endpoint_data(PREFIX_TIER_MATCH, a.name)
    assert (match.gpu_tokens, match.total_tokens) == (80, 100)
    assert state.endpoint_data(PREFIX_TIER_MATCH, b.name).gpu_tokens == 0
    assert PREFIX_TIER_MATCH not in make_plugin("approx-prefix-cache-producer").produces()
