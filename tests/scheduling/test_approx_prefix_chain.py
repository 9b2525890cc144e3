"""The approximate prefix index keeps a chain's head under pressure, as vLLM's prefix cache does; GIE's does not."""

from __future__ import annotations

import pytest

from epp.framework import CycleState, PluginContext, ProfileRunResult, SchedulingResult
from epp.framework.datakeys import PREFIX_MATCH_INFO, PREFIX_TIER_MATCH
from epp.scorers.prefix_index import PrefixIndex
from tests.support.scheduling import endpoint, make_plugin, request


def test_chain_aware_index_evicts_a_chains_tail_first():
    chain, other = [1, 2, 3, 4, 5], [6, 7]
    aware, gie = PrefixIndex(chain_aware=True), PrefixIndex()
    for index in (aware, gie):
        index.add(chain, "a", capacity=5)
        index.add(other, "a", capacity=5)  # two of the first chain's blocks must go
    # vLLM frees a finished request's blocks tail first: the head (a shared system prompt, a
    # chat's history) stays usable. GIE's LRU drops the head, and with it the whole match.
    assert aware.match_longest_prefix(chain) == {"a": 3}
    assert gie.match_longest_prefix(chain) == {}
    assert aware.size == gie.size == 5


def test_chain_aware_match_counts_only_blocks_held_from_the_start():
    aware, gie = PrefixIndex(chain_aware=True), PrefixIndex()
    for index in (aware, gie):
        index.add([1, 2, 3], "a", capacity=10)
        index.add([1, 9, 3], "b", capacity=10)  # "b" holds blocks 1 and 3 of the chain, not 2
    assert aware.match_longest_prefix([1, 2, 3, 4]) == {"a": 3, "b": 1}
    assert gie.match_longest_prefix([1, 2, 3, 4]) == {"a": 3, "b": 2}  # GIE counts the gap over
    assert aware.match_longest_prefix([1, 9, 3]) == {"a": 1, "b": 3}
    assert aware.match_longest_prefix([7, 1]) == {}
    assert aware.match_longest_prefix([]) == {}


@pytest.mark.parametrize("chain_aware", [True, False])
def test_a_snapshot_rebuilds_the_same_lru(chain_aware):
    source = PrefixIndex(chain_aware=chain_aware)
    source.add([1, 2, 3], "a", capacity=4)
    source.add([4, 5], "a", capacity=4)
    source.add([1], "a", capacity=4)
    copy = PrefixIndex(chain_aware=chain_aware)
    for ep, hashes, capacity in source.entries():  # what a peer picker sends a late one
        copy.add(hashes, ep, capacity)
    for index in (source, copy):  # the same next eviction in both
        index.add([8, 9], "a", capacity=4)
    assert copy.entries() == source.entries()


async def pick(producer, prompt: str, ep) -> tuple[int, int]:
    """Prepare (match) and record a request sent to `ep`; returns (matched, total) blocks."""
    state = CycleState()
    req = request(prompt)
    await producer.prepare(state, req, [ep])
    info = state.endpoint_data(PREFIX_MATCH_INFO, ep.name)
    producer.pre_request(state, req, SchedulingResult({"default": ProfileRunResult((ep,))}, "default"))
    return info.matched_blocks, info.total_blocks


async def test_a_chat_session_keeps_its_history_match_when_other_sessions_fill_the_cache():
    ep = endpoint(0, block_size=16, num_blocks=30)  # 30 hash blocks of 64 characters at 4 a token
    ours = make_plugin("approx-prefix-cache-producer", {"charsPerToken": 4.0})
    gie = make_plugin("gie-approx-prefix-cache-producer")
    history = "s" * 64 * 20  # a session's history: 20 blocks
    for producer in (ours, gie):
        await pick(producer, history, ep)
        await pick(producer, "o" * 64 * 15, ep)  # another session: 5 of the first one's blocks must go
    # The next turn resends the history plus a new message: 15 of its 20 blocks are still cached.
    assert await pick(ours, history + "u" * 64 * 2, ep) == (15, 22)
    assert await pick(gie, history + "u" * 64 * 2, ep) == (0, 22)


def chat(messages: list[str]) -> object:
    body = {"model": "my-model", "messages": [{"role": "user", "content": m} for m in messages]}
    return request(api="chat/completions", body=body)


async def test_learns_hashed_bytes_per_character_of_chat_json():
    producer = make_plugin("approx-prefix-cache-producer", {"charsPerToken": 2.0, "publishTierMatch": True})
    ep = endpoint(0, block_size=16, num_blocks=1000)
    assert producer.bytes_per_character == 1.0 and producer._capacity_for(ep) == 500
    messages = ["w" * 60] * 10  # each message: 64 characters (role and content), 88 bytes of JSON
    for _ in range(200):
        await producer.prepare(CycleState(), chat(messages), [ep])
    # 10 x 88 JSON bytes + brackets and commas over 10 x 64 characters (content and role): ~1.39.
    assert producer.bytes_per_character == pytest.approx(891 / 640, rel=0.01)
    # A 64-byte hash block covers fewer tokens than 64 characters would: the LRU holds more of them.
    assert producer._capacity_for(ep) == pytest.approx(1000 * 2.0 * 891 / 640 / 4, rel=0.01)
    state = CycleState()
    await producer.prepare(state, chat(messages), [ep])
    producer.pre_request(state, chat(messages), SchedulingResult({"default": ProfileRunResult((ep,))}, "default"))
    state = CycleState()
    await producer.prepare(state, chat(messages), [ep])
    match = state.endpoint_data(PREFIX_TIER_MATCH, ep.name)
    assert match.total_tokens == 320  # 640 characters at 2 a token
    assert match.gpu_tokens == pytest.approx(320, rel=0.05)  # 13 full blocks and the tail, in tokens


async def test_gie_algorithm_learns_no_bytes_per_character():
    gie = make_plugin("gie-approx-prefix-cache-producer", context=PluginContext())
    await gie.prepare(CycleState(), chat(["w" * 60] * 10), [endpoint(0, block_size=16, num_blocks=1000)])
    assert gie.bytes_per_character == 1.0 and not gie.index.chain_aware


async def test_chain_aware_false_keeps_gies_index_with_the_learned_ratios():
    ep = endpoint(0, block_size=16, num_blocks=30)
    head_first = make_plugin("approx-prefix-cache-producer", {"charsPerToken": 4.0, "chainAware": False})
    assert not head_first.index.chain_aware and "chainAware=false" in head_first.describe()
    history = "s" * 64 * 20
    await pick(head_first, history, ep)
    await pick(head_first, "o" * 64 * 15, ep)
    assert await pick(head_first, history + "u" * 64 * 2, ep) == (0, 22)
