"""The picker's error answers: JSON bodies in OpenAI's or Anthropic's shape, and llm-d's drop reasons."""

from __future__ import annotations

import json

import pytest

from epp.framework import DropReason, ErrorCode, InferenceError, openai_error_body
from epp.request.parsing import RequestParser
from epp.scorers.parsers.anthropic import AnthropicParser
from epp.server.messages import error_response
from tests.support.extproc import headers_of

PARSERS = RequestParser()


def error_body(err: InferenceError, *, anthropic: bool = False) -> bytes:
    return AnthropicParser().error_body(err) if anthropic else openai_error_body(err)


@pytest.mark.parametrize("code, drop_reason", [
    (ErrorCode.RESOURCE_EXHAUSTED, "rejected-saturated"),
    (ErrorCode.SERVICE_UNAVAILABLE, "rejected-no-endpoints"),
    (ErrorCode.BAD_REQUEST, None), (ErrorCode.INTERNAL, None), (ErrorCode.PAYLOAD_TOO_LARGE, None),
])
def test_a_429_or_503_without_a_reason_gets_its_codes_default(code, drop_reason):
    assert InferenceError(code, "x").drop_reason == drop_reason


def test_a_raisers_reason_wins_and_must_be_an_llm_d_word():
    err = InferenceError(ErrorCode.SERVICE_UNAVAILABLE, "request timed out in queue",
                         drop_reason=DropReason.TTL_EXPIRED)
    assert err.drop_reason == "rejected-ttl-expired"
    assert InferenceError(ErrorCode.RESOURCE_EXHAUSTED, "x", drop_reason="rejected-slo-headroom").drop_reason == \
        "rejected-slo-headroom"
    assert InferenceError(ErrorCode.RESOURCE_EXHAUSTED, "x", drop_reason="evicted").drop_reason == "evicted"
    for word in ("saturated", "rejected saturated", "Rejected-Saturated", "rejected-\nx", ""):
        with pytest.raises(ValueError, match="is not of llm-d's form"):
            InferenceError(ErrorCode.RESOURCE_EXHAUSTED, "x", drop_reason=word)


@pytest.mark.parametrize("code, openai_type, anthropic_type", [
    (ErrorCode.BAD_REQUEST, "invalid_request_error", "invalid_request_error"),
    (ErrorCode.NOT_FOUND, "not_found_error", "not_found_error"),
    (ErrorCode.REQUEST_TIMEOUT, "timeout_error", "timeout_error"),
    (ErrorCode.PAYLOAD_TOO_LARGE, "invalid_request_error", "request_too_large"),
    (ErrorCode.HEADERS_TOO_LARGE, "invalid_request_error", "invalid_request_error"),
    (ErrorCode.RESOURCE_EXHAUSTED, "rate_limit_error", "rate_limit_error"),
    (ErrorCode.INTERNAL, "server_error", "api_error"),
    (ErrorCode.SERVICE_UNAVAILABLE, "service_unavailable_error", "overloaded_error"),
])
def test_every_code_has_a_type_in_both_shapes(code, openai_type, anthropic_type):
    err = InferenceError(code, "what happened: é")
    text = f"inference error: {code.label} - what happened: é"
    assert json.loads(error_body(err)) == {"error": {"message": text, "type": openai_type, "param": None,
                                                     "code": code.label}}
    assert json.loads(error_body(err, anthropic=True)) == {"type": "error", "error": {"type": anthropic_type,
                                                                                     "message": text}}


def test_a_message_with_a_lone_surrogate_still_makes_a_body():
    body = error_body(InferenceError(ErrorCode.BAD_REQUEST, "bad \ud800 text"))
    assert json.loads(body)["error"]["message"].startswith("inference error: BadRequest - bad ")


@pytest.mark.parametrize("path, anthropic", [
    ("/v1/messages", True), ("/v1/messages/", True), ("/v1/messages?beta=true", True),
    ("/v1/messages/count_tokens", True), ("/v1/chat/completions", False), ("/v1/messages/batches", False),
    ("/inference/v1/generate", False), ("/v1/score", False), (None, False), ("", False),
])
def test_the_anthropic_shape_is_for_the_messages_api(path, anthropic):
    err = InferenceError(ErrorCode.BAD_REQUEST, "no")
    assert PARSERS.error_body(err, path) == error_body(err, anthropic=anthropic)


def test_an_error_about_a_field_names_it_in_openais_shape():
    err = InferenceError(ErrorCode.NOT_FOUND, "gone", param="previous_response_id")
    assert json.loads(PARSERS.error_body(err, "/v1/responses"))["error"]["param"] == "previous_response_id"


def test_the_reply_carries_status_json_and_the_drop_reason():
    reply = error_response(InferenceError(ErrorCode.SERVICE_UNAVAILABLE, "request timed out in queue",
                                          drop_reason=DropReason.TTL_EXPIRED)).immediate_response
    assert reply.status.code == 503
    assert headers_of(reply.headers) == {"content-type": "application/json",
                                         "x-llm-d-request-dropped-reason": "rejected-ttl-expired"}
    err = InferenceError(ErrorCode.BAD_REQUEST, "no")
    reply = error_response(err, PARSERS.error_body(err, "/v1/messages")).immediate_response
    assert headers_of(reply.headers) == {"content-type": "application/json"}
    assert json.loads(reply.body)["type"] == "error"
