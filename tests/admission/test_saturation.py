"""utilization-detector: the GIE saturation formula, its Filter behaviour and its parameters."""

from __future__ import annotations

import time

import pytest

from epp.framework.errors import ConfigError
from epp.framework.plugin import CycleState, PluginContext
from epp.framework.registry import PluginRegistry
from epp.framework.types import Endpoint, EndpointMetrics, InferenceRequest
from epp.scorers.saturation import UtilizationDetector, register

NOW = 1000.0
FRESH = NOW - 0.05  # scraped 50 ms ago
STALE = NOW - 0.5   # older than the default 200 ms threshold


def endpoint(i: int, q: int = 0, kv: float = 0.0, at: float = FRESH, healthy: bool = True) -> Endpoint:
    return Endpoint(f"10.0.0.{i}", 8000, metrics=EndpointMetrics(
        waiting_queue_size=q, kv_cache_usage=kv, update_time=at), healthy=healthy)


def request() -> InferenceRequest:
    return InferenceRequest("r1", "completions", "m", "m", {"prompt": "hi"})


@pytest.mark.parametrize("endpoints, expected", [
    ([], 1.0),                                              # no endpoints → saturated
    ([endpoint(1)], 0.0),                                   # idle
    ([endpoint(1, q=5)], 1.0),                              # queue at threshold
    ([endpoint(1, kv=0.8)], 1.0),                           # KV at threshold
    ([endpoint(1, q=2, kv=0.4)], 0.5),                      # max(2/5, 0.4/0.8) = 0.5
    ([endpoint(1, q=4, kv=0.4)], 0.8),                      # max(0.8, 0.5)
    ([endpoint(1, q=10)], 2.0),                             # not clamped
    ([endpoint(1, q=0), endpoint(2, q=5)], 0.5),            # mean over endpoints
    ([endpoint(1, q=0), endpoint(2, q=1, at=STALE)], 0.5),  # stale counts 1.0
    ([endpoint(1, q=0), endpoint(2, at=0.0)], 0.5),         # never scraped counts 1.0
    ([endpoint(1, q=0), endpoint(2, healthy=False)], 0.5),  # unhealthy counts 1.0
    ([endpoint(1, q=5), endpoint(2, kv=0.8), endpoint(3, q=2, kv=0.64)], 0.9333333333333332),
])
def test_saturation_formula(endpoints, expected):
    assert UtilizationDetector().saturation(endpoints, now=NOW) == pytest.approx(expected)


def test_custom_thresholds():
    detector = UtilizationDetector(queue_depth_threshold=10, kv_cache_util_threshold=0.5,
                                   metrics_staleness_threshold=1.0)
    assert detector.saturation([endpoint(1, q=5, kv=0.1, at=NOW - 0.5)], now=NOW) == pytest.approx(0.5)
    assert detector.saturation([endpoint(1, q=1, kv=0.4)], now=NOW) == pytest.approx(0.8)


def test_saturation_uses_the_monotonic_clock_by_default():
    fresh = Endpoint("10.0.0.1", 8000, metrics=EndpointMetrics(waiting_queue_size=1,
                                                               update_time=time.monotonic()))
    assert UtilizationDetector().saturation([fresh]) == pytest.approx(0.2)


def test_filter_keeps_unsaturated_fresh_endpoints(monkeypatch):
    monkeypatch.setattr(time, "monotonic", lambda: NOW)
    detector = UtilizationDetector()
    eps = [endpoint(1, q=4, kv=0.79), endpoint(2, q=5), endpoint(3, kv=0.8),
           endpoint(4, at=STALE), endpoint(5, healthy=False), endpoint(6)]
    kept = detector.filter(CycleState(), request(), eps)
    assert [ep.address for ep in kept] == ["10.0.0.1", "10.0.0.6"]


def test_filter_headroom_widens_the_limits(monkeypatch):
    monkeypatch.setattr(time, "monotonic", lambda: NOW)
    detector = UtilizationDetector(headroom=0.5)  # q < 7.5, kv < 1.2
    eps = [endpoint(1, q=7, kv=0.95), endpoint(2, q=8)]
    assert [ep.address for ep in detector.filter(CycleState(), request(), eps)] == ["10.0.0.1"]


def test_filter_fails_open_when_none_pass(monkeypatch):
    monkeypatch.setattr(time, "monotonic", lambda: NOW)
    eps = [endpoint(1, q=9), endpoint(2, kv=0.99)]
    assert UtilizationDetector().filter(CycleState(), request(), eps) == eps


def build(parameters):
    registry = PluginRegistry()
    register(registry)
    return registry.build("utilization-detector", "detector", parameters, PluginContext())


@pytest.mark.parametrize("parameters, attrs", [
    (None, (5.0, 0.8, 0.2, 0.0)),
    ({"queueDepthThreshold": 8, "kvCacheUtilThreshold": 0.9, "metricsStalenessThreshold": "1s",
      "headroom": 0.2}, (8.0, 0.9, 1.0, 0.2)),
    ({"metricsStalenessThreshold": "200ms"}, (5.0, 0.8, 0.2, 0.0)),
    ({"metricsStalenessThreshold": 0.5}, (5.0, 0.8, 0.5, 0.0)),
    ({"metricsStalenessThreshold": 2}, (5.0, 0.8, 2.0, 0.0)),
])
def test_parameters(parameters, attrs):
    detector = build(parameters)
    assert detector.type_name == "utilization-detector" and detector.name == "detector"
    assert (detector.queue_depth_threshold, detector.kv_cache_util_threshold,
            detector.metrics_staleness_threshold, detector.headroom) == attrs


@pytest.mark.parametrize("parameters, message", [
    ({"queueDepthThreshold": 0}, "'queueDepthThreshold' must be > 0"),
    ({"kvCacheUtilThreshold": 1.5}, "'kvCacheUtilThreshold' must be in (0, 1]"),
    ({"metricsStalenessThreshold": "soon"},
     "plugin 'detector': parameter 'metricsStalenessThreshold': 'soon' is not a duration"),
    ({"metricsStalenessThreshold": "0"}, "'metricsStalenessThreshold' must be > 0"),
    ({"metricsStalenessThreshold": True}, "'metricsStalenessThreshold' must be a duration such as 30s"),
    ({"headroom": -1}, "'headroom' must be >= 0"),
    ({"queueDepthThreshold": "5"}, "'queueDepthThreshold' must be a number"),
    ({"threshold": 5}, "unknown parameter(s) ['threshold']"),
])
def test_bad_parameters_are_named(parameters, message):
    with pytest.raises(ConfigError) as info:
        build(parameters)
    assert message in str(info.value)
