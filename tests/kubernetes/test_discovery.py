"""Kubernetes discovery with the real kubernetes_asyncio client against the local API server."""

from __future__ import annotations

import asyncio
import random
import time

import pytest
from prometheus_client import CollectorRegistry

from bench.support.k8s_apiserver import (
    OBJECTIVES,
    OBJECTIVES_LLMD,
    PODS,
    FakeApiServer,
    inference_objective,
    inference_pool,
    pod,
)
from epp.datalayer.inference_pool import (
    EndpointPickerRef,
    PoolSpecError,
    envoy_options,
    parse_selector,
    parse_target_ports,
    pool_view_of,
)
from epp.datalayer.kubernetes import KubernetesDiscovery
from epp.datalayer.objectives import ObjectivePriorities
from epp.datalayer.registry import EndpointRegistry
from epp.kube.client import KubernetesError
from tests.support.wait import wait_until


def names(registry: EndpointRegistry) -> set[str]:
    return {ep.name for ep in registry.snapshot()}


class Rig:
    """A registry fed by KubernetesDiscovery from the local API server."""

    def __init__(self, api: FakeApiServer, kubeconfig: str, **kw) -> None:
        self.api = api
        self.registry = EndpointRegistry()
        self.metrics = CollectorRegistry()
        self.objectives = ObjectivePriorities({"static-objective": 7})
        kw.setdefault("pool_name", "pool")
        self.discovery = KubernetesDiscovery(self.registry, namespace="default", kubeconfig=kubeconfig,
                                             objectives=self.objectives, metrics_registry=self.metrics,
                                             watch_timeout_s=kw.pop("watch_timeout_s", 30), **kw)

    def metric(self, name: str, labels: dict | None = None) -> float:
        return self.metrics.get_sample_value(name, labels or {}) or 0.0


@pytest.fixture
async def rig(api, kubeconfig):
    made = []

    def make(**kw) -> Rig:
        made.append(Rig(api, kubeconfig, **kw))
        return made[-1]

    yield make
    for r in made:
        await r.discovery.stop()


async def test_ready_pods_of_the_pool_become_endpoints_with_their_metadata(api, rig):
    api.apply(inference_pool("pool", {"app": "vllm"}, [8000, 8001]))
    api.apply(pod("ready", "10.1.0.1", labels={"app": "vllm", "role": "decode"}, annotations={
        "llm-epp.io/kv-events-port": "5557", "llm-epp.io/kv-replay-port": "5558", "unrelated/x": "y"}))
    api.apply(pod("not-ready", "10.1.0.2", ready=False))
    api.apply(pod("pending", None))
    api.apply(pod("terminating", "10.1.0.3", terminating=True))
    api.apply(pod("other-app", "10.1.0.4", labels={"app": "other"}))
    api.apply(pod("one-port", "10.1.0.5", annotations={"inference.networking.k8s.io/active-ports": "8001"}))
    r = rig()
    assert await r.discovery.start(5.0)
    assert names(r.registry) == {"10.1.0.1:8000", "10.1.0.1:8001", "10.1.0.5:8001"}
    ep = r.registry.get("10.1.0.1:8001")
    assert dict(ep.labels) == {"app": "vllm", "role": "decode", "kv-events-port": "5557", "kv-replay-port": "5558",
                               "llm-epp.io/pod": "ready", "llm-epp.io/endpoint": "ready-rank-1"}
    assert r.registry.get("10.1.0.5:8001").labels["llm-epp.io/endpoint"] == "one-port-rank-1"
    assert r.metric("epp_kubernetes_discovered_endpoints") == 3
    assert r.metric("epp_kubernetes_pool_synced") == 1
    # The pods were listed with the pool's selector, then watched from the list's resourceVersion.
    assert api.list_requests("pods")[0]["labelSelector"] == "app=vllm"
    await wait_until(lambda: any(q.get("labelSelector") == "app=vllm" for q in api.watch_requests()), "pod watch", 2.0)
    watch = next(q for q in api.watch_requests() if q.get("labelSelector") == "app=vllm")
    assert watch["allowWatchBookmarks"] == "True" and int(watch["resourceVersion"]) > 1000


async def test_pod_turning_ready_is_routable_within_two_seconds(api, rig):
    api.apply(inference_pool("pool", {"app": "vllm"}, [8000]))
    api.apply(pod("a", "10.1.0.1"))
    api.apply(pod("b", "10.1.0.2", ready=False))
    r = rig()
    assert await r.discovery.start(5.0)
    assert names(r.registry) == {"10.1.0.1:8000"}
    api.apply(pod("b", "10.1.0.2", ready=True))
    await wait_until(lambda: "10.1.0.2:8000" in names(r.registry), "pod b routable", 2.0)


@pytest.mark.slow
async def test_deleted_or_unready_pod_is_dropped_at_once_and_never_comes_back(api, rig):
    api.apply(inference_pool("pool", {"app": "vllm"}, [8000]))
    for i in range(3):
        api.apply(pod(f"p{i}", f"10.1.0.{i + 1}"))
    r = rig(watch_timeout_s=1)
    removed: list[str] = []
    r.registry.add_listener(lambda added, gone: removed.extend(ep.name for ep in gone))
    assert await r.discovery.start(5.0)
    api.delete(pod("p0", None))
    api.apply(pod("p1", "10.1.0.2", terminating=True))
    await wait_until(lambda: names(r.registry) == {"10.1.0.3:8000"}, "p0 and p1 gone", 2.0)
    assert sorted(removed) == ["10.1.0.1:8000", "10.1.0.2:8000"]
    # Through watch restarts (the server ends each watch after 1 s) and a relist, they stay gone.
    seen: set[str] = set()
    deadline = time.monotonic() + 2.5
    while time.monotonic() < deadline:
        seen |= names(r.registry)
        await asyncio.sleep(0.01)
    assert seen == {"10.1.0.3:8000"}
    assert r.metric("epp_kubernetes_watch_restarts_total", {"resource": "pods", "reason": "closed"}) >= 1


async def test_pool_selector_and_target_port_changes_apply_live(api, rig):
    api.apply(inference_pool("pool", {"app": "blue"}, [8000]))
    api.apply(pod("blue", "10.1.0.1", labels={"app": "blue"}))
    api.apply(pod("green", "10.1.0.2", labels={"app": "green"}))
    r = rig()
    assert await r.discovery.start(5.0)
    assert names(r.registry) == {"10.1.0.1:8000"}
    api.apply(inference_pool("pool", {"app": "green"}, [8000]))
    await wait_until(lambda: names(r.registry) == {"10.1.0.2:8000"}, "selector switched to green", 2.0)
    api.apply(inference_pool("pool", {"app": "green"}, [9000, 9001]))
    await wait_until(lambda: names(r.registry) == {"10.1.0.2:9000", "10.1.0.2:9001"}, "ports switched", 2.0)
    # A pod relabelled out of the selector leaves (the API server sends DELETED to the filtered watch).
    api.apply(pod("green", "10.1.0.2", labels={"app": "blue"}))
    await wait_until(lambda: names(r.registry) == set(), "relabelled pod gone", 2.0)
    api.apply(pod("green", "10.1.0.2", labels={"app": "green"}))
    await wait_until(lambda: names(r.registry) == {"10.1.0.2:9000", "10.1.0.2:9001"}, "relabelled back", 2.0)


async def test_a_dropped_watch_resumes_from_its_resource_version_without_relisting(api, rig):
    api.apply(inference_pool("pool", {"app": "vllm"}, [8000]))
    api.apply(pod("a", "10.1.0.1"))
    r = rig()
    assert await r.discovery.start(5.0)
    # The pool's, the pods' and the objectives' of both groups (llm-d.ai and GIE's).
    await wait_until(lambda: len(api.watchers) == 4, "pool, pod and objective watches open", 2.0)
    pod_lists = len(api.list_requests("pods"))
    last_rv = api.rv
    assert api.drop_watches() == 4
    # Changes while no watch is open arrive through the resumed watch.
    api.apply(pod("b", "10.1.0.2"))
    api.delete(pod("a", None))
    await wait_until(lambda: names(r.registry) == {"10.1.0.2:8000"}, "changes made while disconnected", 3.0)
    resumed = [q for q in api.watch_requests() if q.get("labelSelector") == "app=vllm"][-1]
    assert int(resumed["resourceVersion"]) >= last_rv
    assert len(api.list_requests("pods")) == pod_lists
    assert r.metric("epp_kubernetes_watch_restarts_total", {"resource": "pods", "reason": "error"}) >= 1


async def test_410_gone_relists_with_no_endpoint_lost_or_duplicated(api, rig):
    api.apply(inference_pool("pool", {"app": "vllm"}, [8000]))
    for i in range(20):
        api.apply(pod(f"p{i}", f"10.1.0.{i + 1}"))
    r = rig()
    changes: list[tuple[set, set]] = []
    r.registry.add_listener(lambda added, gone: changes.append(({e.name for e in added}, {e.name for e in gone})))
    assert await r.discovery.start(5.0)
    changes.clear()
    await wait_until(lambda: len(api.watchers) == 4, "watches open", 2.0)
    # Disconnect, change things, and compact history in one go: the resumed watch gets 410 Gone.
    api.drop_watches()
    api.delete(pod("p0", None))
    api.apply(pod("p1", "10.1.0.2", ready=False))
    api.apply(pod("new", "10.1.0.99"))
    api.compact()
    expected = {f"10.1.0.{i + 1}:8000" for i in range(2, 20)} | {"10.1.0.99:8000"}
    await wait_until(lambda: r.metric("epp_kubernetes_lists_total", {"resource": "pods"}) == 2, "relist", 3.0)
    await wait_until(lambda: names(r.registry) == expected, "relisted view", 2.0)
    assert r.metric("epp_kubernetes_watch_restarts_total", {"resource": "pods", "reason": "expired"}) == 1
    assert len(r.registry.snapshot()) == len(expected)  # no duplicates
    # Kept endpoints were never removed and re-added: only the real differences were announced.
    added = set().union(*(a for a, _ in changes))
    gone = set().union(*(g for _, g in changes))
    assert added == {"10.1.0.99:8000"} and gone == {"10.1.0.1:8000", "10.1.0.2:8000"}
    # And the watch goes on from the relist.
    api.apply(pod("later", "10.1.0.100"))
    await wait_until(lambda: "10.1.0.100:8000" in names(r.registry), "watch after relist", 2.0)


@pytest.mark.slow
async def test_api_errors_back_off_and_recover(api, rig):
    api.apply(inference_pool("pool", {"app": "vllm"}, [8000]))
    api.apply(pod("a", "10.1.0.1"))
    api.fail_next(4, 500)
    r = rig()
    assert await r.discovery.start(8.0)
    assert names(r.registry) == {"10.1.0.1:8000"}
    errors = sum(r.metric("epp_kubernetes_watch_restarts_total", {"resource": res, "reason": "error"})
                 for res in ("pods", "inferencepools", "inferenceobjectives.llm-d.ai",
                             "inferenceobjectives.inference.networking.x-k8s.io"))
    assert errors == 4


async def test_a_pool_that_does_not_exist_is_a_clear_error_and_not_ready(api, rig, caplog):
    r = rig(pool_name="missing")
    assert await r.discovery.start(1.0) is False
    assert not r.registry.synced
    assert "InferencePool default/missing (inference.networking.k8s.io/v1) does not exist" in r.discovery.pool_error
    assert "does not exist" in caplog.text
    assert r.metric("epp_kubernetes_pool_synced") == 0
    # Created later, it is picked up by the pool watch.
    api.apply(pod("a", "10.1.0.1"))
    api.apply(inference_pool("missing", {"app": "vllm"}, [8000]))
    await wait_until(lambda: names(r.registry) == {"10.1.0.1:8000"}, "pool created", 3.0)
    assert r.discovery.pool_error is None
    # Deleted again: no endpoints, so the picker is not ready.
    api.delete(inference_pool("missing", {}, []))
    await wait_until(lambda: len(r.registry) == 0, "pool deleted", 2.0)
    assert r.metric("epp_kubernetes_pool_synced") == 0


async def test_crds_not_installed_is_a_clear_error(kubeconfig, tmp_path):
    api = FakeApiServer(resources=[PODS])
    await api.start()
    try:
        r = Rig(api, api.write_kubeconfig(str(tmp_path / "kc")))
        assert await r.discovery.start(1.0) is False
        assert "does not serve inferencepools.inference.networking.k8s.io" in r.discovery.pool_error
        assert "CRDs installed" in r.discovery.pool_error
        await r.discovery.stop()
    finally:
        await api.stop()


async def test_standalone_mode_needs_no_crds(tmp_path):
    api = FakeApiServer(resources=[PODS])
    await api.start()
    try:
        api.apply(pod("a", "10.1.0.1", labels={"app": "x", "tier": "y"}))
        api.apply(pod("b", "10.1.0.2", labels={"app": "x", "tier": "z"}))
        registry = EndpointRegistry()
        discovery = KubernetesDiscovery(registry, namespace="default", selector=parse_selector("app=x,tier=y"),
                                        target_ports=parse_target_ports("8000,8001"),
                                        kubeconfig=api.write_kubeconfig(str(tmp_path / "kc")))
        assert await discovery.start(5.0)
        assert names(registry) == {"10.1.0.1:8000", "10.1.0.1:8001"}
        assert api.list_requests("pods")[0]["labelSelector"] == "app=x,tier=y"
        await discovery.stop()
    finally:
        await api.stop()


async def test_bad_credentials_keep_the_picker_not_ready(api, tmp_path, caplog):
    registry = EndpointRegistry()
    discovery = KubernetesDiscovery(registry, namespace="default", pool_name="pool",
                                    kubeconfig=api.write_kubeconfig(str(tmp_path / "kc"), token="wrong"))
    api.apply(inference_pool("pool", {"app": "vllm"}, [8000]))
    assert await discovery.start(1.0) is False
    assert "401" in discovery.pool_error and "Unauthorized" in caplog.text
    await discovery.stop()


def test_flag_parsing_errors_name_the_flag():
    assert parse_selector("app=x, tier==y") == {"app": "x", "tier": "y"}
    assert parse_target_ports("8000,8001") == (8000, 8001)
    for bad in ("app", "app!=x", ""):
        with pytest.raises(KubernetesError, match="--endpoint-selector"):
            parse_selector(bad)
    for bad in ("http", "8000,8000", "0", ",".join(str(8000 + i) for i in range(9))):
        with pytest.raises(KubernetesError, match="--endpoint-target-ports"):
            parse_target_ports(bad)
    with pytest.raises(KubernetesError, match="--endpoint-target-ports"):
        KubernetesDiscovery(EndpointRegistry(), namespace="d", selector={"app": "x"})


async def test_inference_objectives_set_priorities_over_the_static_fallback(api, rig):
    api.apply(inference_pool("pool", {"app": "vllm"}, [8000]))
    api.apply(pod("a", "10.1.0.1"))
    api.apply(inference_objective("critical", 10, "pool"))
    api.apply(inference_objective("batch", -1, "pool"))
    api.apply(inference_objective("no-priority", None, "pool"))
    api.apply(inference_objective("elsewhere", 99, "other-pool"))
    r = rig()
    assert await r.discovery.start(5.0)
    await wait_until(lambda: "critical" in r.objectives, "objectives listed", 2.0)
    assert dict(r.objectives) == {"static-objective": 7, "critical": 10, "batch": -1, "no-priority": 0}
    api.apply(inference_objective("critical", 20, "pool"))
    api.apply(inference_objective("static-objective", 1, "pool"))
    await wait_until(lambda: r.objectives.get("critical") == 20 and r.objectives.get("static-objective") == 1,
                     "objectives modified", 2.0)
    api.delete(inference_objective("static-objective", 1, "pool"))
    api.delete(inference_objective("batch", -1, "pool"))
    await wait_until(lambda: "batch" not in r.objectives, "objective deleted", 2.0)
    assert r.objectives.get("static-objective") == 7  # back to the config's value
    assert r.metric("epp_kubernetes_objectives") == 2


async def test_llm_d_objectives_are_read_and_win_a_name_both_groups_hold(api, rig, caplog):
    llmd = "llm-d.ai"
    api.apply(inference_pool("pool", {"app": "vllm"}, [8000]))
    api.apply(pod("a", "10.1.0.1"))
    api.apply(inference_objective("agentic-sessions", -1, "pool", group=llmd))  # as the llm-d chart makes them
    api.apply(inference_objective("shared", 5, "pool", group=llmd))
    api.apply(inference_objective("shared", 50, "pool"))  # the deprecated GIE group, same name
    api.apply(inference_objective("legacy", 3, "pool"))
    r = rig()
    assert await r.discovery.start(5.0)
    await wait_until(lambda: {"agentic-sessions", "shared", "legacy"} <= set(r.objectives), "objectives listed", 2.0)
    assert dict(r.objectives) == {"static-objective": 7, "agentic-sessions": -1, "shared": 5, "legacy": 3}
    assert "InferenceObjective shared exists in llm-d.ai and inference.networking.x-k8s.io: the llm-d.ai one's " \
        "priority 5 applies" in caplog.text
    # The llm-d one goes: the GIE one's priority applies; a watch event in the llm-d group applies as well.
    api.delete(inference_objective("shared", 5, "pool", group=llmd))
    api.apply(inference_objective("agentic-sessions", -2, "pool", group=llmd))
    await wait_until(lambda: r.objectives.get("shared") == 50 and r.objectives.get("agentic-sessions") == -2,
                     "llm-d objective deleted and modified", 2.0)
    assert r.metric("epp_kubernetes_objectives") == 3


async def test_a_resumed_objective_watch_sees_only_its_own_group(api, rig, caplog):
    api.apply(inference_pool("pool", {"app": "vllm"}, [8000]))
    api.apply(pod("a", "10.1.0.1"))
    r = rig()
    assert await r.discovery.start(5.0)
    await wait_until(lambda: len(api.watchers) == 4, "watches open", 2.0)
    api.drop_watches()
    # Made while no watch is open: each resumed watch replays its own collection's events only.
    api.apply(inference_objective("solo", 4, "pool", group="llm-d.ai"))
    api.apply(pod("b", "10.1.0.2"))
    await wait_until(lambda: r.objectives.get("solo") == 4 and len(names(r.registry)) == 2, "resumed watches", 3.0)
    await asyncio.sleep(0.1)
    assert "exists in" not in caplog.text and dict(r.objectives) == {"static-objective": 7, "solo": 4}


@pytest.mark.parametrize("served", [OBJECTIVES, OBJECTIVES_LLMD])
async def test_one_objective_group_not_installed_is_read_as_empty(kubeconfig, rig, caplog, served, api):
    """A cluster with only one of the two CRDs: the other group is absent (one info line), not an error."""
    api.resources = {k: v for k, v in api.resources.items() if v[2] != "inferenceobjectives" or v == served}
    caplog.set_level("INFO")
    api.apply(inference_pool("pool", {"app": "vllm"}, [8000]))
    api.apply(pod("a", "10.1.0.1"))
    api.apply(inference_objective("only", 4, "pool", group=served[0]))
    r = rig()
    assert await r.discovery.start(5.0)
    await wait_until(lambda: r.objectives.get("only") == 4, "objectives of the served group", 2.0)
    missing = OBJECTIVES_LLMD if served == OBJECTIVES else OBJECTIVES
    assert f"does not serve inferenceobjectives.{missing[0]} in namespace default (its CRD is not installed)" \
        in caplog.text
    assert not [rec for rec in caplog.records if rec.levelname == "ERROR"]


async def test_a_thousand_pods_churning_end_in_exactly_the_ready_set(api, rig):
    rng = random.Random(13)
    api.apply(inference_pool("pool", {"app": "vllm"}, [8000]))
    ready: dict[str, str] = {}

    def put(i: int, is_ready: bool) -> None:
        name, ip = f"pod-{i}", f"10.{i // 250}.{i % 250}.1"
        api.apply(pod(name, ip, ready=is_ready))
        if is_ready:
            ready[name] = f"{ip}:8000"
        else:
            ready.pop(name, None)

    for i in range(1000):
        put(i, rng.random() < 0.8)
    r = rig()
    assert await r.discovery.start(10.0)
    assert names(r.registry) == set(ready.values())
    assert api.list_requests("pods")[0]["limit"] == "500"  # paged list
    for round_ in range(6):
        for _ in range(300):
            i = rng.randrange(1200)
            if rng.random() < 0.2 and f"pod-{i}" in {k for (_, k) in api.objects.get(("", "pods"), {})}:
                api.delete(pod(f"pod-{i}", None))
                ready.pop(f"pod-{i}", None)
            else:
                put(i, rng.random() < 0.7)
        if round_ == 2:
            api.drop_watches()
        if round_ == 4:
            api.drop_watches()
            api.compact()
        await asyncio.sleep(0.05)
    await wait_until(lambda: names(r.registry) == set(ready.values()), "final ready set", 5.0)
    assert len(r.registry.snapshot()) == len(ready)
    assert r.metric("epp_kubernetes_discovered_endpoints") == len(ready)


async def test_a_pool_with_an_unsupported_app_protocol_is_not_served(api, rig):
    pool = inference_pool("pool", {"app": "vllm"}, [8000])
    pool["spec"]["appProtocol"] = "kubernetes.io/ws"
    api.apply(pool)
    api.apply(pod("a", "10.1.0.1"))
    r = rig()
    assert await r.discovery.start(1.0) is False
    assert "appProtocol 'kubernetes.io/ws' is not supported" in r.discovery.pool_error
    pool["spec"]["appProtocol"] = "http"
    api.apply(pool)
    await wait_until(lambda: names(r.registry) == {"10.1.0.1:8000"}, "pool served once it speaks http", 3.0)


async def test_h2c_pools_and_pools_without_a_picker_ref_are_served(api, rig):
    """GIE v1.6: `appProtocol: kubernetes.io/h2c` only changes what the gateway speaks upstream, and
    `endpointPickerRef` is optional; discovery serves both pools as any other."""
    pool = inference_pool("pool", {"app": "vllm"}, [8000, 8001])
    pool["spec"]["appProtocol"] = "kubernetes.io/h2c"
    del pool["spec"]["endpointPickerRef"]
    api.apply(pool)
    api.apply(pod("a", "10.1.0.1"))
    r = rig()
    assert await r.discovery.start(5.0)
    assert names(r.registry) == {"10.1.0.1:8000", "10.1.0.1:8001"}
    assert r.discovery.pool_error is None
    assert (r.discovery.view.app_protocol, r.discovery.view.endpoint_picker) == ("kubernetes.io/h2c", None)
    pool["spec"]["endpointPickerRef"] = {"name": "epp", "port": {"number": 9002}, "failureMode": "FailOpen"}
    api.apply(pool)
    await wait_until(lambda: r.discovery.view.endpoint_picker is not None, "the ref to be read", 2.0)
    assert r.discovery.view.endpoint_picker == EndpointPickerRef("epp", port=9002, failure_mode="FailOpen")
    assert names(r.registry) == {"10.1.0.1:8000", "10.1.0.1:8001"}


async def test_v1alpha2_pools_are_read_with_pool_group_x_k8s(api, rig):
    api.apply({"apiVersion": "inference.networking.x-k8s.io/v1alpha2", "kind": "InferencePool",
               "metadata": {"name": "old-pool", "namespace": "default"},
               "spec": {"selector": {"app": "vllm"}, "targetPortNumber": 8000,
                        "extensionRef": {"name": "epp"}}})
    api.apply(pod("a", "10.1.0.1"))
    r = rig(pool_name="old-pool", pool_group="inference.networking.x-k8s.io")
    assert await r.discovery.start(5.0)
    assert names(r.registry) == {"10.1.0.1:8000"}
    assert api.list_requests("inferencepools")[0] == {"limit": "500", "fieldSelector": "metadata.name=old-pool"}
    assert any(p.startswith("/apis/inference.networking.x-k8s.io/v1alpha2/") for p, _ in api.requests)


def test_pool_specs_that_cannot_be_used_name_the_field():
    base = {"selector": {"matchLabels": {"a": "b"}}, "targetPorts": [{"number": 8000}]}
    ref = {"name": "epp", "port": {"number": 9002}}
    for spec, field in (({"targetPorts": [{"number": 8000}]}, "spec.selector"),
                        ({"selector": {"matchLabels": {"a": "b"}}}, "spec.targetPorts"),
                        ({**base, "targetPorts": [{"number": 0}]}, "spec.targetPorts"),
                        ({**base, "targetPorts": [{"number": 8000}, {"number": 8000}]}, "spec.targetPorts"),
                        ({**base, "targetPorts": [{"number": 8000 + i} for i in range(9)]}, "spec.targetPorts"),
                        ({**base, "selector": {"matchLabels": {f"l{i}": "v" for i in range(65)}}},
                         "spec.selector.matchLabels"),
                        ({**base, "appProtocol": 2}, "spec.appProtocol"),
                        ({**base, "endpointPickerRef": "epp"}, "spec.endpointPickerRef"),
                        ({**base, "endpointPickerRef": {"port": {"number": 9002}}}, "spec.endpointPickerRef.name"),
                        ({**base, "endpointPickerRef": {"name": "epp"}}, "spec.endpointPickerRef.port.number"),
                        ({**base, "endpointPickerRef": {**ref, "port": {"number": 70000}}},
                         "spec.endpointPickerRef.port.number"),
                        ({**base, "endpointPickerRef": {**ref, "failureMode": "failopen"}},
                         "spec.endpointPickerRef.failureMode"),
                        ({**base, "endpointPickerRef": {**ref, "kind": "Not A Kind"}}, "spec.endpointPickerRef.kind"),
                        ({**base, "endpointPickerRef": {**ref, "group": "Upper.Case"}},
                         "spec.endpointPickerRef.group"),
                        ({**base, "extensionRef": {"name": "epp", "portNumber": "9002"}}, "spec.extensionRef.portNumber")):
        with pytest.raises(PoolSpecError, match=field.replace(".", r"\.")):
            pool_view_of({"spec": spec})


def test_the_endpoint_picker_ref_and_its_defaults():
    base = {"selector": {"matchLabels": {"a": "b"}}, "targetPorts": [{"number": 8000}]}
    view = pool_view_of({"spec": {**base, "endpointPickerRef": {"name": "epp", "port": {"number": 9002}}}})
    assert view.endpoint_picker == EndpointPickerRef("epp", group="", kind="Service", port=9002,
                                                     failure_mode="FailClose")
    assert view.app_protocol == "http" and not view.endpoint_picker.fail_open
    # Another kind needs no port (the gateway derives it from the referent).
    other = pool_view_of({"spec": {**base, "endpointPickerRef": {"name": "x", "kind": "Backend",
                                                                 "group": "gateway.example.io"}}})
    assert other.endpoint_picker == EndpointPickerRef("x", "gateway.example.io", "Backend", None, "FailClose")
    # v1alpha2 `extensionRef`: `portNumber`, 9002 when unset for a Service.
    old = pool_view_of({"spec": {"selector": {"a": "b"}, "targetPortNumber": 8000,
                                 "extensionRef": {"name": "epp", "failureMode": "FailOpen"}}})
    assert old.endpoint_picker == EndpointPickerRef("epp", port=9002, failure_mode="FailOpen")


def test_what_a_pool_asks_of_envoy():
    base = {"selector": {"matchLabels": {"a": "b"}}, "targetPorts": [{"number": 8000}]}
    h2c_open = pool_view_of({"spec": {**base, "appProtocol": "kubernetes.io/h2c", "endpointPickerRef": {
        "name": "epp", "port": {"number": 9102}, "failureMode": "FailOpen"}}})
    assert envoy_options(h2c_open, "llm") == {"upstream_protocol": "h2c", "failure_mode_allow": True,
                                              "epp_host": "epp.llm.svc.cluster.local", "epp_port": 9102}
    assert envoy_options(h2c_open)["epp_host"] == "epp"  # no namespace known: the Service's short name
    assert envoy_options(pool_view_of({"spec": base})) == {"upstream_protocol": "http", "failure_mode_allow": False}
    with pytest.raises(PoolSpecError, match="spec.appProtocol: 'kubernetes.io/ws' is not supported"):
        envoy_options(pool_view_of({"spec": {**base, "appProtocol": "kubernetes.io/ws"}}))


async def test_an_expired_continue_token_restarts_the_list(api, rig):
    api.apply(inference_pool("pool", {"app": "vllm"}, [8000]))
    for i in range(600):  # two pages
        api.apply(pod(f"p{i}", f"10.1.{i // 250}.{i % 250 + 1}"))
    api.expire_continue_tokens()
    r = rig()
    assert await r.discovery.start(5.0)
    assert len(names(r.registry)) == 600
    pages = [q for q in api.list_requests("pods")]
    assert [("continue" in q) for q in pages] == [False, True, False, True]  # 410 on page 2, then a new list
    assert r.metric("epp_kubernetes_watch_restarts_total", {"resource": "pods", "reason": "expired"}) == 1


async def test_pod_metadata_changes_reach_the_endpoint_labels(api, rig):
    api.apply(inference_pool("pool", {"app": "vllm"}, [8000]))
    api.apply(pod("a", "10.1.0.1", annotations={"llm-epp.io/kv-events-port": "5557"}))
    api.apply(pod("b", "10.1.0.2"))
    r = rig()
    assert await r.discovery.start(5.0)
    untouched = r.registry.get("10.1.0.2:8000")
    api.apply(pod("a", "10.1.0.1", labels={"app": "vllm", "role": "prefill"},
                  annotations={"llm-epp.io/kv-events-port": "6000"}))
    await wait_until(lambda: r.registry.get("10.1.0.1:8000").labels.get("kv-events-port") == "6000", "relabel", 2.0)
    assert r.registry.get("10.1.0.1:8000").labels["role"] == "prefill"
    assert r.registry.get("10.1.0.2:8000") is untouched  # the other endpoint (and its metrics) kept as it was
