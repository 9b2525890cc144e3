"""bench/agentic_turn_cost.py's parts: the messages it plays as Envoy, and the KV events it plays as the replica
(their chain must confirm the prompt's blocks, as a replica's do, or the picker claims every block each turn)."""

from __future__ import annotations

from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode

from bench import agentic_turn_cost
from epp.kvevents.decoding import decode_batch
from epp.kvevents.index import KVBlockIndex
from epp.kvevents.keys import BlockKeyer

ENDPOINT = "127.0.0.1:20000"


def test_envoy_messages_are_first_token_mode_with_the_body_in_pieces():
    body = b"x" * 2500
    msgs = agentic_turn_cost.envoy_messages(body, 1024, "s1")
    kinds = [m.WhichOneof("request") for m in msgs]
    assert kinds == ["request_headers", "request_body", "request_body", "request_body", "response_headers",
                     "response_body"]
    assert msgs[0].protocol_config.response_body_mode == ProcessingMode.STREAMED
    assert b"".join(m.request_body.body for m in msgs[1:4]) == body
    assert [m.request_body.end_of_stream for m in msgs[1:4]] == [False, False, True]


def test_the_replica_events_confirm_each_turns_prompt_blocks_and_chain_the_next_turn_on_them():
    index = KVBlockIndex(agentic_turn_cost.BLOCK, 100_000)
    replicas = agentic_turn_cost.Replicas(seed=1)
    keyer = BlockKeyer(agentic_turn_cost.BLOCK)
    first = list(range(1000, 1000 + 16 * 600 + 5))  # 600 full blocks and a partial one
    second = first + list(range(50_000, 50_000 + 16 * 40))  # the next turn: 40 blocks more
    for tokens in (first, second):
        batches = replicas.after(ENDPOINT, "s1", tokens, output_tokens=64)
        assert len(batches) == 2 + 4 if tokens is first else 1 + 4  # prefill chunks of 512 blocks, 4 output blocks
        for payload in batches:
            index.apply_batch(ENDPOINT, decode_batch(payload), agentic_turn_cost.MODEL)
        keys = keyer.request_keys(tokens, agentic_turn_cost.MODEL)
        run = index.lookup(keys, [ENDPOINT]).get(ENDPOINT, [])
        assert len(run) == len(tokens) // agentic_turn_cost.BLOCK  # every full prompt block, the last included
