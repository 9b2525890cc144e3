"""GIE's portable black-box vectors, through the real ext_proc gRPC API and the real `/metrics` scraper.

Pods are real HTTP servers at 127.0.0.2-4 (one common port) serving vLLM-shaped `/metrics`;
the picker scrapes them, so a case passes only if scraping, parsing, the config loader, the
scorers and the picker all agree with the GIE formulas.
"""

from __future__ import annotations

import json

import pytest

from tests.support.configs import gie_test_config, objectives
from tests.support.extproc import (
    ExtProcClient,
    gie_body,
    immediate,
    request_body,
    request_headers,
    route,
    subset_metadata,
)
from tests.support.pods import FakeVllmPod, start_picker, start_pods, wait_for_scraped

# GIE's integration-test config: queue + kv + prefix + lora at weight 1, max-score picker.
# `critical` is a non-sheddable objective (priority 2), as in "no shedding at priority 2";
# `batch` (priority -1) is sheddable.
VECTOR_CONFIG = gie_test_config(objectives=objectives(critical=2, batch=-1))


@pytest.fixture
async def pods():
    started = await start_pods(3)
    yield started
    for pod in started:
        await pod.stop()


@pytest.fixture
async def picker(pods):
    """A fresh picker per case (GIE starts a fresh runner per test): no prefix history carries over."""
    server = await start_picker(VECTOR_CONFIG, [p.spec for p in pods])
    client = ExtProcClient(server.grpc_port)
    yield server, client
    await client.close()
    await server.stop(0)


def set_pods(pods: list[FakeVllmPod], *values) -> None:
    for pod, (queue, kv, *active) in zip(pods, values):
        pod.set(queue, kv, active)


REWRITE = ("x-gateway-model-name-rewrite", "my-model-12345")
LORA_REWRITE = ("x-gateway-model-name-rewrite", "sql-lora-1fdg2")

# (case, pods as (queue, kv, active adapters...), body model, extra headers, winning pod index)
VECTORS = [
    # queue .7/1/0 + kv .8/.9/.8 -> 1.5, 1.9, .8
    ("lower queue+kv wins", [(3, .2), (0, .1), (10, .2)], "my-model", [REWRITE], 1),
    # queue 1/1/0 + kv .8/.9/.8 + lora 0/1/0 -> 1.8, 2.9, .8
    ("active LoRA wins", [(0, .2, "foo", "bar"), (0, .1, "foo", "sql-lora-1fdg2"), (10, .2, "foo")],
     "sql-lora", [LORA_REWRITE], 1),
    # queue 1/1/1 + kv .8/.6/.7 + lora 0/1/0 -> 1.8, 2.6, 1.7
    ("LoRA beats KV", [(10, .2), (10, .4, "sql-lora-1fdg2"), (10, .3)], "sql-lora", [LORA_REWRITE], 1),
    # saturated pool (mean of max(q/5, kv/.8) = 1.42) but priority 2 is not sheddable:
    # queue .4/1/0 + kv .8/.15/.1 + lora 1/0/0 -> 2.2, 1.15, .1
    ("no shedding at priority 2", [(6, .2, "sql-lora-1fdg2"), (0, .85), (10, .9)], "sql-lora",
     [LORA_REWRITE, ("x-gateway-inference-objective", "critical")], 0),
]


@pytest.mark.parametrize("case, values, model, extra, winner", VECTORS, ids=[v[0] for v in VECTORS])
async def test_picked_endpoint_follows_the_gie_formulas(pods, picker, case, values, model, extra, winner):
    server, client = picker
    set_pods(pods, *values)
    await wait_for_scraped(server, pods)
    destination, lb, forwarded = await route(client, gie_body(model), extra=extra)
    assert destination == lb == pods[winner].hostport, case
    target = dict(extra).get("x-gateway-model-name-rewrite")
    assert json.loads(forwarded)["model"] == target


async def test_free_lora_slot_beats_a_waiting_adapter(pods, picker):
    # lora-affinity: active 1, free slot (running + waiting < max_lora) .8, target waiting .6, else 0.
    server, client = picker
    pods[0].set(0, .2, active=["foo", "bar"], max_lora=2)  # full, target not there: 0
    pods[1].set(0, .2, active=["foo"], waiting=["sql-lora-1fdg2"], max_lora=2)  # full, target waiting: .6
    pods[2].set(0, .2, active=["foo"], max_lora=2)  # one slot free: .8
    await wait_for_scraped(server, pods)
    assert (await route(client, gie_body("sql-lora"), extra=[LORA_REWRITE]))[0] == pods[2].hostport
    pods[2].set(0, .2, active=["foo", "baz"], max_lora=2)  # now full too: the waiting adapter wins
    await wait_for_scraped(server, pods)
    assert (await route(client, gie_body("sql-lora", "test2"), extra=[LORA_REWRITE]))[0] == pods[1].hostport


async def test_the_priority_2_pool_does_shed_a_sheddable_request(pods, picker):
    server, client = picker
    set_pods(pods, *VECTORS[3][1])
    await wait_for_scraped(server, pods)
    extra = [LORA_REWRITE, ("x-gateway-inference-objective", "batch")]
    status, body = await immediate(client, [request_headers(extra=extra), request_body(gie_body("sql-lora"))])
    assert (status, body) == (429, b"inference error: ResourceExhausted - system saturated, sheddable request dropped")


async def test_subset_hint_narrows_the_candidates(pods, picker):
    server, client = picker
    set_pods(pods, (3, .2), (0, .1), (10, .2))
    await wait_for_scraped(server, pods)
    everyone = subset_metadata([p.hostport for p in pods])
    assert (await route(client, gie_body("my-model"), metadata=everyone))[0] == pods[1].hostport
    # Only the most loaded pod is allowed: it gets the request anyway.
    only_third = subset_metadata([pods[2].hostport])
    assert (await route(client, gie_body("my-model"), metadata=only_third))[0] == pods[2].hostport


async def test_subset_hint_without_a_match_is_503(pods, picker):
    server, client = picker
    await wait_for_scraped(server, pods)
    nowhere = subset_metadata([f"127.0.0.99:{pods[0].port}"])
    status, body = await immediate(client, [request_headers(metadata=nowhere),
                                            request_body(gie_body("my-model"), metadata=nowhere)])
    assert (status, body) == (503, (b"inference error: ServiceUnavailable - "
                                    b"failed to find endpoint candidates for serving the request"))


async def test_body_without_a_model_is_400(pods, picker):
    _, client = picker
    status, body = await immediate(client, [request_headers(), request_body(b'{"prompt":"hello world"}')])
    assert (status, body) == (400, b"inference error: BadRequest - model not found in request body")


async def test_header_only_request_without_pods_is_500():
    server = await start_picker(VECTOR_CONFIG, [])
    client = ExtProcClient(server.grpc_port)
    try:
        status, body = await immediate(client, [request_headers(end_of_stream=True)])
        assert (status, body) == (500, b"inference error: Internal - no pods available in datastore")
    finally:
        await client.close()
        await server.stop(0)
