"""Kubernetes discovery: an `InferencePool` (or a standalone label selector) and its Ready pods
become endpoints; `InferenceObjective`s give the priority of `x-gateway-inference-objective`.

Objectives are read from two groups: `llm-d.ai/v1alpha2` (llm-d's current one, where the llm-d
router chart creates them) and `inference.networking.x-k8s.io/v1alpha2` (GIE's, deprecated by
llm-d). An objective name present in both takes the `llm-d.ai` one's priority (a warning names it
once); a group whose CRD is not installed is read as empty (one line says so) and checked again
with backoff, so installing it later needs no restart.

The pool, its pods and the objectives are each kept by a `Reflector` (`epp.kube.client`); the
translation of those objects into endpoints is `epp.datalayer.inference_pool`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Iterable, Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Gauge

from epp.datalayer.discovery import Discovery
from epp.datalayer.inference_pool import (
    POOL_GROUP,
    POOL_GROUP_ALPHA,
    SUPPORTED_APP_PROTOCOLS,
    PoolSpecError,
    PoolView,
    pod_endpoints,
    pool_view_of,
)
from epp.datalayer.objectives import OBJECTIVE_GROUPS, ObjectivePriorities, objective_priority
from epp.datalayer.registry import EndpointRegistry, EndpointSpec
from epp.kube.client import (
    ApiError,
    Backoff,
    KubernetesError,
    ListCall,
    Reflector,
    WatchMetrics,
    describe,
    load_api_client,
)

log = logging.getLogger(__name__)


class KubernetesMetrics(WatchMetrics):
    """Watch restarts, discovered endpoints and sync state, on the picker's registry."""

    def __init__(self, registry: CollectorRegistry | None) -> None:
        super().__init__(registry)
        r = self.registry
        self.endpoints = Gauge("epp_kubernetes_discovered_endpoints",
                               "Endpoints discovered from Ready pods of the pool.", registry=r)
        self.pods = Gauge("epp_kubernetes_discovered_pods", "Pods seen by the selector (Ready or not).",
                          registry=r)
        self.synced = Gauge("epp_kubernetes_pool_synced",
                            "1 once the pool exists and its pods were fully listed.", registry=r)
        self.objectives = Gauge("epp_kubernetes_objectives", "InferenceObjectives of this pool.", registry=r)


def _log_crash(task: asyncio.Task[None]) -> None:
    # A reflector only ends by cancellation; anything else is a bug that must not pass silently.
    if not task.cancelled() and task.exception() is not None:
        log.error("kubernetes discovery: %s stopped", task.get_name(), exc_info=task.exception())


class KubernetesDiscovery(Discovery):
    """Endpoints of an InferencePool (`pool_name`) or, standalone, of a label selector and ports.

    The registry is first published once the pool exists and its pods were fully listed, so the
    picker stays NOT_SERVING until then. Pod changes are applied incrementally and published at
    most once per event-loop turn (a burst of watch events is one registry update).
    """

    def __init__(self, registry: EndpointRegistry, *, namespace: str, pool_name: str | None = None,
                 pool_group: str = POOL_GROUP, selector: Mapping[str, str] | None = None,
                 target_ports: Sequence[int] = (), kubeconfig: str | None = None,
                 context: str | None = None, objectives: ObjectivePriorities | None = None,
                 metrics_registry: CollectorRegistry | None = None, watch_timeout_s: int = 300,
                 api_client: Any = None) -> None:
        super().__init__(registry)
        if not pool_name and not selector:
            raise KubernetesError("either --pool-name or --endpoint-selector is required")
        if pool_name and selector:
            raise KubernetesError("--pool-name and --endpoint-selector exclude each other")
        if selector and not target_ports:
            raise KubernetesError("--endpoint-selector needs --endpoint-target-ports")
        self.namespace = namespace
        self.pool_name = pool_name
        self.pool_group = pool_group
        self.pool_version = "v1alpha2" if pool_group == POOL_GROUP_ALPHA else "v1"
        self.kubeconfig = kubeconfig
        self.context = context
        self.objectives = objectives
        self.metrics = KubernetesMetrics(metrics_registry)
        self.watch_timeout_s = watch_timeout_s
        self.view: PoolView | None = PoolView(dict(selector), tuple(target_ports)) if selector else None
        self.pool_error: str | None = None
        self._api_client = api_client
        self._owns_client = api_client is None
        self._pods: dict[str, dict] = {}
        self._pod_specs: dict[str, tuple[EndpointSpec, ...]] = {}
        self._pods_listed = False
        self._pod_task: asyncio.Task[None] | None = None
        self._pod_selector: str | None = None
        self._publish_pending = False
        self._tasks: list[asyncio.Task[None]] = []
        self._last_errors: dict[str, str] = {}
        # Per objective group (in OBJECTIVE_GROUPS order), its objects by name.
        self._objective_items: dict[str, dict[str, dict]] = {group: {} for group, _ in OBJECTIVE_GROUPS}
        self._shadowed: set[str] = set()  # names held by both groups, already warned about

    @property
    def pool_label(self) -> str:
        return f"InferencePool {self.namespace}/{self.pool_name} ({self.pool_group}/{self.pool_version})"

    async def run(self) -> None:
        from kubernetes_asyncio import client

        if self._api_client is None:
            self._api_client = await load_api_client(self.kubeconfig, self.context)
        self._core = client.CoreV1Api(self._api_client)
        self._custom = client.CustomObjectsApi(self._api_client)
        try:
            if self.pool_name is None:
                self._restart_pods()
            else:
                pools = Reflector(
                    "inferencepools", self._custom_call(self.pool_group, self.pool_version, "inferencepools"),
                    on_replace=self._pools_replaced, on_event=self._pool_event, metrics=self.metrics,
                    on_error=lambda exc: self._api_failed("inferencepools", exc),
                    field_selector=f"metadata.name={self.pool_name}", watch_timeout_s=self.watch_timeout_s)
                self._spawn(pools.run(), "inferencepools")
                if self.objectives is not None:
                    for group, version in OBJECTIVE_GROUPS:
                        self._watch_objectives(group, version)
            await asyncio.Event().wait()  # the reflectors run until stop() cancels this task
        finally:
            for task in [*self._tasks, self._pod_task]:
                if task is not None:
                    task.cancel()
            await asyncio.gather(*[t for t in [*self._tasks, self._pod_task] if t is not None],
                                 return_exceptions=True)
            self._tasks.clear()
            self._pod_task = None
            if self._owns_client and self._api_client is not None:
                await self._api_client.close()
                self._api_client = None

    def _watch_objectives(self, group: str, version: str) -> None:
        resource = f"inferenceobjectives.{group}"
        objectives = Reflector(
            resource, self._custom_call(group, version, "inferenceobjectives"),
            on_replace=lambda items: self._objectives_replaced(group, items),
            on_event=lambda kind, obj: self._objective_event(group, kind, obj),
            metrics=self.metrics, on_error=lambda exc: self._api_failed(resource, exc),
            watch_timeout_s=self.watch_timeout_s, backoff=Backoff(1.0, 60.0))
        self._spawn(objectives.run(), resource)

    def _spawn(self, coro: Awaitable[None], name: str) -> asyncio.Task[None]:
        task = asyncio.ensure_future(coro)
        task.set_name(f"k8s-{name}")
        task.add_done_callback(_log_crash)
        self._tasks.append(task)
        return task

    def _custom_call(self, group: str, version: str, plural: str) -> ListCall:
        def call(**params: Any) -> Awaitable[Any]:
            return self._custom.list_namespaced_custom_object(group, version, self.namespace, plural, **params)
        return call

    def _pod_call(self, **params: Any) -> Awaitable[Any]:
        return self._core.list_namespaced_pod(self.namespace, **params)

    def _api_failed(self, resource: str, exc: BaseException) -> None:
        message = describe(exc)
        if isinstance(exc, ApiError) and exc.code == 404 and resource.startswith("inferenceobjectives."):
            # One objective group missing is usual (a cluster has llm-d's CRD, GIE's, or both): its
            # objectives are simply absent; said once, at info, and checked again with backoff.
            group = resource.partition(".")[2]
            if self._objective_items[group]:  # the CRD went away: its objectives with it
                self._objective_items[group] = {}
                self._apply_objectives()
            if self._last_errors.get(resource) != "404":
                log.info("kubernetes discovery: the API server does not serve %s in namespace %s (its CRD is not "
                         "installed): no objectives of that group; checking again with backoff", resource,
                         self.namespace)
                self._last_errors[resource] = "404"
            return
        if isinstance(exc, ApiError) and exc.code == 404 and resource != "pods":
            message = (f"the API server does not serve {resource}.{self.pool_group} in namespace {self.namespace} "
                       f"(are the Gateway API Inference Extension CRDs installed?): {message}")
        if resource == "inferencepools":
            self.pool_error = message
        if self._last_errors.get(resource) != message:  # log each distinct problem once
            log.error("kubernetes discovery: %s: %s; retrying with backoff", resource, message)
            self._last_errors[resource] = message

    # -- the pool ----------------------------------------------------------------------------------
    def _pools_replaced(self, items: list[dict]) -> None:
        self._last_errors.pop("inferencepools", None)
        pool = next((p for p in items if (p.get("metadata") or {}).get("name") == self.pool_name), None)
        self._set_pool(pool)

    def _pool_event(self, kind: str, obj: dict) -> None:
        if (obj.get("metadata") or {}).get("name") != self.pool_name:
            return
        self._set_pool(None if kind == "DELETED" else obj)

    def _set_pool(self, pool: dict | None) -> None:
        if pool is None:
            self._unusable_pool(f"{self.pool_label} does not exist; not ready until it is created "
                                "(check --pool-name, --pool-namespace and --pool-group)")
            return
        try:
            view = pool_view_of(pool)
        except PoolSpecError as exc:
            self.pool_error = f"{self.pool_label}: {exc}; keeping the previous view"
            log.error("kubernetes discovery: %s", self.pool_error)
            return
        if view.app_protocol not in SUPPORTED_APP_PROTOCOLS:
            # As GIE: a pool whose protocol the request parser cannot read is not served at all.
            self._unusable_pool(f"{self.pool_label}: appProtocol {view.app_protocol!r} is not supported "
                                f"(the picker serves {sorted(SUPPORTED_APP_PROTOCOLS)}); not ready")
            return
        self.pool_error = None
        self._last_errors.pop("pool", None)
        old, self.view = self.view, view
        if old is None or (old.app_protocol, old.endpoint_picker) != (view.app_protocol, view.endpoint_picker):
            # Both are the gateway's business (its upstream codec, what it does while we are down);
            # logged so an operator can check the gateway was set up to match.
            ref = view.endpoint_picker
            log.info("kubernetes discovery: %s: appProtocol %s, %s", self.pool_label, view.app_protocol,
                     f"endpointPickerRef {ref.kind} {ref.name}:{ref.port} ({ref.failure_mode})" if ref
                     else "no endpointPickerRef")
        if old is None or old.selector != view.selector:
            log.info("kubernetes discovery: %s selects %s, target ports %s", self.pool_label,
                     view.selector_text(), list(view.target_ports))
            self._restart_pods()
        elif old.target_ports != view.target_ports:
            log.info("kubernetes discovery: %s target ports now %s", self.pool_label, list(view.target_ports))
            self._pod_specs = {name: pod_endpoints(pod, view) for name, pod in self._pods.items()}
            self._schedule_publish()

    def _unusable_pool(self, error: str) -> None:
        """No pool to serve: no endpoints (so not ready), and the reason logged once."""
        self.pool_error = error
        if self._last_errors.get("pool") != error:
            log.error("kubernetes discovery: %s", error)
            self._last_errors["pool"] = error
        self.view = None
        self._stop_pods()
        self._schedule_publish()

    # -- pods --------------------------------------------------------------------------------------
    def _restart_pods(self) -> None:
        """(Re)start the pod watch for the current selector; the old view serves until the new list."""
        assert self.view is not None
        selector = self.view.selector_text()
        if self._pod_task is not None and selector == self._pod_selector:
            return
        if self._pod_task is not None:
            self._pod_task.cancel()
        self._pod_selector = selector
        reflector = Reflector("pods", self._pod_call, on_replace=self._pods_replaced, on_event=self._pod_event,
                              metrics=self.metrics, on_error=lambda exc: self._api_failed("pods", exc),
                              label_selector=selector, watch_timeout_s=self.watch_timeout_s)
        self._pod_task = asyncio.ensure_future(reflector.run())
        self._pod_task.set_name("k8s-pods")
        self._pod_task.add_done_callback(_log_crash)

    def _stop_pods(self) -> None:
        if self._pod_task is not None:
            self._pod_task.cancel()
        self._pod_task = None
        self._pod_selector = None
        self._pods.clear()
        self._pod_specs.clear()
        self._pods_listed = False

    def _pods_replaced(self, items: list[dict]) -> None:
        self._last_errors.pop("pods", None)
        view = self.view
        if view is None:
            return
        self._pods = {p["metadata"]["name"]: p for p in items if (p.get("metadata") or {}).get("name")}
        self._pod_specs = {name: pod_endpoints(pod, view) for name, pod in self._pods.items()}
        self._pods_listed = True
        self._schedule_publish()

    def _pod_event(self, kind: str, pod: dict) -> None:
        name = (pod.get("metadata") or {}).get("name")
        if not name or self.view is None:
            return
        if kind == "DELETED":
            self._pods.pop(name, None)
            specs: tuple[EndpointSpec, ...] = ()
        else:
            self._pods[name] = pod
            specs = pod_endpoints(pod, self.view)
        if specs != self._pod_specs.get(name, ()):
            if specs:
                self._pod_specs[name] = specs
            else:
                self._pod_specs.pop(name, None)
            self._schedule_publish()

    # -- objectives --------------------------------------------------------------------------------
    def _objectives_replaced(self, group: str, items: list[dict]) -> None:
        self._last_errors.pop(f"inferenceobjectives.{group}", None)
        self._objective_items[group] = {o["metadata"]["name"]: o for o in items
                                        if (o.get("metadata") or {}).get("name")}
        self._apply_objectives()

    def _objective_event(self, group: str, kind: str, obj: dict) -> None:
        name = (obj.get("metadata") or {}).get("name")
        if not name:
            return
        if kind == "DELETED":
            self._objective_items[group].pop(name, None)
        else:
            self._objective_items[group][name] = obj
        self._apply_objectives()

    def _apply_objectives(self) -> None:
        assert self.objectives is not None and self.pool_name is not None
        live: dict[str, int] = {}
        source: dict[str, str] = {}
        for group, _ in OBJECTIVE_GROUPS:  # the first group holding a name wins it
            for name, obj in self._objective_items[group].items():
                priority = objective_priority(obj, self.pool_name, self.pool_group)
                if priority is None:
                    continue
                if name in live:
                    if name not in self._shadowed and len(self._shadowed) < 1000:  # warned once per name
                        self._shadowed.add(name)
                        log.warning("kubernetes discovery: InferenceObjective %s exists in %s and %s: the %s one's "
                                    "priority %d applies, the other's (%d) is ignored", name, source[name], group,
                                    source[name], live[name], priority)
                    continue
                live[name], source[name] = priority, group
        self.objectives.set_live(live)
        self.metrics.objectives.set(len(live))

    # -- publishing --------------------------------------------------------------------------------
    def _schedule_publish(self) -> None:
        # One registry update per loop turn: a burst of buffered watch events is applied as one view.
        if not self._publish_pending:
            self._publish_pending = True
            asyncio.get_running_loop().call_soon(self._publish_now)

    def _publish_now(self) -> None:
        self._publish_pending = False
        if self.view is None:
            self.metrics.synced.set(0)
            if self.registry.synced:  # the pool went away: no endpoints (and so not ready)
                self.registry.set_endpoints(())
                self.metrics.endpoints.set(0)
            return
        if not self._pods_listed:
            return
        specs = [spec for group in self._pod_specs.values() for spec in group]
        self.publish(specs)
        self.metrics.synced.set(1)
        self.metrics.endpoints.set(len(self.registry))
        self.metrics.pods.set(len(self._pods))

    def endpoint_specs(self) -> Iterable[EndpointSpec]:
        """The current view (what the registry was last given or is about to be)."""
        return [spec for group in self._pod_specs.values() for spec in group]
