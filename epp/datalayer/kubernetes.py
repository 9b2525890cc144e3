"""Kubernetes discovery: an `InferencePool` (or a standalone label selector) and its Ready pods
become endpoints; `InferenceObjective`s give the priority of `x-gateway-inference-objective`.

The API is read with `kubernetes_asyncio` (config loading, auth, request building) in the
list-then-watch pattern of client-go's reflector: a full (paged) list gives the state and a
resourceVersion; a watch from there streams changes, with bookmarks; a closed or dropped watch
resumes from the last resourceVersion; 410 Gone relists; other errors back off. Responses are
read raw and decoded with msgspec, because building the library's model objects for every pod
costs more than the whole rest of discovery.

Endpoint labels come from pod metadata: every pod label, plus every annotation under
`llm-epp.io/` with that prefix stripped (e.g. `llm-epp.io/kv-events-port: "5557"` becomes the
label `kv-events-port`), plus `llm-epp.io/pod` and `llm-epp.io/endpoint` (`<pod>-rank-<i>`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar, overload

import msgspec
from prometheus_client import CollectorRegistry, Counter, Gauge

from epp.datalayer.discovery import Discovery
from epp.datalayer.registry import EndpointRegistry, EndpointSpec

log = logging.getLogger(__name__)
T = TypeVar("T")

POOL_GROUP = "inference.networking.k8s.io"
POOL_GROUP_ALPHA = "inference.networking.x-k8s.io"
OBJECTIVE_GROUP = "inference.networking.x-k8s.io"
OBJECTIVE_VERSION = "v1alpha2"
ACTIVE_PORTS_ANNOTATION = "inference.networking.k8s.io/active-ports"
ANNOTATION_PREFIX = "llm-epp.io/"
LABEL_POD = "llm-epp.io/pod"
LABEL_ENDPOINT = "llm-epp.io/endpoint"
# Pages of a full list: bounded memory and decode time per step on the event loop.
LIST_PAGE_SIZE = 500
RESTART_REASONS = ("closed", "expired", "error")
# The openai-parser reads HTTP/1.1 or HTTP/2 OpenAI bodies; `kubernetes.io/h2c` pools are vLLM gRPC.
SUPPORTED_APP_PROTOCOLS = frozenset({"http"})

_decode = msgspec.json.Decoder().decode


class KubernetesDiscoveryError(ValueError):
    """Discovery cannot start (bad flags or no usable cluster credentials); the message says why."""


class ApiError(Exception):
    """A non-2xx answer or an ERROR watch event from the API server, with its `Status`."""

    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(f"{code} {reason}: {message}" if reason else f"{code}: {message}")
        self.code = code
        self.reason = reason
        self.message = message


class ResourceExpired(ApiError):
    """410 Gone: the resourceVersion is older than the server keeps history for; relist."""


# ---- pure mapping from API objects to endpoints -------------------------------------------------


@dataclass(frozen=True)
class PoolView:
    """What decides the pool's endpoints: a label selector and the target ports (rank order)."""

    selector: Mapping[str, str]
    target_ports: tuple[int, ...]
    app_protocol: str = "http"

    def selector_text(self) -> str:
        """The selector as the API's `labelSelector` query (`k=v,k=v`)."""
        return ",".join(f"{k}={v}" for k, v in sorted(self.selector.items()))


def parse_selector(text: str) -> dict[str, str]:
    """`app=x,tier=y` (equality only, as GIE's `--endpoint-selector`) into a label mapping."""
    selector: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, eq, value = part.partition("=")
        key, value = key.strip(), value.strip().lstrip("=")
        if not eq or not key or "!" in key:
            raise KubernetesDiscoveryError(
                f"--endpoint-selector: {part!r} is not key=value (only equality selectors are supported)")
        selector[key] = value
    if not selector:
        raise KubernetesDiscoveryError("--endpoint-selector: at least one key=value is required")
    return selector


def parse_target_ports(text: str) -> tuple[int, ...]:
    """`8000[,8001]` into ports; 1-8 distinct ports, as InferencePool `targetPorts` allows."""
    ports: list[int] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        if not part.isdigit() or not 0 < int(part) < 65536:
            raise KubernetesDiscoveryError(f"--endpoint-target-ports: {part!r} is not a port 1-65535")
        ports.append(int(part))
    _check_ports(ports, "--endpoint-target-ports", KubernetesDiscoveryError)
    return tuple(ports)


def _check_ports(ports: Sequence[int], where: str, error: type[Exception]) -> None:
    if not 1 <= len(ports) <= 8:
        raise error(f"{where}: 1 to 8 ports are required, got {len(ports)}")
    if len(set(ports)) != len(ports):
        raise error(f"{where}: ports must be distinct, got {list(ports)}")


class PoolSpecError(ValueError):
    """An InferencePool whose spec cannot be used; the message names the field."""


def pool_view_of(pool: Mapping[str, Any]) -> PoolView:
    """The view of an InferencePool object: v1 (`selector.matchLabels`, `targetPorts[].number`)
    or v1alpha2 (`selector` map, `targetPortNumber`)."""
    spec = pool.get("spec")
    if not isinstance(spec, Mapping):
        raise PoolSpecError("spec: missing")
    raw_selector = spec.get("selector")
    if isinstance(raw_selector, Mapping) and "matchLabels" in raw_selector:
        raw_selector = raw_selector.get("matchLabels")
    if not isinstance(raw_selector, Mapping) or not raw_selector or \
            not all(isinstance(k, str) and isinstance(v, str) for k, v in raw_selector.items()):
        raise PoolSpecError("spec.selector.matchLabels: must map label names to values (non-empty)")
    if "targetPorts" in spec:
        entries = spec.get("targetPorts")
        if not isinstance(entries, list) or not all(
                isinstance(e, Mapping) and _is_port(e.get("number")) for e in entries):
            raise PoolSpecError("spec.targetPorts: must be a list of {number: 1-65535}")
        ports = [int(e["number"]) for e in entries]
    elif _is_port(spec.get("targetPortNumber")):
        ports = [int(spec["targetPortNumber"])]
    else:
        raise PoolSpecError("spec.targetPorts: missing")
    _check_ports(ports, "spec.targetPorts", PoolSpecError)
    protocol = spec.get("appProtocol") or "http"
    return PoolView(dict(raw_selector), tuple(ports), str(protocol))


def _is_port(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 < value < 65536


def pod_is_ready(pod: Mapping[str, Any]) -> bool:
    """Ready condition True, an IP, and not terminating."""
    meta = pod.get("metadata") or {}
    if meta.get("deletionTimestamp"):
        return False
    status = pod.get("status") or {}
    if not status.get("podIP"):
        return False
    for condition in status.get("conditions") or ():
        if isinstance(condition, Mapping) and condition.get("type") == "Ready":
            return condition.get("status") == "True"
    return False


def _active_ports(annotations: Mapping[str, Any]) -> frozenset[int] | None:
    text = annotations.get(ACTIVE_PORTS_ANNOTATION)
    if not isinstance(text, str):
        return None
    ports = {int(p) for p in (q.strip() for q in text.split(",")) if p.isdigit()}
    return frozenset(ports)


def pod_endpoints(pod: Mapping[str, Any], view: PoolView) -> tuple[EndpointSpec, ...]:
    """The endpoints of one pod: none unless Ready and selected; else one per (active) target port."""
    if not pod_is_ready(pod):
        return ()
    meta = pod.get("metadata") or {}
    labels = meta.get("labels") or {}
    if any(labels.get(k) != v for k, v in view.selector.items()):
        return ()
    annotations = meta.get("annotations") or {}
    name = str(meta.get("name", ""))
    base = {str(k): str(v) for k, v in labels.items()}
    for key, value in annotations.items():
        if isinstance(key, str) and key.startswith(ANNOTATION_PREFIX) and isinstance(value, str):
            base[key[len(ANNOTATION_PREFIX):]] = value
    base[LABEL_POD] = name
    active = _active_ports(annotations)
    address = str(pod["status"]["podIP"])
    specs = []
    for rank, port in enumerate(view.target_ports):
        if active is not None and port not in active:
            continue
        specs.append(EndpointSpec(address, port, {**base, LABEL_ENDPOINT: f"{name}-rank-{rank}"}))
    return tuple(specs)


# ---- objectives ---------------------------------------------------------------------------------


class ObjectivePriorities(Mapping[str, int]):
    """Objective name → priority: the cluster's `InferenceObjective`s over the config's static map."""

    def __init__(self, static: Mapping[str, int] | None = None) -> None:
        self.static = dict(static or {})
        self._live: dict[str, int] = {}
        self._merged = dict(self.static)

    def set_live(self, priorities: Mapping[str, int]) -> None:
        """Replace the cluster's objectives (a full view)."""
        self._live = dict(priorities)
        self._merged = {**self.static, **self._live}

    @property
    def live(self) -> Mapping[str, int]:
        return self._live

    @overload
    def get(self, name: str, /) -> int | None: ...

    @overload
    def get(self, name: str, /, default: int | T) -> int | T: ...

    def get(self, name: str, /, default: object = None) -> object:
        """The priority of objective `name`, or `default` (a dict lookup: no KeyError on a miss)."""
        return self._merged.get(name, default)

    def __getitem__(self, name: str) -> int:
        return self._merged[name]

    def __iter__(self):
        return iter(self._merged)

    def __len__(self) -> int:
        return len(self._merged)


def objective_priority(objective: Mapping[str, Any], pool_name: str, pool_group: str) -> int | None:
    """The priority of an InferenceObjective that refers to this pool, else None."""
    spec = objective.get("spec") or {}
    ref = spec.get("poolRef") or {}
    if ref.get("name") != pool_name or ref.get("group", pool_group) not in (pool_group, "", None):
        return None
    priority = spec.get("priority", 0)
    if isinstance(priority, bool) or not isinstance(priority, int):
        return 0
    return priority


# ---- metrics -----------------------------------------------------------------------------------


class KubernetesMetrics:
    """Watch restarts, discovered endpoints and sync state, on the picker's registry."""

    def __init__(self, registry: CollectorRegistry | None) -> None:
        r = registry or CollectorRegistry()
        self.watch_restarts = Counter(
            "epp_kubernetes_watch_restarts", "Watches restarted, by resource and reason "
            "(closed: server ended it, resumed; expired: 410 Gone, relisted; error: API or connection error).",
            ["resource", "reason"], registry=r)
        self.lists = Counter("epp_kubernetes_lists", "Full lists, by resource.", ["resource"], registry=r)
        self.events = Counter("epp_kubernetes_watch_events", "Watch events, by resource and type.",
                              ["resource", "type"], registry=r)
        self.endpoints = Gauge("epp_kubernetes_discovered_endpoints",
                               "Endpoints discovered from Ready pods of the pool.", registry=r)
        self.pods = Gauge("epp_kubernetes_discovered_pods", "Pods seen by the selector (Ready or not).",
                          registry=r)
        self.synced = Gauge("epp_kubernetes_pool_synced",
                            "1 once the pool exists and its pods were fully listed.", registry=r)
        self.objectives = Gauge("epp_kubernetes_objectives", "InferenceObjectives of this pool.", registry=r)


# ---- list-then-watch ---------------------------------------------------------------------------

ListCall = Callable[..., Awaitable[Any]]


@dataclass
class Backoff:
    """Exponential backoff with jitter between failed API calls."""

    initial: float = 0.2
    maximum: float = 10.0
    _next: float = field(default=0.0, init=False)

    def reset(self) -> None:
        self._next = 0.0

    async def sleep(self) -> None:
        self._next = min(self.maximum, self._next * 2 if self._next else self.initial)
        await asyncio.sleep(self._next * random.uniform(0.8, 1.2))


class Reflector:
    """Keeps a local copy of one collection in sync: list, then watch from its resourceVersion.

    `on_replace(items)` gets every full list (the copy is replaced as a whole, so a relist after
    410 neither loses nor duplicates anything); `on_event(type, obj)` gets ADDED/MODIFIED/DELETED.
    `call(**params)` is a kubernetes_asyncio list method with its path arguments bound.
    """

    def __init__(self, resource: str, call: ListCall, *, on_replace: Callable[[list[dict]], None],
                 on_event: Callable[[str, dict], None], metrics: KubernetesMetrics,
                 on_error: Callable[[ApiError | Exception], None] | None = None,
                 label_selector: str | None = None, field_selector: str | None = None,
                 watch_timeout_s: int = 300, backoff: Backoff | None = None) -> None:
        self.resource = resource
        self.call = call
        self.on_replace = on_replace
        self.on_event = on_event
        self.on_error = on_error
        self.metrics = metrics
        self.selectors: dict[str, str] = {}
        if label_selector:
            self.selectors["label_selector"] = label_selector
        if field_selector:
            self.selectors["field_selector"] = field_selector
        self.watch_timeout_s = watch_timeout_s
        self.backoff = backoff or Backoff()
        self.resource_version: str | None = None

    async def run(self) -> None:
        """List and watch until cancelled; never returns on API errors."""
        import aiohttp

        while True:
            try:
                if self.resource_version is None:
                    items, self.resource_version = await self._list()
                    self.metrics.lists.labels(self.resource).inc()
                    self.on_replace(items)
                    self.backoff.reset()
                opened = time.monotonic()
                await self._watch()
                self.metrics.watch_restarts.labels(self.resource, "closed").inc()
                if time.monotonic() - opened < 1.0:  # closed at once (a proxy?): do not spin
                    await self.backoff.sleep()
            except ResourceExpired:
                log.info("%s: resourceVersion %s expired (410 Gone); relisting", self.resource,
                         self.resource_version)
                self.metrics.watch_restarts.labels(self.resource, "expired").inc()
                self.resource_version = None
            except (TimeoutError, ApiError, aiohttp.ClientError, msgspec.DecodeError, ValueError) as exc:
                self.metrics.watch_restarts.labels(self.resource, "error").inc()
                if self.on_error is not None:
                    self.on_error(exc)
                else:
                    log.warning("%s: %s; retrying", self.resource, _describe(exc))
                await self.backoff.sleep()

    async def _list(self) -> tuple[list[dict], str]:
        items: list[dict] = []
        token: str | None = None
        while True:
            params: dict[str, Any] = {"limit": LIST_PAGE_SIZE, **self.selectors}
            if token:
                params["_continue"] = token
            body = await self._request(params, timeout=60)
            page = _decode(body)
            if page.get("kind") == "Status":
                raise _status_error(page)
            items.extend(page.get("items") or ())
            meta = page.get("metadata") or {}
            token = meta.get("continue")
            if not token:
                return items, str(meta.get("resourceVersion", ""))

    async def _request(self, params: dict[str, Any], timeout: float) -> bytes:
        response = await self.call(**params, _preload_content=False, _request_timeout=timeout)
        try:
            body = await response.read()
        finally:
            response.release()
        if not 200 <= response.status < 300:
            raise _http_error(response.status, body)
        return body

    async def _watch(self) -> None:
        # The server ends the watch after timeoutSeconds; the read timeout catches dead connections.
        timeout = (10, self.watch_timeout_s + 30)
        response = await self.call(watch=True, resource_version=self.resource_version,
                                   allow_watch_bookmarks=True, timeout_seconds=self.watch_timeout_s,
                                   _preload_content=False, _request_timeout=timeout, **self.selectors)
        try:
            if not 200 <= response.status < 300:
                raise _http_error(response.status, await response.read())
            while True:
                line = await response.content.readline()
                if not line:
                    return
                if line.strip():
                    self._apply(_decode(line))
        finally:
            response.release()

    def _apply(self, event: Mapping[str, Any]) -> None:
        kind = event.get("type")
        obj = event.get("object") or {}
        if kind == "ERROR":
            raise _status_error(obj)
        version = (obj.get("metadata") or {}).get("resourceVersion")
        self.metrics.events.labels(self.resource, str(kind)).inc()
        if kind in ("ADDED", "MODIFIED", "DELETED"):
            self.on_event(kind, obj)
        elif kind != "BOOKMARK":
            raise ValueError(f"unknown watch event type {kind!r}")
        if version:
            self.resource_version = str(version)
        self.backoff.reset()


def _status_error(status: Mapping[str, Any]) -> ApiError:
    code = int(status.get("code") or 0)
    cls = ResourceExpired if code == 410 else ApiError
    return cls(code, str(status.get("reason") or ""), str(status.get("message") or ""))


def _http_error(code: int, body: bytes) -> ApiError:
    try:
        status = _decode(body)
    except msgspec.DecodeError:
        status = None
    if isinstance(status, Mapping) and status.get("kind") == "Status":
        status = {**status, "code": status.get("code") or code}
        return _status_error(status)
    cls = ResourceExpired if code == 410 else ApiError
    return cls(code, "", body[:200].decode("utf-8", "replace"))


def _log_crash(task: asyncio.Task[None]) -> None:
    # A reflector only ends by cancellation; anything else is a bug that must not pass silently.
    if not task.cancelled() and task.exception() is not None:
        log.error("kubernetes discovery: %s stopped", task.get_name(), exc_info=task.exception())


def _describe(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


# ---- client ------------------------------------------------------------------------------------


async def load_api_client(kubeconfig: str | None = None, context: str | None = None) -> Any:
    """An ApiClient from `kubeconfig`, else the in-cluster service account, else `$KUBECONFIG`
    or `~/.kube/config`."""
    try:
        from kubernetes_asyncio import client, config
    except ImportError:
        raise KubernetesDiscoveryError(
            "Kubernetes discovery needs the 'kubernetes' extra: pip install 'llm-epp[kubernetes]'") from None
    configuration = client.Configuration()
    try:
        if kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
            config.load_incluster_config(client_configuration=configuration)
        else:
            await config.load_kube_config(config_file=kubeconfig, context=context,
                                          client_configuration=configuration)
    except (config.ConfigException, OSError, TypeError, ValueError) as exc:
        where = kubeconfig or os.environ.get("KUBECONFIG") or "~/.kube/config"
        raise KubernetesDiscoveryError(
            f"no usable Kubernetes credentials (not in a cluster; kubeconfig {where}): {exc}") from None
    return client.ApiClient(configuration=configuration)


# ---- discovery ---------------------------------------------------------------------------------


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
            raise KubernetesDiscoveryError("either --pool-name or --endpoint-selector is required")
        if pool_name and selector:
            raise KubernetesDiscoveryError("--pool-name and --endpoint-selector exclude each other")
        if selector and not target_ports:
            raise KubernetesDiscoveryError("--endpoint-selector needs --endpoint-target-ports")
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
        self._objective_items: dict[str, dict] = {}

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
                    objectives = Reflector(
                        "inferenceobjectives",
                        self._custom_call(OBJECTIVE_GROUP, OBJECTIVE_VERSION, "inferenceobjectives"),
                        on_replace=self._objectives_replaced, on_event=self._objective_event,
                        metrics=self.metrics, on_error=lambda exc: self._api_failed("inferenceobjectives", exc),
                        watch_timeout_s=self.watch_timeout_s, backoff=Backoff(1.0, 60.0))
                    self._spawn(objectives.run(), "inferenceobjectives")
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
        message = _describe(exc)
        if isinstance(exc, ApiError) and exc.code == 404 and resource != "pods":
            group = OBJECTIVE_GROUP if resource == "inferenceobjectives" else self.pool_group
            message = (f"the API server does not serve {resource}.{group} in namespace {self.namespace} "
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
                                f"(the picker parses {sorted(SUPPORTED_APP_PROTOCOLS)}); not ready")
            return
        self.pool_error = None
        self._last_errors.pop("pool", None)
        old, self.view = self.view, view
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
    def _objectives_replaced(self, items: list[dict]) -> None:
        self._last_errors.pop("inferenceobjectives", None)
        self._objective_items = {o["metadata"]["name"]: o for o in items if (o.get("metadata") or {}).get("name")}
        self._apply_objectives()

    def _objective_event(self, kind: str, obj: dict) -> None:
        name = (obj.get("metadata") or {}).get("name")
        if not name:
            return
        if kind == "DELETED":
            self._objective_items.pop(name, None)
        else:
            self._objective_items[name] = obj
        self._apply_objectives()

    def _apply_objectives(self) -> None:
        assert self.objectives is not None and self.pool_name is not None
        live = {}
        for name, obj in self._objective_items.items():
            priority = objective_priority(obj, self.pool_name, self.pool_group)
            if priority is not None:
                live[name] = priority
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
