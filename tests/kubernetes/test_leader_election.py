"""Leader election over a coordination.k8s.io Lease (GIE's active-passive HA) against the local API server."""

from __future__ import annotations

import asyncio

import pytest

from bench.support.k8s_apiserver import inference_pool, pod
from epp.server.leader_election import LeaderElection, lease_name
from epp.server.runner import EppServer, ServeOptions
from tests.support.wait import wait_until

LEASE = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
         "metadata": {"name": "epp-default-pool.gateway-api-inference-extension.sigs.k8s.io",
                      "namespace": "default"}}


def elector(kubeconfig: str, identity: str) -> LeaderElection:
    return LeaderElection(namespace="default", name=lease_name("default", "pool"), identity=identity,
                          kubeconfig=kubeconfig, lease_duration_s=2, renew_deadline_s=1.5, retry_period_s=0.2)


async def test_one_leader_at_a_time_and_a_fast_handover_on_release(api, kubeconfig):
    a, b = elector(kubeconfig, "a"), elector(kubeconfig, "b")
    await a.start()
    await b.start()
    try:
        await wait_until(lambda: a.is_leader or b.is_leader, "a leader", 3.0)
        for _ in range(50):  # 1 s of samples: never two leaders, never a change of leader
            assert a.is_leader != b.is_leader
            await asyncio.sleep(0.02)
        leader, standby = (a, b) if a.is_leader else (b, a)
        assert api.get(LEASE)["spec"]["holderIdentity"] == leader.identity
        await leader.stop()  # releases the lease
        await wait_until(lambda: standby.is_leader, "standby takes over a released lease", 1.0)
        spec = api.get(LEASE)["spec"]
        assert spec["holderIdentity"] == standby.identity and spec["leaseTransitions"] == 1
    finally:
        await a.stop()
        await b.stop()


@pytest.mark.slow
async def test_a_crashed_leader_is_replaced_after_the_lease_duration(api, kubeconfig):
    a = elector(kubeconfig, "a")
    await a.start()
    await wait_until(lambda: a.is_leader, "a leads", 3.0)
    b = elector(kubeconfig, "b")
    await b.start()
    try:
        await asyncio.sleep(0.5)
        assert not b.is_leader
        a._task.cancel()  # a dies without releasing: its lease record stops changing
        loop = asyncio.get_running_loop()
        start = loop.time()
        await wait_until(lambda: b.is_leader, "b takes over an expired lease", 4.0)
        assert loop.time() - start >= 1.5  # not before the lease ran out (2 s after a's last renewal)
    finally:
        a.is_leader = False  # a is dead: nothing to release
        await a.stop()
        await b.stop()


@pytest.mark.slow
async def test_only_the_leader_picker_is_ready(api, kubeconfig):
    api.apply(inference_pool("pool", {"app": "vllm"}, [8000]))
    api.apply(pod("p0", "10.1.0.1"))
    servers = [EppServer(ServeOptions(grpc_port=0, grpc_health_port=0, metrics_port=0, bind_address="127.0.0.1",
                                      pool_name="pool", kubeconfig=kubeconfig, scrape_metrics=False,
                                      ha_enable_leader_election=True, grace_period_s=0)) for _ in range(2)]
    for server in servers:
        await server.start()
    try:
        await wait_until(lambda: sum(s.is_ready() for s in servers) == 1, "one ready picker", 5.0)
        leader = next(s for s in servers if s.is_ready())
        standby = next(s for s in servers if s is not leader)
        assert standby.endpoints.synced and len(standby.endpoints) == 1  # warm, only not the leader
        await leader.stop(0)
        await wait_until(standby.is_ready, "standby becomes ready", 5.0)
    finally:
        for server in servers:
            await server.stop(0)


def test_lease_timings_must_nest():
    with pytest.raises(ValueError, match="retry period < renew deadline < lease duration"):
        LeaderElection(namespace="d", name="n", lease_duration_s=1, renew_deadline_s=2, retry_period_s=0.5)
