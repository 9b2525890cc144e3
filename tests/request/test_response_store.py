"""The store of response id -> replica behind Responses affinity: bounded, expiring, counted."""

from __future__ import annotations

import dataclasses
import json

import pytest
from prometheus_client import CollectorRegistry

from epp.datalayer.registry import EndpointRegistry, parse_endpoint_list
from epp.framework import DropReason, ErrorCode, InferenceError, PluginContext
from epp.framework.registry import default_registry
from epp.request.parsing import RequestParser
from epp.requestcontrol.lifecycle import RequestAccounting, RequestLifecycle
from epp.scorers.parsers.response_store import ResponseStore
from tests.support.scheduling import DirectorHarness, endpoint, request


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, {"parser": "p", **labels}) or 0.0


def test_ids_beyond_the_capacity_go_least_recently_used_first():
    registry = CollectorRegistry()
    store = ResponseStore(2, 60.0, name="p", registry=registry)
    store.learn("a", "e1")
    store.learn("b", "e2")
    assert store.endpoint_of("a") == "e1"  # a is used: b is now the oldest
    store.learn("c", "e3")
    assert (store.endpoint_of("a"), store.endpoint_of("b"), store.endpoint_of("c")) == ("e1", None, "e3")
    assert sample(registry, "epp_response_affinity_entries") == 2
    assert sample(registry, "epp_response_affinity_evictions_total", reason="capacity") == 1


def test_an_id_expires_its_ttl_after_it_was_last_used():
    clock, registry = Clock(), CollectorRegistry()
    store = ResponseStore(10, 60.0, name="p", registry=registry, clock=clock)
    store.learn("a", "e1")
    clock.now += 50
    assert store.endpoint_of("a") == "e1"  # used: its time to live starts again
    clock.now += 50
    assert store.endpoint_of("a") == "e1"
    store.learn("b", "e2")
    clock.now += 61
    assert store.endpoint_of("a") is None
    store.learn("c", "e3")  # learning drops what expired from the old end
    assert len(store) == 1
    assert sample(registry, "epp_response_affinity_evictions_total", reason="expired") == 2


def test_a_capacity_of_zero_learns_nothing_and_odd_ids_are_not_kept():
    store = ResponseStore(0, 60.0)
    store.learn("a", "e1")
    assert store.endpoint_of("a") is None
    store = ResponseStore(10, 60.0)
    store.learn("", "e1")
    store.learn("x" * 1000, "e1")
    assert len(store) == 0


def parser_with_pool(*names: str):
    pool = EndpointRegistry()
    pool.set_endpoints(parse_endpoint_list(",".join(names)))
    context = PluginContext(metrics_registry=CollectorRegistry(), endpoints=pool)
    openai = default_registry().build("openai-parser", "openai-parser", {"responseAffinityTTL": "10m"}, context)
    return RequestParser(parsers=[openai]), openai, pool


def follow_up(reader: RequestParser, previous: str):
    body = json.dumps({"model": "m", "input": "more", "previous_response_id": previous}).encode()
    return reader.parse(request_id="r", headers={":path": "/v1/responses"}, body=body, subset_hint=None)[0]


async def test_the_parser_learns_from_a_completed_response_and_pins_the_follow_up():
    harness = DirectorHarness()  # the default config: llm-d's parser chain, openai-parser first
    harness.set_pool([endpoint(0), endpoint(1)])
    reader = RequestParser(parsers=harness.loaded.parsers)

    async def answered(response_id: str, status: str = "200", served: str | None = None, body: bytes | None = None):
        """One Responses request through the lifecycle, answered with `response_id`; the replica it went to."""
        request, _ = reader.parse(request_id="r", headers={":path": "/v1/responses"},
                                  body=body or b'{"model":"m","input":"hi"}', subset_hint=None)
        life = RequestLifecycle(harness.director, RequestAccounting(harness.metrics))
        result = await life.schedule(request, 10)
        life.response.status, life.response.response_id, life.response.served_endpoint = status, response_id, served
        life.complete()
        return result.targets[0].name

    picked = await answered("resp_1")
    assert follow_up(reader, "resp_1").pinned_endpoint == picked
    # Envoy's served endpoint (a fallback) wins over the first pick.
    await answered("resp_2", served=endpoint(1).name)
    assert follow_up(reader, "resp_2").pinned_endpoint == endpoint(1).name
    # A failed response, or one the request asked not to store, teaches nothing.
    await answered("resp_3", status="500")
    await answered("resp_4", body=b'{"model":"m","input":"hi","store":false}')
    assert follow_up(reader, "resp_3").pinned_endpoint is None and follow_up(reader, "resp_4").pinned_endpoint is None


def test_a_follow_up_whose_replica_left_the_pool_is_a_404_naming_the_field():
    reader, openai, pool = parser_with_pool("10.0.0.1:8000", "10.0.0.2:8000")
    openai.responses.learn("resp_1", "10.0.0.2:8000")
    pool.set_endpoints(parse_endpoint_list("10.0.0.1:8000"))
    with pytest.raises(InferenceError) as caught:
        follow_up(reader, "resp_1")
    assert (caught.value.code, caught.value.param) == (ErrorCode.NOT_FOUND, "previous_response_id")


async def test_the_director_sends_a_pinned_request_only_to_its_endpoint_and_says_when_it_cannot():
    harness = DirectorHarness()
    pool = [endpoint(0, queue=0), endpoint(1, queue=50), endpoint(2, queue=0)]
    pinned = dataclasses.replace(request("more"), pinned_endpoint=pool[1].name)
    for _ in range(5):  # the busiest replica: every scorer prefers the others, the pin wins
        result, _ = await harness.cycle(pinned, pool)
        assert result.targets[0].name == pool[1].name
    asleep = dataclasses.replace(pool[1], healthy=False)
    with pytest.raises(InferenceError) as caught:
        await harness.cycle(pinned, [pool[0], asleep, pool[2]])
    assert caught.value.code is ErrorCode.SERVICE_UNAVAILABLE
    assert caught.value.drop_reason == DropReason.NO_ENDPOINTS
    assert f"held only by replica {pool[1].name}, which is not ready" in caught.value.message
    excluded = dataclasses.replace(pinned, subset_hint=(pool[0].name,))
    with pytest.raises(InferenceError, match="which the subset hint .* leaves out"):
        await harness.cycle(excluded, pool)


def test_a_stored_responses_own_paths_go_where_it_is_stored():
    reader, openai, pool = parser_with_pool("10.0.0.1:8000", "10.0.0.2:8000")
    openai.responses.learn("resp_1", "10.0.0.2:8000")
    for path in ("/v1/responses/resp_1", "/v1/responses/resp_1/", "/v1/responses/resp_1/cancel?x=1",
                 "/v1/responses/resp_1/input_items"):
        assert reader.path_affinity(path) == "10.0.0.2:8000", path
    assert reader.path_affinity("/v1/responses/resp_2") is None  # unknown: any endpoint
    assert reader.path_affinity("/v1/models") is None
    pool.set_endpoints(parse_endpoint_list("10.0.0.1:8000"))
    with pytest.raises(InferenceError) as caught:
        reader.path_affinity("/v1/responses/resp_1")
    assert (caught.value.code, caught.value.param) == (ErrorCode.NOT_FOUND, "response_id")
