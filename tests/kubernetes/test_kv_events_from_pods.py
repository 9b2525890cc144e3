"""KV-event ports announced on pods reach the KV-event subscriber; a pod leaving drops its index entries."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from bench.support.k8s_apiserver import inference_pool, pod
from epp.datalayer.kubernetes import KubernetesDiscovery
from epp.datalayer.registry import EndpointRegistry
from epp.kvevents.index import KVBlockIndex
from epp.kvevents.metrics import KVIndexMetrics, KVSubscriberMetrics
from epp.kvevents.subscriber import KVEventSubscriber, SubscriberConfig
from tests.kvevents.publisher import FakePublisher
from tests.kvevents.test_subscriber import BS, MODEL, block_event, tokens_of
from tests.support.wait import wait_until


async def test_kv_event_ports_come_from_pod_annotations_and_removal_drops_entries(api, kubeconfig):
    pub = FakePublisher(f"kv@127.0.0.1:9000@{MODEL}")
    api.apply(inference_pool("pool", {"app": "vllm"}, [9000]))
    api.apply(pod("p0", "127.0.0.1", annotations={"llm-epp.io/kv-events-port": str(pub.port),
                                                  "llm-epp.io/kv-replay-port": str(pub.replay_port)}))
    registry = EndpointRegistry()
    discovery = KubernetesDiscovery(registry, namespace="default", pool_name="pool", kubeconfig=kubeconfig)
    metrics = CollectorRegistry()
    index = KVBlockIndex(BS, 1000, metrics=KVIndexMetrics(metrics))
    subscriber = KVEventSubscriber(index, SubscriberConfig(mode="per-endpoint"), registry,
                                   KVSubscriberMetrics(metrics))
    keys = index.keyer.request_keys(tokens_of(1, 1), MODEL)
    try:
        assert await discovery.start(5.0)
        await subscriber.start()
        await pub.heartbeat_until(
            lambda: (metrics.get_sample_value("epp_kv_events_messages_total", {"source": "live"}) or 0) > 0)
        await pub.publish([block_event(1, 0)])
        await wait_until(lambda: index.lookup(keys) != {}, "block indexed from the pod's KV events", 3.0)
        assert list(index.lookup(keys)) == ["127.0.0.1:9000"]
        # The pod stops being Ready: its endpoint leaves and its index entries go with it.
        api.apply(pod("p0", "127.0.0.1", ready=False, annotations={"llm-epp.io/kv-events-port": str(pub.port)}))
        await wait_until(lambda: index.lookup(keys) == {}, "index entries dropped", 3.0)
        assert metrics.get_sample_value("epp_kv_events_subscriptions") == 0
    finally:
        await subscriber.stop()
        await discovery.stop()
        await pub.close()
