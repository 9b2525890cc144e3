"""Endpoint discovery: sources that feed the endpoint registry with the pool's current members.

`Discovery` is the interface (a Kubernetes `InferencePool` watcher implements it too);
`StaticDiscovery` serves a fixed list and `FileDiscovery` follows a YAML/JSON file.
"""

from __future__ import annotations

import abc
import asyncio
import ipaddress
import json
import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import yaml

from epp.datalayer.registry import EndpointRegistry, EndpointSpec, parse_endpoint_list

log = logging.getLogger(__name__)


class Discovery(abc.ABC):
    """Feeds `registry` with full views of the pool until stopped.

    Implementations write `run()`; it calls `registry.set_endpoints(...)` with every new view,
    which also marks the registry synced (readiness) on the first one. `start()` runs it in a
    task and returns once the first view was published or `first_sync_timeout` passed.
    """

    def __init__(self, registry: EndpointRegistry) -> None:
        self.registry = registry
        self._task: asyncio.Task[None] | None = None
        self._synced = asyncio.Event()

    @abc.abstractmethod
    async def run(self) -> None:
        """Publish views into the registry until cancelled."""

    def publish(self, specs: Iterable[EndpointSpec]) -> None:
        """Hand one full view of the pool to the registry."""
        self.registry.set_endpoints(specs)
        self._synced.set()

    async def start(self, first_sync_timeout: float | None = 5.0) -> bool:
        """Run discovery in the background; True once the first view is in the registry."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self.run(), name=type(self).__name__)
        if first_sync_timeout is None:
            return self._synced.is_set()
        waiter = asyncio.ensure_future(self._synced.wait())
        done, _ = await asyncio.wait({waiter, self._task}, timeout=first_sync_timeout,
                                     return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        failure = self._task.exception() if self._task in done else None
        if failure is not None:
            raise failure
        return self._synced.is_set()

    async def stop(self) -> None:
        """Stop the background run; the registry keeps the last view."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


class StaticDiscovery(Discovery):
    """A fixed list of endpoints, with their labels (e.g. from `parse_endpoint_list`)."""

    def __init__(self, registry: EndpointRegistry, endpoints: Sequence[EndpointSpec] | str) -> None:
        super().__init__(registry)
        self.endpoints = tuple(parse_endpoint_list(endpoints) if isinstance(endpoints, str) else endpoints)

    async def run(self) -> None:
        self.publish(self.endpoints)


class EndpointFileError(ValueError):
    """An endpoints file that cannot be used; the message names the entry and field."""


ENTRY_FIELDS = ("address", "port", "metricsPort", "labels", "name", "namespace")


def parse_endpoint_document(document: Any) -> list[EndpointSpec]:
    """Endpoints from a decoded file: `{endpoints: [...]}` or a bare list; each entry is
    `{address, port, metricsPort?, labels?}` or an `ip:port#k=v;k=v` string. llm-d's file-discovery
    entries load too: `port` may be a string of digits, and `name` (unique in the file) and `namespace`
    name the entry in errors (an endpoint is known here by its `ip:port`)."""
    if isinstance(document, Mapping):
        unknown = sorted(set(document) - {"endpoints"})
        if unknown:
            raise EndpointFileError(f"unknown top-level field(s) {unknown}; allowed: ['endpoints']")
        document = document.get("endpoints")
    if document is None:
        return []
    if not isinstance(document, list):
        raise EndpointFileError("'endpoints' must be a list")
    specs: list[EndpointSpec] = []
    named: dict[str, str] = {}  # namespace/name -> the entry that has it
    for index, entry in enumerate(document):
        where = f"endpoints[{index}]"
        if isinstance(entry, str):
            try:
                specs.extend(parse_endpoint_list(entry))
            except ValueError as exc:
                raise EndpointFileError(f"{where}: {exc}") from None
            continue
        if not isinstance(entry, Mapping):
            raise EndpointFileError(f"{where}: expected a mapping or an 'ip:port' string")
        unknown = sorted(set(entry) - set(ENTRY_FIELDS))
        if unknown:
            raise EndpointFileError(f"{where}: unknown field(s) {unknown}; allowed: {sorted(ENTRY_FIELDS)}")
        if entry.get("name") is not None:
            name = entry["name"]
            if not isinstance(name, str) or not name:
                raise EndpointFileError(f"{where}.name: must be a non-empty string, got {name!r}")
            qualified = f"{entry.get('namespace') or 'default'}/{name}"
            if qualified in named:
                raise EndpointFileError(f"{where}.name: {name!r} is already the name of {named[qualified]}; names "
                                        "must be unique in the file")
            named[qualified] = where
            where = f"{where} ({name})"
        address = entry.get("address")
        try:
            ipaddress.ip_address(address)
        except ValueError:
            raise EndpointFileError(f"{where}.address: {address!r} is not an IP address") from None
        port = _port(entry.get("port"), f"{where}.port")
        metrics_port = None
        if entry.get("metricsPort") is not None:
            metrics_port = _port(entry["metricsPort"], f"{where}.metricsPort")
        labels = entry.get("labels") or {}
        if not isinstance(labels, Mapping) or any(
                not isinstance(v, (str, int, float, bool)) for v in labels.values()):
            raise EndpointFileError(f"{where}.labels: must map names to scalar values")
        specs.append(EndpointSpec(str(address), port, {str(k): _label_text(v) for k, v in labels.items()},
                                  metrics_port))
    names = [spec.name for spec in specs]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise EndpointFileError(f"duplicate endpoint(s) {duplicates}")
    return specs


def _port(value: Any, where: str) -> int:
    if isinstance(value, str) and value.isdigit():  # llm-d's files write ports as strings
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 65536:
        raise EndpointFileError(f"{where}: must be an integer port 1-65535, got {value!r}")
    return value


def _label_text(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def load_endpoint_file(text: str, path: str = "") -> list[EndpointSpec]:
    """Decode a YAML or JSON endpoints file (JSON is valid YAML, but `.json` gets exact errors)."""
    try:
        document = json.loads(text) if path.endswith(".json") else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as exc:
        raise EndpointFileError(f"cannot decode: {exc}") from None
    return parse_endpoint_document(document)


class FileDiscovery(Discovery):
    """Follows a YAML/JSON file of endpoints: polled every `poll_interval` seconds and re-read
    when its size, mtime or inode changes (`watch=False`: until the first good read only). A file
    that cannot be read or decoded keeps the previous view (and the registry stays unsynced until a
    first good read)."""

    def __init__(self, registry: EndpointRegistry, path: str | os.PathLike[str],
                 poll_interval: float = 1.0, watch: bool = True) -> None:
        super().__init__(registry)
        self.path = os.fspath(path)
        self.poll_interval = poll_interval
        # False (llm-d's `watchFile: false`): the first good read is the pool for good.
        self.watch = watch
        self.errors = 0
        self._signature: tuple[int, int, int] | None = None
        self._last_error: str | None = None

    async def run(self) -> None:
        while True:
            published = await self.poll_once()
            if published and not self.watch:
                return
            await asyncio.sleep(self.poll_interval)

    async def poll_once(self) -> bool:
        """Re-read the file if it changed; True when a new view was published."""
        try:
            # File I/O can stall (network volumes); it runs off the event loop.
            stat = await asyncio.to_thread(os.stat, self.path)
        except OSError as exc:
            self._fail(str(exc))
            return False
        signature = (stat.st_mtime_ns, stat.st_size, stat.st_ino)
        if signature == self._signature:
            return False
        # Remembered before decoding, so an unchanged bad file is not re-read at every poll.
        self._signature = signature
        try:
            text = await asyncio.to_thread(_read_text, self.path)
            specs = load_endpoint_file(text, self.path)
        except (OSError, UnicodeDecodeError, EndpointFileError) as exc:
            self._fail(str(exc))
            return False
        self._last_error = None
        self.publish(specs)
        log.info("endpoints file %s: %d endpoint(s)", self.path, len(specs))
        return True

    def _fail(self, message: str) -> None:
        self.errors += 1
        if message != self._last_error:  # log each distinct problem once, not every poll
            log.error("endpoints file %s: %s; keeping the previous %d endpoint(s)",
                      self.path, message, len(self.registry))
        self._last_error = message


def _read_text(path: str) -> str:
    with open(path, encoding="utf-8") as handle:
        return handle.read()
