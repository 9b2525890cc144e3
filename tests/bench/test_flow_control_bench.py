"""The flow-control benchmark's statistics: max-min fair shares and Jain's index, and its picker config."""

from __future__ import annotations

import pytest

from bench.routing.flow_control import FlowBench, jain, max_min_shares, nominal_capacity
from epp.config.loader import load_config_text


@pytest.mark.parametrize("demand, capacity, expected", [
    ({"a": 70, "b": 10, "c": 10, "d": 10}, 50, {"a": 20, "b": 10, "c": 10, "d": 10}),  # small tenants fully served
    ({"a": 70, "b": 10, "c": 10, "d": 10}, 20, {"a": 5, "b": 5, "c": 5, "d": 5}),      # everyone over an equal split
    ({"a": 70, "b": 10, "c": 10, "d": 10}, 100, {"a": 70, "b": 10, "c": 10, "d": 10}),  # no contention
])
def test_max_min_shares(demand, capacity, expected):
    assert max_min_shares(demand, capacity) == pytest.approx(expected)


@pytest.mark.parametrize("values, expected", [
    ([1, 1, 1, 1], 1.0), ([1, 0, 0, 0], 0.25), ([1.75, 0.5, 0.5, 0.5], 3.25 ** 2 / (4 * 3.8125)), ([], None),
])
def test_jain(values, expected):
    assert jain(values) == (pytest.approx(expected) if expected is not None else None)


@pytest.mark.parametrize("flow_control", [False, True])
def test_the_picker_config_loads(flow_control):
    loaded = load_config_text(FlowBench().epp_config(flow_control))
    assert (loaded.flow_control is not None) == flow_control
    assert loaded.flow_control_section.default_request_ttl == 15.0


def test_nominal_capacity_is_slots_over_service_time():
    bench = FlowBench()
    assert 3.0 < nominal_capacity(bench) < 4.0
    assert nominal_capacity(FlowBench(replicas=8)) == pytest.approx(2 * nominal_capacity(bench))
