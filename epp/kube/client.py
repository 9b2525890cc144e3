"""The Kubernetes API as the picker reads it: credentials, and collections kept in sync by list-then-watch.

The API is read with `kubernetes_asyncio` (config loading, auth, request building) in the
list-then-watch pattern of client-go's reflector: a full (paged) list gives the state and a
resourceVersion; a watch from there streams changes, with bookmarks; a closed or dropped watch
resumes from the last resourceVersion; 410 Gone relists; other errors back off. Responses are
read raw and decoded with msgspec, because building the library's model objects for every pod
costs more than the whole rest of discovery. Discovery and leader election both build on this.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec
from prometheus_client import CollectorRegistry, Counter

log = logging.getLogger(__name__)

# Pages of a full list: bounded memory and decode time per step on the event loop.
LIST_PAGE_SIZE = 500
RESTART_REASONS = ("closed", "expired", "error")

_decode = msgspec.json.Decoder().decode


class KubernetesError(ValueError):
    """Kubernetes cannot be used (bad discovery flags or no usable cluster credentials); the message says why."""


class ApiError(Exception):
    """A non-2xx answer or an ERROR watch event from the API server, with its `Status`."""

    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(f"{code} {reason}: {message}" if reason else f"{code}: {message}")
        self.code = code
        self.reason = reason
        self.message = message


class ResourceExpired(ApiError):
    """410 Gone: the resourceVersion is older than the server keeps history for; relist."""




class WatchMetrics:
    """Lists, watch events and watch restarts of every reflector, on the picker's registry."""

    def __init__(self, registry: CollectorRegistry | None) -> None:
        r = registry or CollectorRegistry()
        self.registry = r
        self.watch_restarts = Counter(
            "epp_kubernetes_watch_restarts", "Watches restarted, by resource and reason "
            "(closed: server ended it, resumed; expired: 410 Gone, relisted; error: API or connection error).",
            ["resource", "reason"], registry=r)
        self.lists = Counter("epp_kubernetes_lists", "Full lists, by resource.", ["resource"], registry=r)
        self.events = Counter("epp_kubernetes_watch_events", "Watch events, by resource and type.",
                              ["resource", "type"], registry=r)


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
                 on_event: Callable[[str, dict], None], metrics: WatchMetrics,
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
                    log.warning("%s: %s; retrying", self.resource, describe(exc))
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


def describe(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


async def load_api_client(kubeconfig: str | None = None, context: str | None = None) -> Any:
    """An ApiClient from `kubeconfig`, else the in-cluster service account, else `$KUBECONFIG`
    or `~/.kube/config`."""
    try:
        from kubernetes_asyncio import client, config
    except ImportError:
        raise KubernetesError(
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
        raise KubernetesError(
            f"no usable Kubernetes credentials (not in a cluster; kubeconfig {where}): {exc}") from None
    return client.ApiClient(configuration=configuration)


# ---- discovery ---------------------------------------------------------------------------------
