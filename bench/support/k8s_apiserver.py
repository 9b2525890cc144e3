"""A local Kubernetes API server for tests and benchmarks: the list/watch wire protocol over HTTP, nothing more.

It serves the real paths (`/api/v1/namespaces/{ns}/pods`,
`/apis/{group}/{version}/namespaces/{ns}/{plural}`) as kube-apiserver does:
- list: `{kind: XList, metadata: {resourceVersion, continue?}, items}`, with `labelSelector`
  (=, ==, !=), `fieldSelector` (metadata.name, metadata.namespace), `limit`/`continue` paging
  served from a snapshot taken at the first page (an expired continue token is 410 Gone);
- watch (`watch=1&resourceVersion=..&allowWatchBookmarks=true&timeoutSeconds=..`): a chunked
  stream of newline-delimited `{"type": ADDED|MODIFIED|DELETED|BOOKMARK|ERROR, "object": ...}`
  replaying history after the given resourceVersion, then live; an object leaving (entering) a
  label selector is DELETED (ADDED) for that watcher; a resourceVersion older than the compacted
  history gets one ERROR event with a 410 `Status` (reason Expired);
- get (GET on the item), create (POST on the collection, 409 if it exists), replace (PUT on the
  item, 409 Conflict when its metadata.resourceVersion is not the stored one), delete (DELETE);
- bearer-token auth (401 `Status`), 404 `Status` for resources it does not serve;
- TokenReview (`POST /apis/authentication.k8s.io/v1/tokenreviews`): the tokens of `review_tokens`
  are authenticated as their user, any other is not; SubjectAccessReview
  (`POST /apis/authorization.k8s.io/v1/subjectaccessreviews`): a non-resource `get` of a path in
  `readable_paths` is allowed to the users in `metrics_readers`, anything else is denied. By default
  `READER_TOKEN` may read /metrics, `STRANGER_TOKEN` is authenticated but may not, and any other
  token is refused; `reviews` counts the calls, by kind.
Tests in the same process change objects with `apply()`/`delete()` and inject faults with
`drop_watches()`, `compact()` and `fail_next()`; a benchmark in another process uses the HTTP verbs.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import itertools
import json
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from epp.netutil import free_ports

POOLS = ("inference.networking.k8s.io", "v1", "inferencepools", "InferencePool")
POOLS_ALPHA = ("inference.networking.x-k8s.io", "v1alpha2", "inferencepools", "InferencePool")
OBJECTIVES = ("inference.networking.x-k8s.io", "v1alpha2", "inferenceobjectives", "InferenceObjective")
OBJECTIVES_LLMD = ("llm-d.ai", "v1alpha2", "inferenceobjectives", "InferenceObjective")  # llm-d's current group
PODS = ("", "v1", "pods", "Pod")
LEASES = ("coordination.k8s.io", "v1", "leases", "Lease")

# The API double's review tokens (`FakeApiServer.review_tokens`): one the API accepts and whose user
# may read /metrics, one it accepts whose user may not; any other token it does not accept.
READER_TOKEN = "reader-token"
READER_USER = "system:serviceaccount:monitoring:prometheus"
STRANGER_TOKEN = "stranger-token"
STRANGER_USER = "system:serviceaccount:default:stranger"


@dataclass
class _Event:
    rv: int
    type: str
    obj: dict
    old: dict | None
    resource: tuple[str, str]  # (group, plural): a resumed watch replays its own collection's events only


@dataclass
class _Watcher:
    resource: tuple[str, str, str, str]
    namespace: str
    labels: list[tuple[str, str, str]]
    fields: dict[str, str]
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    request: web.Request | None = None


# The API server parses boolean query parameters with Go's strconv.ParseBool.
_TRUE = frozenset({"1", "t", "T", "TRUE", "true", "True"})


def status(code: int, reason: str, message: str) -> dict:
    """A `Status` object as the API server sends with errors."""
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": message, "reason": reason, "code": code}


def parse_label_selector(text: str) -> list[tuple[str, str, str]]:
    """`a=b,c==d,e!=f` into (key, op, value) triples."""
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        for op in ("!=", "==", "="):
            if op in part:
                key, value = part.split(op, 1)
                out.append((key.strip(), "!=" if op == "!=" else "=", value.strip()))
                break
        else:
            raise ValueError(f"unsupported label selector term {part!r}")
    return out


def labels_match(obj: Mapping[str, Any] | None, terms: Iterable[tuple[str, str, str]]) -> bool:
    if obj is None:
        return False
    labels = (obj.get("metadata") or {}).get("labels") or {}
    return all((labels.get(k) == v) == (op == "=") for k, op, v in terms)


def fields_match(obj: Mapping[str, Any] | None, fields: Mapping[str, str]) -> bool:
    if obj is None:
        return False
    meta = obj.get("metadata") or {}
    return all(meta.get(path.split(".", 1)[1]) == value for path, value in fields.items())


class FakeApiServer:
    """The API server's list/watch protocol for pods, InferencePools and InferenceObjectives."""

    def __init__(self, *, token: str = "test-token",
                 resources: Iterable[tuple[str, str, str, str]] = (PODS, POOLS, POOLS_ALPHA, OBJECTIVES,
                                                                   OBJECTIVES_LLMD, LEASES),
                 bookmark_interval: float = 0.5) -> None:
        self.token = token
        self.resources = {(g, v, p): (g, v, p, k) for g, v, p, k in resources}
        self.bookmark_interval = bookmark_interval
        self.port = free_ports(1)[0]
        self.rv = 1000
        self.compacted_rv = 0
        self.objects: dict[tuple[str, str], dict[tuple[str, str], dict]] = {}
        self.history: list[_Event] = []
        self.watchers: list[_Watcher] = []
        self.requests: list[tuple[str, dict[str, str]]] = []
        self._failures: list[tuple[int, str]] = []
        self._snapshots: dict[str, tuple[int, list[dict]]] = {}
        self._compact_after_page = False
        self._uids = itertools.count(1)
        self._runner: web.AppRunner | None = None
        # TokenReview: token -> user; SubjectAccessReview: who may `get` which non-resource paths.
        self.review_tokens: dict[str, dict[str, Any]] = {
            READER_TOKEN: {"username": READER_USER, "uid": "uid-prometheus",
                           "groups": ["system:serviceaccounts", "system:authenticated"]},
            STRANGER_TOKEN: {"username": STRANGER_USER, "uid": "uid-stranger",
                             "groups": ["system:serviceaccounts", "system:authenticated"]}}
        self.metrics_readers: set[str] = {READER_USER}
        self.readable_paths: set[str] = {"/metrics"}
        self.reviews: dict[str, int] = {"TokenReview": 0, "SubjectAccessReview": 0}

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/api/{version}/namespaces/{namespace}/{plural}", self._core)
        app.router.add_get("/apis/{group}/{version}/namespaces/{namespace}/{plural}", self._grouped)
        app.router.add_get("/api/{version}/namespaces/{namespace}/{plural}/{name}", self._object)
        app.router.add_get("/apis/{group}/{version}/namespaces/{namespace}/{plural}/{name}", self._object)
        app.router.add_post("/api/{version}/namespaces/{namespace}/{plural}", self._object)
        app.router.add_put("/api/{version}/namespaces/{namespace}/{plural}/{name}", self._object)
        app.router.add_delete("/api/{version}/namespaces/{namespace}/{plural}/{name}", self._object)
        app.router.add_post("/apis/{group}/{version}/namespaces/{namespace}/{plural}", self._object)
        app.router.add_put("/apis/{group}/{version}/namespaces/{namespace}/{plural}/{name}", self._object)
        app.router.add_delete("/apis/{group}/{version}/namespaces/{namespace}/{plural}/{name}", self._object)
        app.router.add_post("/apis/authentication.k8s.io/v1/tokenreviews", self._token_review)
        app.router.add_post("/apis/authorization.k8s.io/v1/subjectaccessreviews", self._access_review)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    async def stop(self) -> None:
        self.drop_watches()
        if self._runner is not None:
            await self._runner.cleanup()

    def write_kubeconfig(self, path: str, namespace: str = "default", token: str | None = None) -> str:
        """A kubeconfig pointing at this server with a bearer token; returns its path."""
        import yaml

        doc = {
            "apiVersion": "v1", "kind": "Config", "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "picker", "user": {"token": token or self.token}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "picker", "namespace": namespace}}],
        }
        with open(path, "w", encoding="utf-8") as handle:
            yaml.safe_dump(doc, handle)
        return path

    # ---- changes made by tests ------------------------------------------------------------------
    def apply(self, obj: Mapping[str, Any]) -> dict:
        """Create or replace an object (by apiVersion/kind, namespace, name); returns the stored copy."""
        resource = self._resource_of(obj)
        stored = copy.deepcopy(dict(obj))
        meta = stored.setdefault("metadata", {})
        meta.setdefault("namespace", "default")
        key = (meta["namespace"], meta["name"])
        bucket = self.objects.setdefault(resource[:3:2], {})
        old = bucket.get(key)
        self.rv += 1
        meta["resourceVersion"] = str(self.rv)
        meta["uid"] = (old or {}).get("metadata", {}).get("uid") or f"uid-{next(self._uids)}"
        meta.setdefault("creationTimestamp", time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        bucket[key] = stored
        self._record(resource, "MODIFIED" if old else "ADDED", stored, old)
        return stored

    def delete(self, obj: Mapping[str, Any]) -> None:
        """Delete an object (identified as in `apply`); unknown objects are ignored."""
        resource = self._resource_of(obj)
        meta = obj["metadata"]
        key = (meta.get("namespace", "default"), meta["name"])
        old = self.objects.get(resource[:3:2], {}).pop(key, None)
        if old is None:
            return
        self.rv += 1
        gone = copy.deepcopy(old)
        gone["metadata"]["resourceVersion"] = str(self.rv)
        self._record(resource, "DELETED", gone, old)

    def get(self, obj: Mapping[str, Any]) -> dict | None:
        resource = self._resource_of(obj)
        meta = obj["metadata"]
        return self.objects.get(resource[:3:2], {}).get((meta.get("namespace", "default"), meta["name"]))

    # ---- faults -----------------------------------------------------------------------------------
    def drop_watches(self) -> int:
        """Cut every open watch connection abruptly (no end of stream); returns how many."""
        count = 0
        for watcher in list(self.watchers):
            if watcher.request is not None and watcher.request.transport is not None:
                watcher.request.transport.abort()
                count += 1
            watcher.queue.put_nowait(None)
        self.watchers.clear()
        return count

    def compact(self) -> None:
        """Forget all history: a watch or continue token from an older resourceVersion gets 410."""
        self.compacted_rv = self.rv
        self.history.clear()
        self._snapshots.clear()

    def expire_continue_tokens(self) -> None:
        """Compact once the next paged list has handed out its first continue token."""
        self._compact_after_page = True

    def fail_next(self, count: int, code: int = 500) -> None:
        """The next `count` requests get `code` with a Status body."""
        reason = {500: "InternalError", 503: "ServiceUnavailable", 429: "TooManyRequests"}.get(code, "Failure")
        self._failures.extend([(code, reason)] * count)

    def watch_requests(self) -> list[dict[str, str]]:
        return [q for _, q in self.requests if q.get("watch") in _TRUE]

    def list_requests(self, plural: str) -> list[dict[str, str]]:
        return [q for p, q in self.requests if p.endswith("/" + plural) and q.get("watch") not in _TRUE]

    # ---- internals -------------------------------------------------------------------------------
    def _resource_of(self, obj: Mapping[str, Any]) -> tuple[str, str, str, str]:
        api_version, kind = obj["apiVersion"], obj["kind"]
        group, _, version = api_version.rpartition("/")
        for resource in self.resources.values():
            if resource[0] == group and resource[1] == version and resource[3] == kind:
                return resource
        for g, v, p, k in (PODS, POOLS, POOLS_ALPHA, OBJECTIVES, OBJECTIVES_LLMD, LEASES):  # kinds not served
            if g == group and v == version and k == kind:
                return g, v, p, k
        raise KeyError(f"no resource for {api_version} {kind}")

    def _record(self, resource: tuple[str, str, str, str], kind: str, obj: dict, old: dict | None) -> None:
        event = _Event(self.rv, kind, obj, old, resource[:3:2])
        self.history.append(event)
        for watcher in self.watchers:
            if watcher.resource[:3:2] == resource[:3:2]:
                watcher.queue.put_nowait(event)

    def _typed(self, resource: tuple[str, str, str, str], obj: dict) -> dict:
        group, version, _, kind = resource
        return {"apiVersion": f"{group}/{version}" if group else version, "kind": kind,
                **{k: v for k, v in obj.items() if k not in ("apiVersion", "kind")}}

    def _event_for(self, watcher: _Watcher, event: _Event) -> dict | None:
        """What `watcher` sees of `event` (selector transitions become ADDED/DELETED), or None."""
        def visible(obj):
            return obj is not None and (obj.get("metadata") or {}).get("namespace") == watcher.namespace \
                and labels_match(obj, watcher.labels) and fields_match(obj, watcher.fields)
        now, before = visible(event.obj) and event.type != "DELETED", visible(event.old)
        if event.type == "DELETED":
            kind = "DELETED" if before else None
        elif now and before:
            kind = "MODIFIED"
        elif now:
            kind = "ADDED"
        elif before:
            kind = "DELETED"
        else:
            kind = None
        if kind is None:
            return None
        return {"type": kind, "object": self._typed(watcher.resource, event.obj)}

    async def _object(self, request: web.Request) -> web.Response:
        if request.headers.get("Authorization") != f"Bearer {self.token}":
            return web.json_response(status(401, "Unauthorized", "Unauthorized"), status=401)
        info = request.match_info
        resource = self.resources.get((info.get("group", ""), info["version"], info["plural"]))
        if resource is None:
            return web.json_response(
                status(404, "NotFound", "the server could not find the requested resource"), status=404)
        namespace = info["namespace"]
        if request.method in ("DELETE", "GET"):
            key = {"apiVersion": f"{resource[0]}/{resource[1]}".lstrip("/"), "kind": resource[3],
                   "metadata": {"name": info["name"], "namespace": namespace}}
            if self.get(key) is None:
                return web.json_response(status(404, "NotFound", f'{info["plural"]} "{info["name"]}" not found'),
                                         status=404)
            if request.method == "GET":
                return web.json_response(self._typed(resource, self.get(key)))
            self.delete(key)
            return web.json_response(status(200, "", "deleted") | {"status": "Success"})
        obj = await request.json()
        obj.setdefault("metadata", {})["namespace"] = namespace
        exists = self.get(obj) is not None
        if request.method == "POST" and exists:
            return web.json_response(status(409, "AlreadyExists", f'"{obj["metadata"]["name"]}" already exists'),
                                     status=409)
        if request.method == "PUT" and (not exists or obj["metadata"]["name"] != info["name"]):
            return web.json_response(status(404, "NotFound", f'{info["plural"]} "{info["name"]}" not found'),
                                     status=404)
        wanted = obj["metadata"].get("resourceVersion")
        if request.method == "PUT" and wanted and wanted != self.get(obj)["metadata"]["resourceVersion"]:
            return web.json_response(status(
                409, "Conflict", f'Operation cannot be fulfilled on {info["plural"]} "{info["name"]}": the object '
                                 "has been modified; please apply your changes to the latest version and try again"),
                status=409)
        return web.json_response(self.apply(obj), status=201 if request.method == "POST" else 200)

    async def _review(self, request: web.Request, kind: str) -> dict | web.Response:
        """The review's body, or the error the API server would answer instead."""
        if request.headers.get("Authorization") != f"Bearer {self.token}":
            return web.json_response(status(401, "Unauthorized", "Unauthorized"), status=401)
        if self._failures:
            code, reason = self._failures.pop(0)
            return web.json_response(status(code, reason, "injected failure"), status=code)
        try:
            body = await request.json()
        except ValueError:
            return web.json_response(status(400, "BadRequest", "the body is not JSON"), status=400)
        if not isinstance(body, dict) or body.get("kind") != kind or not isinstance(body.get("spec"), dict):
            return web.json_response(status(400, "BadRequest", f"expected a {kind}"), status=400)
        self.reviews[kind] += 1
        return body

    async def _token_review(self, request: web.Request) -> web.Response:
        body = await self._review(request, "TokenReview")
        if isinstance(body, web.Response):
            return body
        user = self.review_tokens.get(str(body["spec"].get("token") or ""))
        body["status"] = ({"authenticated": True, "user": copy.deepcopy(user)} if user is not None
                          else {"authenticated": False, "error": "invalid bearer token"})
        return web.json_response(body, status=201)

    async def _access_review(self, request: web.Request) -> web.Response:
        body = await self._review(request, "SubjectAccessReview")
        if isinstance(body, web.Response):
            return body
        spec = body["spec"]
        target = spec.get("nonResourceAttributes") or {}
        allowed = (spec.get("user") in self.metrics_readers and target.get("verb") == "get"
                   and target.get("path") in self.readable_paths)
        body["status"] = {"allowed": allowed} if allowed else {
            "allowed": False, "reason": f'no RBAC policy matched {target.get("verb")} {target.get("path")}'}
        return web.json_response(body, status=201)

    async def _core(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "", request.match_info["version"])

    async def _grouped(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, request.match_info["group"], request.match_info["version"])

    async def _serve(self, request: web.Request, group: str, version: str) -> web.StreamResponse:
        query = dict(request.query)
        self.requests.append((request.path, query))
        if request.headers.get("Authorization") != f"Bearer {self.token}":
            return web.json_response(status(401, "Unauthorized", "Unauthorized"), status=401)
        if self._failures:
            code, reason = self._failures.pop(0)
            return web.json_response(status(code, reason, "injected failure"), status=code)
        resource = self.resources.get((group, version, request.match_info["plural"]))
        if resource is None:
            return web.json_response(
                status(404, "NotFound", "the server could not find the requested resource"), status=404)
        try:
            labels = parse_label_selector(query.get("labelSelector", ""))
            fields = {}
            for term in filter(None, query.get("fieldSelector", "").split(",")):
                path, _, value = term.partition("=")
                if path not in ("metadata.name", "metadata.namespace"):
                    raise ValueError(f'field label not supported: {path}')
                fields[path] = value.lstrip("=")
        except ValueError as exc:
            return web.json_response(status(400, "BadRequest", str(exc)), status=400)
        watcher = _Watcher(resource, request.match_info["namespace"], labels, fields, request=request)
        if query.get("watch") in _TRUE:
            return await self._watch(request, watcher, query)
        return self._list(watcher, query)

    def _matching(self, watcher: _Watcher) -> list[dict]:
        bucket = self.objects.get(watcher.resource[:3:2], {})
        return [obj for (ns, _), obj in sorted(bucket.items())
                if ns == watcher.namespace and labels_match(obj, watcher.labels) and fields_match(obj, watcher.fields)]

    def _list(self, watcher: _Watcher, query: Mapping[str, str]) -> web.Response:
        limit = int(query.get("limit") or 0)
        token = query.get("continue")
        if token:
            state = json.loads(base64.urlsafe_b64decode(token))
            snapshot = self._snapshots.get(state["id"])
            if snapshot is None:
                return web.json_response(status(
                    410, "Expired", "The provided continue parameter is too old to display a consistent list "
                                    "result. You can start a new list without the continue parameter."), status=410)
            list_rv, items = snapshot
            start = state["offset"]
        else:
            list_rv, items, start = self.rv, [copy.deepcopy(o) for o in self._matching(watcher)], 0
        page = items[start:start + limit] if limit else items[start:]
        metadata: dict[str, Any] = {"resourceVersion": str(list_rv)}
        if limit and start + limit < len(items):
            snapshot_id = f"{list_rv}-{id(items)}"
            self._snapshots[snapshot_id] = (list_rv, items)
            metadata["continue"] = base64.urlsafe_b64encode(
                json.dumps({"id": snapshot_id, "offset": start + limit}).encode()).decode()
            metadata["remainingItemCount"] = len(items) - start - limit
            if self._compact_after_page:
                self._compact_after_page = False
                self.compact()
        return web.json_response({"kind": f"{watcher.resource[3]}List",
                                  "apiVersion": f"{watcher.resource[0]}/{watcher.resource[1]}".lstrip("/"),
                                  "metadata": metadata, "items": page})

    async def _watch(self, request: web.Request, watcher: _Watcher, query: Mapping[str, str]) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        since = int(query.get("resourceVersion") or 0)
        bookmarks = query.get("allowWatchBookmarks") in _TRUE
        timeout = float(query.get("timeoutSeconds") or 1800)
        if since and since < self.compacted_rv:
            error = status(410, "Expired", f"too old resource version: {since} ({self.compacted_rv})")
            await response.write(json.dumps({"type": "ERROR", "object": error}).encode() + b"\n")
            return response
        if since:
            backlog = [e for e in self.history if e.rv > since and e.resource == watcher.resource[:3:2]]
            initial = []
        else:  # no resourceVersion: synthetic ADDED for the current state first
            backlog = []
            initial = [{"type": "ADDED", "object": self._typed(watcher.resource, o)} for o in self._matching(watcher)]
        last = max(since, self.rv if not since else since)
        self.watchers.append(watcher)
        deadline = asyncio.get_running_loop().time() + timeout
        try:
            for item in initial:
                await response.write(json.dumps(item).encode() + b"\n")
            for event in backlog:
                await self._send(response, watcher, event)
                last = event.rv
            while True:
                left = deadline - asyncio.get_running_loop().time()
                if left <= 0:
                    break
                try:
                    event = await asyncio.wait_for(watcher.queue.get(), min(left, self.bookmark_interval))
                except TimeoutError:
                    if bookmarks:
                        mark = {"type": "BOOKMARK", "object": {
                            "kind": watcher.resource[3],
                            "apiVersion": f"{watcher.resource[0]}/{watcher.resource[1]}".lstrip("/"),
                            "metadata": {"resourceVersion": str(max(last, self.rv))}}}
                        await response.write(json.dumps(mark).encode() + b"\n")
                    continue
                if event is None:  # dropped by drop_watches()
                    return response
                if event.rv <= last:
                    continue
                await self._send(response, watcher, event)
                last = event.rv
        except (ConnectionResetError, RuntimeError):
            return response
        finally:
            if watcher in self.watchers:
                self.watchers.remove(watcher)
        await response.write_eof()
        return response

    async def _send(self, response: web.StreamResponse, watcher: _Watcher, event: _Event) -> None:
        item = self._event_for(watcher, event)
        if item is not None:
            await response.write(json.dumps(item).encode() + b"\n")


# ---- object builders ----------------------------------------------------------------------------


def pod(name: str, ip: str | None, *, labels: Mapping[str, str] | None = None, ready: bool = True,
        annotations: Mapping[str, str] | None = None, namespace: str = "default",
        terminating: bool = False) -> dict:
    """A Pod as the API returns it, Ready or not, with an IP or still pending."""
    status: dict[str, Any] = {"phase": "Running" if ip else "Pending"}
    if ip:
        status["podIP"] = ip
        status["podIPs"] = [{"ip": ip}]
    status["conditions"] = [
        {"type": "PodScheduled", "status": "True"},
        {"type": "Ready", "status": "True" if ready else "False"},
    ]
    meta: dict[str, Any] = {"name": name, "namespace": namespace, "labels": dict(labels or {"app": "vllm"})}
    if annotations:
        meta["annotations"] = dict(annotations)
    if terminating:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta,
            "spec": {"containers": [{"name": "vllm", "image": "vllm"}]}, "status": status}


def inference_pool(name: str, selector: Mapping[str, str], ports: Iterable[int], *,
                   namespace: str = "default", epp: str = "epp") -> dict:
    """An InferencePool (inference.networking.k8s.io/v1)."""
    return {"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"selector": {"matchLabels": dict(selector)},
                     "targetPorts": [{"number": p} for p in ports],
                     "endpointPickerRef": {"name": epp, "port": {"number": 9002}}}}


def inference_objective(name: str, priority: int | None, pool: str, *, namespace: str = "default",
                        group: str = OBJECTIVES[0]) -> dict:
    """An InferenceObjective (v1alpha2 of `group`: GIE's inference.networking.x-k8s.io, or llm-d.ai)."""
    spec: dict[str, Any] = {"poolRef": {"name": pool, "group": "inference.networking.k8s.io"}}
    if priority is not None:
        spec["priority"] = priority
    return {"apiVersion": f"{group}/v1alpha2", "kind": "InferenceObjective",
            "metadata": {"name": name, "namespace": namespace}, "spec": spec}
