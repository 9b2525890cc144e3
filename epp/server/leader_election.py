"""Active-passive HA as GIE does it: replicas compete for a `coordination.k8s.io/v1` Lease and only
the holder reports ready (`--ha-enable-leader-election`); every replica keeps serving ext_proc.

The algorithm is client-go's: a replica takes the lease when it is free or when its record has not
changed for `leaseDurationSeconds` as measured on the replica's own clock (clocks of other
replicas are never compared); the holder renews every `retry_period_s`; a holder that cannot
renew for `renew_deadline_s` stops calling itself leader; every write carries the lease's
resourceVersion, so two replicas cannot both win (the loser gets 409 Conflict).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import os
import random
import re
import socket
import time
import uuid
from typing import Any

import msgspec
from prometheus_client import CollectorRegistry, Gauge

from epp.kube.client import load_api_client

log = logging.getLogger(__name__)

_decode = msgspec.json.Decoder().decode


def lease_name(namespace: str, pool: str) -> str:
    """GIE's lease ID for a pool, so that replicas of any GIE-style picker of that pool elect one leader."""
    return f"epp-{namespace}-{pool}.gateway-api-inference-extension.sigs.k8s.io"


# A Deployment's pod name: `<deployment>-<replicaset hash>-<pod suffix>`.
_DEPLOYMENT_POD = re.compile(r"^(.+)-[a-z0-9]+-[a-z0-9]+$")


def deployment_of_pod(pod_name: str) -> str:
    """The Deployment a pod of it is named after (ValueError when the name has not that shape); standalone
    mode's replicas share the lease of their Deployment, as llm-d's do."""
    match = _DEPLOYMENT_POD.match(pod_name)
    if match is None:
        raise ValueError(f"$POD_NAME {pod_name!r} is not a Deployment's pod name (<deployment>-<hash>-<suffix>)")
    return match.group(1)


def _micro_time() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaderElection:
    """Holds (or waits for) the pool's Lease; `is_leader` tells readiness."""

    def __init__(self, *, namespace: str, name: str, identity: str | None = None,
                 kubeconfig: str | None = None, lease_duration_s: float = 15.0, renew_deadline_s: float = 10.0,
                 retry_period_s: float = 2.0, api_client: Any = None,
                 metrics_registry: CollectorRegistry | None = None) -> None:
        if not retry_period_s < renew_deadline_s < lease_duration_s:
            raise ValueError("leader election needs retry period < renew deadline < lease duration")
        self.namespace = namespace
        self.name = name
        host = os.environ.get("POD_NAME") or os.environ.get("HOSTNAME") or socket.gethostname()
        self.identity = identity or f"{host}_{uuid.uuid4().hex[:8]}"
        self.kubeconfig = kubeconfig
        self.lease_duration_s = lease_duration_s
        self.renew_deadline_s = renew_deadline_s
        self.retry_period_s = retry_period_s
        self.is_leader = False
        self._api_client = api_client
        self._owns_client = api_client is None
        self._observed: tuple[str, float] | None = None  # (resourceVersion, when this replica saw it change)
        self._last_renew = 0.0
        self._task: asyncio.Task[None] | None = None
        self._gauge = Gauge("epp_leader", "1 while this replica holds the pool's lease.",
                            registry=metrics_registry or CollectorRegistry())

    async def start(self) -> None:
        """Start competing; returns at once (readiness follows `is_leader`)."""
        from kubernetes_asyncio import client

        if self._api_client is None:
            self._api_client = await load_api_client(self.kubeconfig)
        self._api = client.CoordinationV1Api(self._api_client)
        self._task = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        """Stop competing and hand the lease back at once if held (GIE releases on cancel)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self.is_leader:
            try:
                await self._release()
            except Exception as exc:  # the lease then expires on its own
                log.warning("leader election: releasing %s failed: %s", self.name, exc)
        self._set_leader(False)
        if self._owns_client and self._api_client is not None:
            await self._api_client.close()
            self._api_client = None

    async def _run(self) -> None:
        while True:
            try:
                renewed = await self._try_acquire_or_renew()
            except Exception as exc:  # API trouble: keep the role until the renew deadline passes
                log.warning("leader election: %s: %s", self.name, exc)
                renewed = False
            now = time.monotonic()
            if renewed:
                self._last_renew = now
                self._set_leader(True)
            elif self.is_leader and now - self._last_renew > self.renew_deadline_s:
                log.error("leader election: could not renew %s for %.0fs; stepping down", self.name,
                          self.renew_deadline_s)
                self._set_leader(False)
            await asyncio.sleep(self.retry_period_s * random.uniform(0.9, 1.1))

    def _set_leader(self, leader: bool) -> None:
        if leader != self.is_leader:
            log.warning("leader election: %s %s lease %s", self.identity, "acquired" if leader else "lost",
                        self.name)
        self.is_leader = leader
        self._gauge.set(1 if leader else 0)

    async def _request(self, call: Any, *args: Any, **kw: Any) -> tuple[int, Any]:
        response = await call(*args, **kw, _preload_content=False, _request_timeout=self.retry_period_s * 2)
        try:
            body = await response.read()
        finally:
            response.release()
        return response.status, (_decode(body) if body else None)

    async def _try_acquire_or_renew(self) -> bool:
        status, lease = await self._request(self._api.read_namespaced_lease, self.name, self.namespace)
        if status == 404:
            body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                    "metadata": {"name": self.name, "namespace": self.namespace},
                    "spec": self._spec(acquire=True, transitions=0)}
            status, _ = await self._request(self._api.create_namespaced_lease, self.namespace, body)
            return status == 201 or status == 200
        if status != 200:
            raise RuntimeError(f"reading lease {self.namespace}/{self.name}: HTTP {status}: {lease}")
        spec = lease.get("spec") or {}
        version = lease["metadata"]["resourceVersion"]
        now = time.monotonic()
        if self._observed is None or self._observed[0] != version:
            self._observed = (version, now)
        holder = spec.get("holderIdentity") or ""
        duration = spec.get("leaseDurationSeconds") or self.lease_duration_s
        if holder and holder != self.identity and now - self._observed[1] < duration:
            return False  # held by another replica that renews in time
        mine = holder == self.identity
        # As client-go: every change of holder (a released lease included) is one more transition.
        transitions = int(spec.get("leaseTransitions") or 0) + (0 if mine else 1)
        body = {**lease, "spec": {**self._spec(acquire=not mine, transitions=transitions),
                                  **({"acquireTime": spec.get("acquireTime")} if mine else {})}}
        status, _ = await self._request(self._api.replace_namespaced_lease, self.name, self.namespace, body)
        return status == 200  # 409: another replica wrote first

    def _spec(self, *, acquire: bool, transitions: int) -> dict[str, Any]:
        now = _micro_time()
        spec: dict[str, Any] = {"holderIdentity": self.identity, "leaseDurationSeconds": int(self.lease_duration_s),
                                "renewTime": now, "leaseTransitions": transitions}
        if acquire:
            spec["acquireTime"] = now
        return spec

    async def _release(self) -> None:
        status, lease = await self._request(self._api.read_namespaced_lease, self.name, self.namespace)
        if status != 200 or (lease.get("spec") or {}).get("holderIdentity") != self.identity:
            return
        spec = {**lease["spec"], "holderIdentity": None, "leaseDurationSeconds": 1, "renewTime": _micro_time()}
        await self._request(self._api.replace_namespaced_lease, self.name, self.namespace, {**lease, "spec": spec})
