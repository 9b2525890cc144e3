"""`POST /debug/explain`: one request through producers, filters, scorers and picker, booking nothing."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from epp.debug import http as debug_http
from epp.debug.cli import format_answer
from epp.debug.explain import ExplainInput, explain, parse_explain_input
from epp.framework import Admitter, DataProducer, ErrorCode, InferenceError
from epp.request.parsing import RequestParser
from tests.support.configs import endpoint_picker_config, plugin
from tests.support.extproc import pipeline_of, started
from tests.support.scheduling import DirectorHarness, endpoint, request
from tests.support.wait import wait_until

CONFIG = endpoint_picker_config(
    [plugin("approx-prefix-cache-producer", autoTune=False), "prefix-cache-scorer", "queue-scorer",
     plugin("session-affinity-scorer", strategy="session_id"), "no-hit-lru-scorer", "max-score-picker"],
    {"prefix-cache-scorer": 3, "queue-scorer": 1, "session-affinity-scorer": 1, "no-hit-lru-scorer": 1,
     "max-score-picker": None})
POOL = [endpoint(0, queue=0), endpoint(1, queue=3), endpoint(2, queue=7)]
LONG = "a prompt long enough to fill several prefix blocks " * 10


def body(prompt: str) -> bytes:
    return json.dumps({"model": "m", "prompt": prompt}).encode()


async def explained(harness: DirectorHarness, prompt: str, headers: dict | None = None, **kw) -> dict:
    given = ExplainInput("/v1/completions", headers or {}, body(prompt), **kw)
    return await explain(harness.director, RequestParser(), given)


def stateful_parts(harness: DirectorHarness) -> tuple:
    loaded = harness.loaded
    prefix, session, lru = (loaded.plugin(n) for n in ("approx-prefix-cache-producer", "session-affinity-scorer",
                                                       "no-hit-lru-scorer"))
    return (len(harness.director.ledger), prefix.index.size, prefix.index.entries(), session.debug_state(),
            lru.debug_state())


async def test_explain_books_nothing_and_predicts_the_real_pick():
    harness = DirectorHarness(CONFIG)
    harness.set_pool(POOL)
    first, _ = await harness.pick(request(LONG, model="m", headers={"x-session-id": "s1"}))
    before = stateful_parts(harness)
    cold = await explained(harness, "another prompt, which no endpoint has seen " * 10, {"x-session-id": "s3"})
    answer = await explained(harness, LONG, {"x-session-id": "s2"})
    # No booking, no index insert, no session bound, no cold pick remembered.
    assert stateful_parts(harness) == before
    assert cold["picked"] and cold["picked"] != answer["picked"]  # the no-hit LRU steers a cold one elsewhere
    [profile] = answer["profiles"]
    assert profile["tied_at_top"] == 1
    rows = {row["endpoint"]: row for row in profile["endpoints"]}
    picked = first.targets[0].name
    # The first request's blocks are on its endpoint; the session is new.
    assert rows[picked]["scores"]["prefix-cache-scorer"] == 1.0
    assert all(row["scores"]["session-affinity-scorer"] == 0.0 for row in rows.values())
    assert answer["picked"] == [picked] == profile["picked"] and rows[picked]["picked"]
    weights = {s["name"]: s["weight"] for s in profile["scorers"]}
    for row in rows.values():
        assert row["total"] == pytest.approx(sum(weights[n] * v for n, v in row["scores"].items()))
    assert [r["total"] for r in profile["endpoints"]] == sorted((r["total"] for r in rows.values()), reverse=True)
    real, _ = await harness.pick(request(LONG, model="m", headers={"x-session-id": "s2"}))
    assert real.targets[0].name == picked
    assert stateful_parts(harness)[3]["sessions"] == 2  # the real request's pre-request hooks did run
    assert answer["producers"] == [{"name": "approx-prefix-cache-producer", "type": "approx-prefix-cache-producer",
                                    "outcome": "ok", "ms": answer["producers"][0]["ms"]}]


async def test_explain_names_the_filter_that_dropped_each_endpoint():
    config = endpoint_picker_config([plugin("by-label", label="pool", validValues=["blue"]), "queue-scorer"],
                                    ["by-label", "queue-scorer"])
    harness = DirectorHarness(config)
    harness.set_pool([endpoint(0, labels={"pool": "blue"}), endpoint(1), endpoint(2, queue=4, labels={"pool": "blue"})])
    answer = await explained(harness, "hello")
    [profile] = answer["profiles"]
    assert [(r["endpoint"], r["dropped_by"], r.get("total")) for r in profile["endpoints"]] == [
        ("192.168.1.1:8000", None, 1.0), ("192.168.1.3:8000", None, 0.0), ("192.168.1.2:8000", "by-label", None)]
    assert answer["picked"] == ["192.168.1.1:8000"] and answer["error"] is None
    harness.set_pool([endpoint(1)])
    answer = await explained(harness, "hello")
    assert answer["error"] == ("inference error: ResourceExhausted - failed to find target endpoint: "
                               "no endpoints available for the given request")
    assert answer["profiles"][0]["endpoints"] == [{"endpoint": "192.168.1.2:8000", "dropped_by": "by-label",
                                                   "picked": False}]
    assert answer["picked"] == []


async def test_explain_without_candidates_says_what_the_picker_would_answer():
    harness = DirectorHarness(CONFIG)
    harness.set_pool(POOL)
    answer = await explained(harness, "hello", subset_hint=("10.9.9.9:8000",))
    assert answer["candidates"] == [] and answer["producers"] == []
    assert answer["error"] == ("inference error: ServiceUnavailable - failed to find endpoint candidates for "
                               "serving the request")
    assert answer["profiles"][0]["ran"] is False


class RefuseAll(Admitter):
    type_name = "refuse-all"

    def admit(self, state, request, endpoints):
        raise InferenceError(ErrorCode.RESOURCE_EXHAUSTED, "the pool is saturated")


async def test_an_admitters_refusal_is_shown_beside_the_scores():
    server = await started(pipeline_of([RefuseAll()]), enable_debug_endpoint=True)
    try:
        answer = await post_explain(server.metrics_port, {"body": {"model": "m", "prompt": "hi"}})
    finally:
        await server.stop(0)
    assert answer[0] == 200
    assert answer[1]["admitters"] == [{"name": "refuse-all", "type": "refuse-all",
                                       "outcome": "refused: inference error: ResourceExhausted - the pool is saturated"}]
    assert answer[1]["error"] == "inference error: ResourceExhausted - the pool is saturated"
    assert answer[1]["picked"] == ["10.0.0.1:8000"]  # where it would have gone, admitted
    assert format_answer(answer[1]).splitlines()[-2:] == [
        "admitted, it would go to: 10.0.0.1:8000",
        "the picker would answer: inference error: ResourceExhausted - the pool is saturated"]


class BrokenAdmitter(Admitter):
    type_name = "broken-admitter"

    def admit(self, state, request, endpoints):
        raise RuntimeError("a bug")


async def test_an_admitter_that_fails_denies_as_the_director_does():
    server = await started(pipeline_of([BrokenAdmitter()]), enable_debug_endpoint=True)
    try:
        status, answer = await post_explain(server.metrics_port, {"body": {"model": "m", "prompt": "hi"}})
    finally:
        await server.stop(0)
    assert status == 200
    assert answer["admitters"] == [{"name": "broken-admitter", "type": "broken-admitter",
                                    "outcome": "failed: RuntimeError"}]
    assert answer["error"] == "inference error: Internal - request cannot be admitted"


async def test_explain_reads_the_model_rewrite_and_objective_headers():
    harness = DirectorHarness(endpoint_picker_config(["queue-scorer"], ["queue-scorer"], objectives=[
        {"name": "batch", "priority": -1}]))
    harness.set_pool(POOL)
    parser = RequestParser({"batch": -1})
    answer = await explain(harness.director, parser, ExplainInput(
        "/v1/chat/completions", {"x-llm-d-model-name-rewrite": "m-lora", "x-llm-d-inference-objective": "batch"},
        json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()))
    assert answer["request"] == {
        "model": "m", "target_model": "m-lora", "api": "chat/completions", "path": "/v1/chat/completions",
        "objective": "batch", "priority": -1, "fairness_id": "default-flow", "stream": False,
        "slo_ttft_ms": None, "slo_tpot_ms": None}


async def test_a_request_the_picker_cannot_parse_gets_its_400():
    harness = DirectorHarness(CONFIG)
    harness.set_pool(POOL)
    with pytest.raises(InferenceError) as err:
        await explain(harness.director, RequestParser(), ExplainInput("/v1/completions", {}, b'{"prompt": "x"}'))
    assert err.value.body == "inference error: BadRequest - model not found in request body"


@pytest.mark.parametrize("document, message", [
    ([], "must be a JSON object with a 'body'"),
    ({"path": "/v1/completions"}, "'body' must be the request body"),
    ({"body": {}, "bogus": 1}, r"unknown field\(s\) \['bogus'\]"),
    ({"body": {}, "path": "v1"}, "'path' must be a request path"),
    ({"body": {}, "headers": {"a": 1}}, "'headers' must be an object"),
    ({"body": {}, "subset": 3}, "'subset' must be a list"),
])
def test_the_explain_document_is_checked(document, message):
    with pytest.raises(ValueError, match=message):
        parse_explain_input(document)


def test_the_explain_document_takes_a_body_object_or_text_and_a_subset_string():
    given = parse_explain_input({"body": '{"model":"m"}', "headers": {"X-A": "1"}, "subset": "1.2.3.4:80, 5.6.7.8:80"})
    assert (given.body, given.headers, given.subset_hint, given.path) == (
        b'{"model":"m"}', {"x-a": "1"}, ("1.2.3.4:80", "5.6.7.8:80"), "/v1/completions")
    assert json.loads(parse_explain_input({"body": {"model": "m"}}).body) == {"model": "m"}


async def post_explain(port: int, document, raw: bytes | None = None) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as http:
        data = raw if raw is not None else json.dumps(document).encode()
        async with http.post(f"http://127.0.0.1:{port}/debug/explain", data=data) as resp:
            return resp.status, json.loads(await resp.text())


async def test_bad_explain_requests_get_clear_errors(monkeypatch):
    monkeypatch.setattr(debug_http, "MAX_EXPLAIN_BYTES", 200)
    server = await started(enable_debug_endpoint=True)
    try:
        assert await post_explain(server.metrics_port, None, b"not json") == (
            400, {"error": "bad explain request: Expecting value: line 1 column 1 (char 0)"})
        status, answer = await post_explain(server.metrics_port, {"body": {"model": "m", "prompt": "x" * 300}})
        assert status == 413 and "the limit is 200" in answer["error"]
        assert await post_explain(server.metrics_port, {"body": {"prompt": "x"}}) == (
            400, {"error": "inference error: BadRequest - model not found in request body"})
    finally:
        await server.stop(0)


class HeldProducer(DataProducer):
    """A producer that waits until the test lets it go (an explain in progress)."""

    type_name = "held-producer"

    def __init__(self) -> None:
        super().__init__()
        self.entered = asyncio.Event()
        self.release = asyncio.Event()

    async def prepare(self, state, request, endpoints):
        self.entered.set()
        await self.release.wait()


async def test_one_explain_at_a_time():
    producer = HeldProducer()
    server = await started(pipeline_of([producer]), enable_debug_endpoint=True)
    try:
        first = asyncio.create_task(post_explain(server.metrics_port, {"body": {"model": "m", "prompt": "a"}}))
        await wait_until(producer.entered.is_set, "the first explain to reach its producer")
        assert await post_explain(server.metrics_port, {"body": {"model": "m", "prompt": "b"}}) == (
            429, {"error": "another explain is running; try again"})
        producer.release.set()
        status, answer = await first
        assert status == 200 and answer["producers"][0]["outcome"] == "ok"
    finally:
        await server.stop(0)


async def test_the_cli_table_shows_scores_weights_totals_and_drops():
    config = endpoint_picker_config([plugin("by-label", label="pool", validValues=["blue"]), "queue-scorer",
                                     "kv-cache-utilization-scorer"],
                                    {"by-label": None, "queue-scorer": 2, "kv-cache-utilization-scorer": 1})
    harness = DirectorHarness(config)
    harness.set_pool([endpoint(0, queue=0, kv=0.5, labels={"pool": "blue"}), endpoint(1),
                      endpoint(2, queue=4, kv=0.0, labels={"pool": "blue"})])
    text = format_answer(await explained(harness, "hello"))
    assert text.splitlines()[4:10] == [
        "profile default (primary): picker max-score-picker picks 192.168.1.1:8000",
        "  endpoint            queue-scorer  kv-cache-utilization-scorer  total  dropped by",
        "  weight              2             1",
        "  192.168.1.1:8000 *  1.000         0.500                        2.500",
        "  192.168.1.3:8000    0.000         1.000                        1.000",
        "  192.168.1.2:8000    -             -                            -      by-label",
    ]
    assert text.endswith("the picker would route to: 192.168.1.1:8000\n")
