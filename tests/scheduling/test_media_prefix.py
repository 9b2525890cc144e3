"""Media in prompts and the prefix indexes: the same image shares prefix credit, another image does not.

Approximate index: requests read by the picker's own parsers, routed through approx-prefix-cache-producer.
Precise index: vLLM's KV events carry each image's identifier in `extra_keys` as `(identifier, offset)` on
every block it overlaps; a token-in request (`/inference/v1/generate` features) or the renderer's answer
places the same identifiers, and the keys agree exactly when the images do.
"""

from __future__ import annotations

import json

from prometheus_client import CollectorRegistry

from epp.framework import CycleState, PluginContext, ProfileRunResult, SchedulingResult
from epp.framework.datakeys import PREFIX_MATCH_INFO, PROMPT_TOKENS, PromptTokens
from epp.framework.registry import default_registry
from epp.framework.types import Endpoint, MediaItem
from epp.kvevents.decoding import decode_batch
from epp.kvevents.keys import BlockKeyer, media_extras
from epp.request.parsing import RequestParser
from tests.kvevents import wire
from tests.support.scheduling import endpoint, make_plugin

PARSER = RequestParser()
SYSTEM = "You answer questions about pictures of animals. " * 30
CAT = "https://example.invalid/cat.png"
DOG = "https://example.invalid/dog.png"


def chat(image: str | None, question: str = "What animal is this, and what is it doing?"):
    parts = [{"type": "text", "text": question}]
    if image is not None:
        parts.insert(0, {"type": "image_url", "image_url": {"url": image}})
    body = {"model": "m", "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": parts}]}
    return PARSER.parse(request_id="r", headers={":path": "/v1/chat/completions"}, body=json.dumps(body).encode(),
                        subset_hint=None)[0]


async def matched(producer, request, ep, *, record: bool = False) -> tuple[float, int]:
    state = CycleState()
    await producer.prepare(state, request, [ep])
    info = state.endpoint_data(PREFIX_MATCH_INFO, ep.name)
    if record:
        producer.pre_request(state, request, SchedulingResult({"default": ProfileRunResult((ep,))}, "default"))
    return info.matched_blocks, info.total_blocks


async def test_approximate_index_credits_the_same_image_and_not_another():
    producer = make_plugin("approx-prefix-cache-producer", {"autoTune": False})
    ep = endpoint(0)
    await matched(producer, chat(CAT), ep, record=True)
    same, total = await matched(producer, chat(CAT), ep)
    assert same == total  # every block, the image's digest and the question after it included
    other, _ = await matched(producer, chat(DOG), ep)
    none, _ = await matched(producer, chat(None), ep)
    # The system prompt before the image is shared; nothing from the image on.
    assert 0 < other < total and 0 < none < total
    assert other <= same - 1


async def test_a_token_count_is_routed_but_records_no_prefix():
    producer = make_plugin("approx-prefix-cache-producer", {"autoTune": False})
    ep = endpoint(0)
    body = {"model": "m", "system": SYSTEM, "messages": [{"role": "user", "content": "How many tokens?"}]}
    count = PARSER.parse(request_id="r", headers={":path": "/v1/messages/count_tokens"},
                         body=json.dumps(body).encode(), subset_hint=None)[0]
    await matched(producer, count, ep, record=True)
    message = PARSER.parse(request_id="r", headers={":path": "/v1/messages"}, body=json.dumps(body).encode(),
                           subset_hint=None)[0]
    assert (await matched(producer, message, ep))[0] == 0


# -- precise ------------------------------------------------------------------------------------------------

BS = 4
A = Endpoint("10.0.0.1", 8000)
TOKENS = list(range(100, 124))  # 6 blocks of 4; an image's 6 placeholder tokens at 5..10 (blocks 1 and 2)
PLACEHOLDER = 32000


def prompt_tokens(offset: int = 5, length: int = 6):
    ids = list(TOKENS)
    ids[offset:offset + length] = [PLACEHOLDER] * length
    return ids


def engine_extra_keys(identifier: str, offset: int = 5, length: int = 6, blocks: int = 6):
    """What vLLM's events put in `extra_keys`: per block, `(identifier, offset - block start)` for each
    media item the block overlaps, else None (the untagged form of ("mm", identifier, offset))."""
    out = []
    for b in range(blocks):
        start = b * BS
        overlaps = offset < start + BS and offset + length > start
        out.append([[identifier, offset - start]] if overlaps else None)
    return out


def precise_producer(**params):
    return default_registry().build("precise-prefix-cache-producer", "precise",
                                    {"blockSizeTokens": BS, "subscribe": False, **params},
                                    PluginContext(metrics_registry=CollectorRegistry()))


def feed(producer, identifier: str):
    event = wire.stored(list(range(1, 7)), prompt_tokens(), extra_keys=engine_extra_keys(identifier))
    producer.index.apply_batch(A.name, decode_batch(wire.encode_batch([event])), "m")


def generate(identifier: str | None, offset: int = 5, length: int = 6):
    body = {"model": "m", "token_ids": prompt_tokens(offset, length)}
    if identifier is not None:
        body["features"] = {"mm_hashes": {"image": [identifier]},
                            "mm_placeholders": {"image": [{"offset": offset, "length": length}]}}
    return PARSER.parse(request_id="r", headers={":path": "/inference/v1/generate"}, body=json.dumps(body).encode(),
                        subset_hint=None)[0]


def test_request_and_event_sides_salt_the_block_where_an_item_starts():
    keyer = BlockKeyer(BS)
    root = keyer.root("m")
    with_cat = keyer.chain(root, prompt_tokens(), media_extras([("cat", 5)], BS))
    with_dog = keyer.chain(root, prompt_tokens(), media_extras([("dog", 5)], BS))
    plain = keyer.chain(root, prompt_tokens())
    assert with_cat[0] == with_dog[0] == plain[0]  # block 0 holds no image token
    assert len({with_cat[1], with_dog[1], plain[1]}) == 3  # block 1 holds the image's first token
    assert with_cat[2:] != with_dog[2:]  # and the chain carries it on


async def test_precise_index_matches_a_token_in_request_exactly_when_its_image_is_the_engines():
    producer = precise_producer()
    feed(producer, "hash-of-cat")
    assert await matched(producer, generate("hash-of-cat"), A) == (6.0, 6)
    assert await matched(producer, generate("hash-of-dog"), A) == (1.0, 6)  # only the block before the image
    assert await matched(producer, generate(None), A) == (1.0, 6)  # placeholder ids alone are not the image


async def test_precise_index_places_the_renderers_media_from_the_token_producer():
    producer = precise_producer(useTokenProducer=True)
    feed(producer, "hash-of-cat")
    request = chat(CAT)
    for identifier, expected in (("hash-of-cat", 6.0), ("hash-of-dog", 1.0)):
        state = CycleState()
        # What token-producer publishes from vLLM's render answer: the ids and each item's place and hash.
        state.put(PROMPT_TOKENS, PromptTokens(tuple(prompt_tokens()), exact=True, media=(
            MediaItem("image", identifier, 0, engine_hash=identifier, token_offset=5, token_length=6),)))
        await producer.prepare(state, request, [A])
        assert state.endpoint_data(PREFIX_MATCH_INFO, A.name).matched_blocks == expected


async def test_an_item_running_on_into_a_later_event_is_keyed_where_it_started():
    # The engine announces blocks 0-2 and 3-5 in two events; the image (tokens 5..14) starts in the
    # first and runs on into block 3, which names it with a negative offset.
    producer = precise_producer()
    tokens, keys = prompt_tokens(5, 10), engine_extra_keys("hash-of-cat", 5, 10)
    assert keys[3] == [["hash-of-cat", -7]]
    first = wire.stored([1, 2, 3], tokens[:12], extra_keys=keys[:3])
    second = wire.stored([4, 5, 6], tokens[12:], parent=3, extra_keys=keys[3:])
    producer.index.apply_batch(A.name, decode_batch(wire.encode_batch([first, second])), "m")
    assert await matched(producer, generate("hash-of-cat", 5, 10), A) == (6.0, 6)
    assert await matched(producer, generate("hash-of-dog", 5, 10), A) == (1.0, 6)


async def test_engine_blocks_smaller_than_index_blocks_key_the_item_where_it_starts_too():
    # Engine blocks of 2 tokens, index blocks of 4: the item's start (token 5) is in engine block 2 at
    # offset 1, which is index block 1 at place 1: the same salt a request computes.
    producer = precise_producer()
    tokens = prompt_tokens()
    extra = []
    for b in range(12):
        start = b * 2
        extra.append([["hash-of-cat", 5 - start]] if 5 < start + 2 and 11 > start else None)
    event = wire.stored(list(range(1, 13)), tokens, block_size=2, extra_keys=extra)
    producer.index.apply_batch(A.name, decode_batch(wire.encode_batch([event])), "m")
    assert await matched(producer, generate("hash-of-cat"), A) == (6.0, 6)
    assert await matched(producer, generate("hash-of-dog"), A) == (1.0, 6)
