"""GIE's default admission (the saturation admitter): only sheddable requests (priority < 0) are
dropped, only when saturated, and only without flow control."""

from __future__ import annotations

import time

import pytest
from prometheus_client import CollectorRegistry

from epp.config import load_config_text
from epp.datalayer.registry import EndpointRegistry, EndpointSpec
from epp.framework import (
    ConfigError,
    CycleState,
    DataProducer,
    Endpoint,
    EndpointMetrics,
    ErrorCode,
    InferenceError,
    InferenceRequest,
    PluginContext,
    PluginRegistry,
    SaturationDetector,
)
from epp.metrics import EppMetrics
from epp.requestcontrol.admission import SHED_MESSAGE, SaturationAdmitter
from epp.requestcontrol.director import Director
from epp.scorers import register_builtin_plugins
from epp.scorers.saturation import UtilizationDetector
from tests.support.configs import endpoint_picker_config


def endpoints(*queues: int) -> list[Endpoint]:
    now = time.monotonic()
    return [Endpoint(f"10.0.0.{i}", 8000, metrics=EndpointMetrics(waiting_queue_size=q, update_time=now))
            for i, q in enumerate(queues, 1)]


def request(priority: int) -> InferenceRequest:
    return InferenceRequest("r", "completions", "m", "m", {"prompt": "x"}, priority=priority)


def admitter(detector: SaturationDetector, **context) -> SaturationAdmitter:
    return SaturationAdmitter("saturation-admitter", detector, PluginContext(**context))


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
    shedder = admitter(UtilizationDetector(), metrics_registry=metrics)
    if shed:
        with pytest.raises(InferenceError) as info:
            shedder.admit(CycleState(), request(priority), endpoints(*queues))
        assert info.value.code is ErrorCode.RESOURCE_EXHAUSTED
        assert info.value.code.http_status == 429
        assert info.value.message == SHED_MESSAGE
    else:
        shedder.admit(CycleState(), request(priority), endpoints(*queues))
    assert metrics.get_sample_value("epp_admission_shed_requests_total") == (1.0 if shed else 0.0)


def test_saturation_gauge_from_the_last_sheddable_request():
    metrics = CollectorRegistry()
    admitter(UtilizationDetector(), metrics_registry=metrics).admit(CycleState(), request(-1), endpoints(2, 3))
    assert metrics.get_sample_value("epp_pool_saturation") == pytest.approx(0.5)


def test_saturation_gauge_follows_the_pool_of_the_context():
    pool = EndpointRegistry()
    pool.set_endpoints([EndpointSpec("10.0.0.1", 8000), EndpointSpec("10.0.0.2", 8000)])
    metrics = CollectorRegistry()
    admitter(UtilizationDetector(), metrics_registry=metrics, endpoints=pool)
    assert metrics.get_sample_value("epp_pool_saturation") == 1.0  # never scraped
    now = time.monotonic()
    pool.update("10.0.0.1:8000", metrics=EndpointMetrics(kv_cache_usage=0.4, update_time=now))
    pool.update("10.0.0.2:8000", metrics=EndpointMetrics(waiting_queue_size=0, update_time=now))
    assert metrics.get_sample_value("epp_pool_saturation") == pytest.approx(0.25)


def test_any_detector_works():
    class Always(SaturationDetector):
        type_name = "always-saturated"

        def saturation(self, endpoints):
            return 1.0

    with pytest.raises(InferenceError):
        admitter(Always()).admit(CycleState(), request(-1), [])


def test_the_loader_adds_the_admitter_for_the_saturation_detector_unless_flow_control_queues():
    shedding = load_config_text(endpoint_picker_config(["queue-scorer"]))
    [shedder] = shedding.admitters
    assert isinstance(shedder, SaturationAdmitter) and shedder.detector is shedding.saturation_detector
    assert not shedder.consumes()  # so the director runs it before the data producers
    queueing = load_config_text(endpoint_picker_config(["queue-scorer"], featureGates=["flowControl"]))
    assert queueing.admitters == () and queueing.saturation_detector is not None


def test_a_saturation_detector_reference_must_be_a_detector():
    with pytest.raises(ConfigError, match=r"saturationDetector.pluginRef: plugin 'queue-scorer' .* is no saturation"):
        load_config_text(endpoint_picker_config(["queue-scorer"], saturationDetector={"pluginRef": "queue-scorer"}))


class CountingProducer(DataProducer):
    """Counts the requests it prepared data for."""

    type_name = "counting-producer"
    prepared = 0

    def produces(self):
        return frozenset({"counted"})

    async def prepare(self, state, request, endpoints):
        type(self).prepared += 1


async def test_the_director_sheds_before_the_data_producers_run():
    registry = PluginRegistry()
    register_builtin_plugins(registry)
    registry.register_class(CountingProducer)
    pool = EndpointRegistry()
    pool.set_endpoints([EndpointSpec("10.0.0.1", 8000)])  # never scraped: saturation 1.0
    metrics = EppMetrics()
    pipeline = load_config_text(endpoint_picker_config(["counting-producer", "queue-scorer"]), registry=registry,
                                context=PluginContext(metrics_registry=metrics.registry, endpoints=pool))
    director = Director(pipeline, pool, metrics)
    CountingProducer.prepared = 0
    with pytest.raises(InferenceError) as info:
        await director.schedule(CycleState(), request(-1))
    assert info.value.message == SHED_MESSAGE and CountingProducer.prepared == 0
    assert metrics.registry.get_sample_value("epp_admission_shed_requests_total") == 1.0
    result = await director.schedule(CycleState(), request(0))  # not sheddable: scheduled, data prepared
    assert result.targets[0].name == "10.0.0.1:8000" and CountingProducer.prepared == 1
