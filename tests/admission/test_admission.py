"""Legacy admission: only sheddable requests (priority < 0) are dropped, and only when saturated."""

from __future__ import annotations

import time

import pytest
from prometheus_client import CollectorRegistry

from epp.admission import SHED_MESSAGE, AdmissionController
from epp.datalayer.registry import EndpointRegistry, EndpointSpec
from epp.framework.errors import ErrorCode, InferenceError
from epp.framework.types import ApiKind, Endpoint, EndpointMetrics, InferenceRequest
from epp.scorers.saturation import UtilizationDetector


def endpoints(*queues: int) -> list[Endpoint]:
    now = time.monotonic()
    return [Endpoint(f"10.0.0.{i}", 8000, metrics=EndpointMetrics(waiting_queue_size=q, update_time=now))
            for i, q in enumerate(queues, 1)]


def request(priority: int) -> InferenceRequest:
    return InferenceRequest("r", ApiKind.COMPLETIONS, "m", "m", {"prompt": "x"}, priority=priority)


@pytest.mark.parametrize("priority, queues, shed", [
    (-1, (5, 5), True),     # sheddable, saturation 1.0 → 429
    (-1, (10, 0), True),    # mean(2.0, 0.0) = 1.0
    (-1, (4, 5), False),    # 0.9 < 1.0
    (-5, (), True),         # no candidates count as saturated
    (0, (5, 5), False),     # default priority is never shed
    (0, (), False),
    (3, (50, 50), False),   # critical
])
def test_sheds_only_sheddable_requests_when_saturated(priority, queues, shed):
    metrics = CollectorRegistry()
    controller = AdmissionController(UtilizationDetector(), metrics_registry=metrics)
    if shed:
        with pytest.raises(InferenceError) as info:
            controller.admit(request(priority), endpoints(*queues))
        assert info.value.code is ErrorCode.RESOURCE_EXHAUSTED
        assert info.value.code.http_status == 429
        assert info.value.message == SHED_MESSAGE
    else:
        controller.admit(request(priority), endpoints(*queues))
    assert metrics.get_sample_value("epp_admission_shed_requests_total") == (1.0 if shed else 0.0)


def test_saturation_gauge_from_the_last_sheddable_request():
    metrics = CollectorRegistry()
    controller = AdmissionController(UtilizationDetector(), metrics_registry=metrics)
    controller.admit(request(-1), endpoints(2, 3))
    assert metrics.get_sample_value("epp_pool_saturation") == pytest.approx(0.5)


def test_saturation_gauge_follows_the_pool_when_given():
    pool = EndpointRegistry()
    pool.set_endpoints([EndpointSpec("10.0.0.1", 8000), EndpointSpec("10.0.0.2", 8000)])
    metrics = CollectorRegistry()
    AdmissionController(UtilizationDetector(), metrics_registry=metrics, pool=pool)
    assert metrics.get_sample_value("epp_pool_saturation") == 1.0  # never scraped
    now = time.monotonic()
    pool.update("10.0.0.1:8000", metrics=EndpointMetrics(kv_cache_usage=0.4, update_time=now))
    pool.update("10.0.0.2:8000", metrics=EndpointMetrics(waiting_queue_size=0, update_time=now))
    assert metrics.get_sample_value("epp_pool_saturation") == pytest.approx(0.25)


def test_any_detector_works():
    class Always:
        def saturation(self, endpoints):
            return 1.0

    with pytest.raises(InferenceError):
        AdmissionController(Always()).admit(request(-1), [])
