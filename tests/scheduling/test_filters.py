"""Label filters, the P/D role filters and the conformance test plugins."""

import pytest

from epp.framework import ConfigError, CycleState, ResponseInfo
from tests.support.scheduling import endpoint, make_plugin, request


def kept(flt, endpoints, req=None):
    return [ep.name for ep in flt.filter(CycleState(), req or request(), endpoints)]


ROLE = "llm-d.ai/role"
POOL = [endpoint(0, labels={ROLE: "prefill"}), endpoint(1, labels={ROLE: "decode"}),
        endpoint(2, labels={ROLE: "both"}), endpoint(3), endpoint(4, labels={ROLE: "other", "tier": "gold"})]


@pytest.mark.parametrize("params, expected", [
    ({"label": ROLE, "validValues": ["decode"]}, [1]),
    ({"label": ROLE, "validValues": ["decode", "both"], "allowsNoLabel": True}, [1, 2, 3]),
    ({"label": "tier", "validValues": ["gold"]}, [4]),
    ({"label": "missing", "allowsNoLabel": True}, [0, 1, 2, 3, 4]),
])
def test_by_label(params, expected):
    assert kept(make_plugin("by-label", params), POOL) == [POOL[i].name for i in expected]


@pytest.mark.parametrize("params, message", [
    ({}, "parameter 'label' is required"),
    ({"label": "x"}, "'validValues' must list at least one value unless 'allowsNoLabel' is true"),
    ({"label": "x", "validValues": [1]}, "'validValues' must be a list of strings"),
    ({"label": "x", "validValues": ["a"], "extra": 1}, r"unknown parameter\(s\) \['extra'\]"),
])
def test_by_label_parameters(params, message):
    with pytest.raises(ConfigError, match=message):
        make_plugin("by-label", params)


def test_by_label_selector_needs_every_pair():
    flt = make_plugin("by-label-selector", {"matchLabels": {ROLE: "other", "tier": "gold"}})
    assert kept(flt, POOL) == [POOL[4].name]
    flt = make_plugin("by-label-selector", {"matchLabels": {ROLE: "decode", "tier": "gold"}})
    assert kept(flt, POOL) == []


@pytest.mark.parametrize("params, message", [
    ({}, "'matchLabels' is required"),
    ({"matchLabels": {"a": "b"}, "matchExpressions": [{"key": "a"}]}, "'matchExpressions' is not supported"),
    ({"matchLabels": {"a": 1}}, "must map strings to strings"),
])
def test_by_label_selector_parameters(params, message):
    with pytest.raises(ConfigError, match=message):
        make_plugin("by-label-selector", params)


def test_decode_and_prefill_filters_use_the_role_label():
    assert kept(make_plugin("decode-filter"), POOL) == [POOL[i].name for i in (1, 2, 3)]
    assert kept(make_plugin("prefill-filter"), POOL) == [POOL[0].name]


@pytest.mark.parametrize("header, expected", [
    ("192.168.1.3,192.168.1.1", ["192.168.1.3:8000", "192.168.1.1:8000"]),        # order kept
    ("192.168.1.2:8000, 192.168.1.2", ["192.168.1.2:8000"]),                      # deduplicated
    ("192.168.1.2:9000", []),                                                     # wrong port
    ("192.168.1.9", []),
    ("", []),
])
def test_header_based_testing_filter(header, expected):
    pool = [endpoint(0), endpoint(1), endpoint(2)]
    req = request(headers={"test-epp-endpoint-selection": header})
    assert kept(make_plugin("header-based-testing-filter"), pool, req) == expected


def test_header_based_testing_filter_matches_every_port_of_a_bare_ip():
    pool = [endpoint(0, port=8000), endpoint(0, port=8001), endpoint(1)]
    req = request(headers={"test-epp-endpoint-selection": "192.168.1.1"})
    assert kept(make_plugin("header-based-testing-filter"), pool, req) == ["192.168.1.1:8000", "192.168.1.1:8001"]


@pytest.mark.parametrize("served, header", [
    ("10.0.0.7:8000", "10.0.0.7:8000"),
    (None, "fail: missing envoy lb metadata"),
])
def test_destination_endpoint_served_verifier(served, header):
    hook = make_plugin("destination-endpoint-served-verifier")
    response = ResponseInfo(status="200", served_endpoint=served)
    hook.on_response_headers(CycleState(), request(), response, endpoint(0))
    assert response.set_headers == {"x-conformance-test-served-endpoint": header}
