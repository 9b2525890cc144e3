"""Control headers: llm-d's `x-llm-d-*` names, the older `x-gateway-*` / `x-slo-*` aliases, and SLO values."""

from __future__ import annotations

import json

import pytest

from epp.framework.errors import ErrorCode, InferenceError
from epp.request.parsing import RequestParser

BODY = json.dumps({"model": "m", "prompt": "hello"}).encode()


def parse(headers: dict[str, str], priorities: dict[str, int] | None = None):
    request, forwarded = RequestParser(priorities).parse(request_id="r", headers={":path": "/v1/completions", **headers},
                                                         body=BODY, subset_hint=None)
    return request, json.loads(forwarded)


@pytest.mark.parametrize("prefix", ["x-llm-d-", "x-gateway-"])
def test_objective_fairness_and_rewrite_are_read_under_either_name(prefix):
    request, forwarded = parse({f"{prefix}inference-objective": "critical", f"{prefix}inference-fairness-id": "t1",
                                f"{prefix}model-name-rewrite": "m-v2"}, {"critical": 5})
    assert (request.objective, request.priority, request.fairness_id) == ("critical", 5, "t1")
    assert request.target_model == forwarded["model"] == "m-v2"


def test_the_llm_d_name_wins_over_its_alias():
    request, _ = parse({"x-llm-d-inference-fairness-id": "new", "x-gateway-inference-fairness-id": "old",
                        "x-llm-d-slo-ttft-ms": "250", "x-slo-ttft-ms": "900"})
    assert request.fairness_id == "new"
    assert request.slo_ttft_ms == 250


def test_slo_headers_become_objectives_in_milliseconds():
    request, _ = parse({"x-slo-ttft-ms": "1500", "x-llm-d-slo-tpot-ms": "42.5"})
    assert (request.slo_ttft_ms, request.slo_tpot_ms) == (1500.0, 42.5)
    plain, _ = parse({})
    assert (plain.slo_ttft_ms, plain.slo_tpot_ms, plain.fairness_id) == (None, None, "default-flow")


@pytest.mark.parametrize("value", ["abc", "0", "-5", "nan", "inf", "1e12"])
def test_a_malformed_slo_header_is_a_bad_request_that_names_the_header(value):
    with pytest.raises(InferenceError) as err:
        parse({"x-llm-d-slo-ttft-ms": value})
    assert err.value.code is ErrorCode.BAD_REQUEST
    assert "x-llm-d-slo-ttft-ms" in str(err.value)
