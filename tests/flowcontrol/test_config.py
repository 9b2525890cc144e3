"""The `flowControl` section and feature gate: GIE field names and defaults, strict errors, check-config."""

from __future__ import annotations

from pathlib import Path

import pytest

from epp.config.check import check_config_main
from epp.config.loader import load_config_text
from epp.flowcontrol.config import DEFAULT_BAND_MAX_BYTES, parse_quantity
from epp.flowcontrol.fairness import GlobalStrictFairnessPolicy, RoundRobinFairnessPolicy
from epp.flowcontrol.ordering import EDFOrderingPolicy, FCFSOrderingPolicy
from epp.flowcontrol.usage import StaticUsageLimitPolicy
from epp.framework.errors import ConfigError
from tests.support.configs import endpoint_picker_config

HEAD = endpoint_picker_config(["queue-scorer"])  # the flowControl sections the tests check follow as YAML
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "configs" / "flow-control.yaml"


def load(extra: str):
    return load_config_text(HEAD + extra, source="fc.yaml")


def test_off_by_default():
    assert load("").flow_control is None


def test_the_gate_alone_gives_gie_defaults():
    fc = load("featureGates: [flowControl]\n").flow_control
    assert (fc.max_bytes, fc.max_requests, fc.default_request_ttl, fc.bands) == (0, 0, 0.0, ())
    band = fc.band_for(7)
    assert (band.priority, band.max_bytes, band.max_requests) == (7, DEFAULT_BAND_MAX_BYTES, 0)
    assert isinstance(band.fairness, GlobalStrictFairnessPolicy) and isinstance(band.ordering, FCFSOrderingPolicy)
    assert isinstance(fc.usage_limit, StaticUsageLimitPolicy) and fc.usage_limit.threshold == 1.0


def test_a_section_without_the_gate_is_validated_but_not_used():
    loaded = load("flowControl: {maxRequests: 10}\n")
    assert loaded.flow_control is None and loaded.flow_control_section.max_requests == 10
    with pytest.raises(ConfigError, match=r"flowControl\.maxRequets: unknown field"):
        load("flowControl: {maxRequets: 10}\n")


def test_fields_bands_and_policy_refs():
    fc = load("""- name: rr
  type: round-robin-fairness-policy
- type: static-usage-limit-policy
  parameters: {threshold: 0.8, priorityThresholds: {-1: 0.5}}
featureGates: [flowControl]
flowControl:
  maxBytes: 2Gi
  maxRequests: "1k"
  defaultRequestTTL: 1m30s
  usageLimitPolicyPluginRef: static-usage-limit-policy
  defaultPriorityBand: {maxRequests: 7, orderingPolicyRef: edf-ordering-policy}
  priorityBands:
  - {priority: 100, maxBytes: 500M, fairnessPolicyRef: rr}
  - {priority: -1, maxRequests: 5}
""").flow_control
    assert (fc.max_bytes, fc.max_requests, fc.default_request_ttl) == (2 * 2**30, 1000, 90.0)
    assert fc.usage_limit.ceiling(100, 0.0) == 0.8 and fc.usage_limit.ceiling(-1, 0.0) == 0.5
    high, low, other = fc.band_for(100), fc.band_for(-1), fc.band_for(3)
    assert (high.max_bytes, high.max_requests, isinstance(high.fairness, RoundRobinFairnessPolicy)) == \
        (500_000_000, 0, True)
    assert high.fairness.name == "rr" and isinstance(high.ordering, FCFSOrderingPolicy)
    assert (low.max_bytes, low.max_requests) == (DEFAULT_BAND_MAX_BYTES, 5)
    assert (other.max_requests, isinstance(other.ordering, EDFOrderingPolicy)) == (7, True)


def test_a_band_has_its_own_request_ttl_else_the_global_one():
    fc = load("""featureGates: [flowControl]
flowControl:
  defaultRequestTTL: 60s
  defaultPriorityBand: {defaultRequestTTL: 20s}
  priorityBands:
  - {priority: -1, defaultRequestTTL: 9000s}
  - {priority: 5, defaultRequestTTL: 0}
  - {priority: 0}
""").flow_control
    assert (fc.ttl_for(-1), fc.ttl_for(5), fc.ttl_for(0), fc.ttl_for(3)) == (9000.0, 0.0, 60.0, 20.0)
    assert fc.band_for(0).request_ttl is None and fc.band_for(3).request_ttl == 20.0
    described = "\n".join(fc.describe())
    assert "band priority -1: maxBytes 1000000000, maxRequests unlimited; fairness global-strict-fairness-policy, " \
        "ordering fcfs-ordering-policy; defaultRequestTTL 9000s" in described
    assert "ordering fcfs-ordering-policy; defaultRequestTTL none" in described  # priority 5: no budget
    assert load("featureGates: [flowControl]\n").flow_control.ttl_for(0) == 0.0


@pytest.mark.parametrize("section, error", [
    ("{priorityBands: [{priority: 1, maxByte: 10}]}",
     "fc.yaml: flowControl.priorityBands[0].maxByte: unknown field; allowed fields: priority, maxBytes, "
     "maxRequests, fairnessPolicyRef, orderingPolicyRef, defaultRequestTTL"),
    ("{priorityBands: [{priority: 1, fairnessPolicyRef: fair-share}]}",
     "fc.yaml: flowControl.priorityBands[0].fairnessPolicyRef: unknown fairness policy 'fair-share'; allowed: "
     "a plugin of type global-strict-fairness-policy, round-robin-fairness-policy, program-aware-fairness, or one of those type names"),
    ("{priorityBands: [{priority: 1, orderingPolicyRef: queue-scorer}]}",
     "fc.yaml: flowControl.priorityBands[0].orderingPolicyRef: plugin 'queue-scorer' (type queue-scorer) is not "
     "an ordering policy; allowed types: fcfs-ordering-policy, edf-ordering-policy"),
    ("{priorityBands: [{maxBytes: 10}]}",
     "fc.yaml: flowControl.priorityBands[0].priority: is required and must be an integer, got None"),
    ("{priorityBands: [{priority: 1}, {priority: 1}]}",
     "fc.yaml: flowControl.priorityBands[1].priority: priority 1 has two bands; allowed: one per priority"),
    ("{defaultPriorityBand: {priority: 3}}",
     "fc.yaml: flowControl.defaultPriorityBand.priority: unknown field; allowed fields: maxBytes, maxRequests, "
     "fairnessPolicyRef, orderingPolicyRef, defaultRequestTTL"),
    ("{maxBytes: lots}",
     "fc.yaml: flowControl.maxBytes: must be a non-negative integer or a quantity such as 500M or 2Gi, got 'lots'"),
    ("{defaultRequestTTL: soon}", "fc.yaml: flowControl.defaultRequestTTL: 'soon' is not a duration"),
    ("{priorityBands: [{priority: 1, defaultRequestTTL: -5}]}",
     "fc.yaml: flowControl.priorityBands[0].defaultRequestTTL: must be a duration such as 30s, got -5"),
    ("{defaultPriorityBand: {defaultRequestTTL: later}}",
     "fc.yaml: flowControl.defaultPriorityBand.defaultRequestTTL: 'later' is not a duration"),
    ("{usageLimitPolicyPluginRef: fcfs-ordering-policy}",
     "fc.yaml: flowControl.usageLimitPolicyPluginRef: unknown usage limit policy 'fcfs-ordering-policy'"),
])
def test_errors_name_the_field_and_what_is_allowed(section, error):
    with pytest.raises(ConfigError) as info:
        load(f"featureGates: [flowControl]\nflowControl: {section}\n")
    assert str(info.value).startswith(error)


@pytest.mark.parametrize("value, expected", [
    (0, 0), (1000, 1000), ("1000", 1000), ("1k", 1000), ("500M", 500_000_000), ("1Gi", 2**30), ("1.5Ki", 1536),
])
def test_quantities(value, expected):
    assert parse_quantity(value, "x") == expected


def test_check_config_prints_the_example(capsys):
    assert check_config_main(str(EXAMPLE)) == 0
    out = capsys.readouterr().out
    assert "flow control: on" in out
    assert "band priority 100: maxBytes 500000000, maxRequests unlimited; fairness round-robin-fairness-policy" in out
    assert "defaultRequestTTL 30s" in out


def test_check_config_names_an_unknown_band_field(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text(EXAMPLE.read_text().replace("    maxBytes: 500M", "    maxBites: 500M"))
    assert check_config_main(str(path)) == 1
    assert f"{path}: flowControl.priorityBands[0].maxBites: unknown field" in capsys.readouterr().err
