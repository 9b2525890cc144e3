"""One request's lifecycle and its accounting (`RequestLifecycle` over a `Director`), driven without the ext_proc transport."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest

import epp.requestcontrol.director as director_module
from epp.datalayer.registry import EndpointRegistry, parse_endpoint_list
from epp.framework.errors import ErrorCode, InferenceError
from epp.framework.plugin import DataProducer
from epp.framework.types import InferenceRequest
from epp.metrics import EppMetrics
from epp.requestcontrol.director import Director
from epp.requestcontrol.lifecycle import RequestAccounting, RequestLifecycle
from tests.support.extproc import simple_pipeline


def _director(endpoints: str = "10.0.0.1:8000,10.0.0.2:8000") -> Director:
    registry = EndpointRegistry()
    if endpoints:
        registry.set_endpoints(parse_endpoint_list(endpoints))
    return Director(simple_pipeline(), registry, EppMetrics())


def _open(director: Director) -> RequestLifecycle:
    return RequestLifecycle(director, RequestAccounting(director.metrics))


def _request(model: str = "m", target: str = "m-v2", priority: int = 0) -> InferenceRequest:
    return InferenceRequest(request_id="r1", api="completions", model=model, target_model=target,
                            body={"model": model, "prompt": "hello"}, headers={}, priority=priority)


def _value(director: Director, name: str, **labels: str) -> float:
    value = director.metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


async def test_a_routed_request_is_counted_once_and_leaves_no_request_running():
    director = _director()
    life = _open(director)
    result = await life.schedule(_request(priority=2), size_bytes=512)
    assert life.target is result.targets[0]
    labels = {"model_name": "m", "target_model_name": "m-v2"}
    assert _value(director, "inference_objective_request_total", priority="2", **labels) == 1
    assert _value(director, "inference_objective_request_sizes_sum", **labels) == 512
    assert _value(director, "inference_objective_running_requests", model_name="m") == 1
    life.response.usage = {"prompt_tokens": 900, "completion_tokens": 7,
                           "prompt_tokens_details": {"cached_tokens": 640}}
    life.complete()
    life.complete(aborted=True)  # the stream's own end after the response: nothing counted twice
    assert _value(director, "inference_objective_running_requests", model_name="m") == 0
    assert _value(director, "inference_objective_request_duration_seconds_count", **labels) == 1
    assert _value(director, "inference_objective_input_tokens_sum", **labels) == 900
    assert _value(director, "inference_objective_output_tokens_sum", **labels) == 7
    assert _value(director, "inference_objective_prompt_cached_tokens_sum", **labels) == 640


async def test_an_aborted_stream_ends_the_request_without_a_duration():
    director = _director()
    life = _open(director)
    await life.schedule(_request(), size_bytes=10)
    life.complete(aborted=True)
    labels = {"model_name": "m", "target_model_name": "m-v2"}
    assert _value(director, "inference_objective_running_requests", model_name="m") == 0
    assert _value(director, "inference_objective_request_duration_seconds_count", **labels) == 0


async def test_a_request_that_cannot_be_scheduled_is_counted_as_an_error_and_never_running():
    director = _director(endpoints="")
    life = _open(director)
    with pytest.raises(InferenceError) as err:
        await life.schedule(_request(), size_bytes=10)
    life.failed(err.value.code)
    life.complete(aborted=True)
    labels = {"model_name": "m", "target_model_name": "m-v2"}
    assert _value(director, "inference_objective_request_total", priority="0", **labels) == 1
    assert _value(director, "inference_objective_request_error_total", error_code=err.value.code.label,
                  **labels) == 1
    assert _value(director, "inference_objective_running_requests", model_name="m") == 0
    assert not life.scheduled


async def test_implausible_token_counts_are_not_observed():
    director = _director()
    life = _open(director)
    await life.schedule(_request(), size_bytes=10)
    life.response.usage = {"prompt_tokens": True, "completion_tokens": -3, "prompt_tokens_details": "x"}
    life.complete()
    labels = {"model_name": "m", "target_model_name": "m-v2"}
    assert _value(director, "inference_objective_input_tokens_count", **labels) == 0
    assert _value(director, "inference_objective_output_tokens_count", **labels) == 0
    assert _value(director, "inference_objective_request_duration_seconds_count", **labels) == 1


def test_a_request_failed_before_parsing_is_counted_without_model_labels():
    director = _director()
    life = _open(director)
    life.failed(ErrorCode.BAD_REQUEST)
    assert _value(director, "inference_objective_request_error_total", model_name="", target_model_name="",
                  error_code=ErrorCode.BAD_REQUEST.label) == 1


class _Producer(DataProducer):
    """Writes its name into the cycle after `delay_s` (0: without ever suspending)."""

    type_name = "test-producer"

    def __init__(self, name: str, delay_s: float) -> None:
        super().__init__(name)
        self.delay_s = delay_s
        self.cancelled = False

    async def prepare(self, state, request, endpoints) -> None:
        if self.delay_s:
            try:
                await asyncio.sleep(self.delay_s)
            except asyncio.CancelledError:
                self.cancelled = True
                raise
        state.put(self.name, True)


async def test_a_producer_past_the_deadline_is_cut_off_and_the_request_still_scheduled(monkeypatch):
    monkeypatch.setattr(director_module, "PREPARE_DATA_TIMEOUT_S", 0.2)
    fast, slow, late = _Producer("fast", 0), _Producer("slow", 30), _Producer("late", 0)
    pipeline = dataclasses.replace(simple_pipeline(), data_producers=(fast, slow, late))
    registry = EndpointRegistry()
    registry.set_endpoints(parse_endpoint_list("10.0.0.1:8000"))
    life = _open(Director(pipeline, registry, EppMetrics()))
    started = time.monotonic()
    result = await life.schedule(_request(), size_bytes=10)
    assert time.monotonic() - started < 5  # cut off at the deadline, not after the producer's 30 s
    assert result.targets[0].hostport == "10.0.0.1:8000"
    assert slow.cancelled and life.state.get("fast") and not life.state.get("slow")
    assert not life.state.get("late")  # no time left after the slow one: skipped
