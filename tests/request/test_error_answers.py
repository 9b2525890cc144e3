"""The picker's error answers: JSON bodies in OpenAI's or Anthropic's shape, and llm-d's drop reasons."""

from __future__ import annotations

import json

import pytest

from epp.framework import DropReason, ErrorCode, InferenceError
from epp.request.error_body import error_body, is_anthropic_path
from epp.server.messages import error_response
from tests.support.extproc import headers_of


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
    (None, False), ("", False),
])
def test_the_anthropic_shape_is_for_the_messages_api(path, anthropic):
    assert is_anthropic_path(path) is anthropic


def test_the_reply_carries_status_json_and_the_drop_reason():
    reply = error_response(InferenceError(ErrorCode.SERVICE_UNAVAILABLE, "request timed out in queue",
                                          drop_reason=DropReason.TTL_EXPIRED), "/v1/completions").immediate_response
    assert reply.status.code == 503
    assert headers_of(reply.headers) == {"content-type": "application/json",
                                         "x-llm-d-request-dropped-reason": "rejected-ttl-expired"}
    reply = error_response(InferenceError(ErrorCode.BAD_REQUEST, "no"), "/v1/messages").immediate_response
    assert headers_of(reply.headers) == {"content-type": "application/json"}
    assert json.loads(reply.body)["type"] == "error"
