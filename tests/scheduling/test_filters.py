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


def test_label_selector_needs_every_pair():
    flt = make_plugin("label-selector-filter", {"matchLabels": {ROLE: "other", "tier": "gold"}})
    assert kept(flt, POOL) == [POOL[4].name]
    flt = make_plugin("label-selector-filter", {"matchLabels": {ROLE: "decode", "tier": "gold"}})
    assert kept(flt, POOL) == []


@pytest.mark.parametrize("expressions, expected", [
    ([{"key": ROLE, "operator": "In", "values": ["prefill", "decode"]}], [0, 1]),
    ([{"key": ROLE, "operator": "NotIn", "values": ["prefill", "decode"]}], [2, 3, 4]),  # no label: not in
    ([{"key": "tier", "operator": "Exists"}], [4]),
    ([{"key": ROLE, "operator": "DoesNotExist"}], [3]),
    ([{"key": ROLE, "operator": "Exists"}, {"key": ROLE, "operator": "NotIn", "values": ["other"]}], [0, 1, 2]),
])
def test_label_selector_match_expressions_as_kubernetes_reads_them(expressions, expected):
    flt = make_plugin("label-selector-filter", {"matchExpressions": expressions})
    assert kept(flt, POOL) == [POOL[i].name for i in expected]


@pytest.mark.parametrize("params, message", [
    ({}, "'matchLabels' or 'matchExpressions' is required"),
    ({"matchExpressions": [{"key": "a", "operator": "Near"}]}, r"'matchExpressions\[0\]': 'operator' must be one of"),
    ({"matchExpressions": [{"key": "a", "operator": "In"}]}, "operator In needs at least one value"),
    ({"matchExpressions": [{"key": "a", "operator": "Exists", "values": ["x"]}]}, "operator Exists takes no values"),
    ({"matchExpressions": [{"key": "a", "operator": "In", "values": ["x"], "valuez": 1}]}, "must be a mapping with "
     "fields key, operator, values"),
    ({"matchLabels": {"a": 1}}, "must map strings to strings"),
])
def test_label_selector_parameters(params, message):
    with pytest.raises(ConfigError, match=message):
        make_plugin("label-selector-filter", params)


def test_decode_and_prefill_filters_use_the_role_label():
    assert kept(make_plugin("decode-filter"), POOL) == [POOL[i].name for i in (1, 2, 3)]
    assert kept(make_plugin("prefill-filter"), POOL) == [POOL[i].name for i in (0, 2)]


def test_role_filters_take_llm_d_combined_roles():
    roles = ["prefill-decode", "encode-prefill", "encode-prefill-decode", "encode"]
    pool = [endpoint(i, labels={ROLE: role}) for i, role in enumerate(roles)]
    assert kept(make_plugin("decode-filter"), pool) == [pool[0].name, pool[2].name]
    assert kept(make_plugin("prefill-filter"), pool) == [pool[0].name, pool[1].name, pool[2].name]


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
