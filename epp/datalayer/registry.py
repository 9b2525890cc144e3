"""The endpoint registry: the pool's endpoints as immutable snapshots, fed by discovery and scraping."""

from __future__ import annotations

import dataclasses
import ipaddress
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from epp.framework.endpoints import EndpointListener
from epp.framework.types import Endpoint, EndpointMetrics


@dataclass(frozen=True)
class EndpointSpec:
    """What discovery knows of an endpoint: where it is and its labels."""

    address: str
    port: int
    labels: Mapping[str, str] = field(default_factory=dict)
    metrics_port: int | None = None

    @property
    def name(self) -> str:
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"{host}:{self.port}"


def parse_endpoint_list(text: str) -> list[EndpointSpec]:
    """Parse `ip:port[#k=v;k=v],...` (IPv6 as `[addr]:port`) into endpoint specs."""
    specs: list[EndpointSpec] = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        hostport, _, label_text = item.partition("#")
        host, sep, port_text = hostport.rpartition(":")
        if not sep or not host:
            raise ValueError(f"endpoint {item!r}: expected ip:port")
        host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
        try:
            ipaddress.ip_address(host)
        except ValueError:
            raise ValueError(f"endpoint {item!r}: {host!r} is not an IP address") from None
        if not port_text.isdigit() or not 0 < int(port_text) < 65536:
            raise ValueError(f"endpoint {item!r}: port must be 1-65535")
        labels: dict[str, str] = {}
        for pair in filter(None, label_text.split(";")):
            key, eq, value = pair.partition("=")
            if not eq or not key:
                raise ValueError(f"endpoint {item!r}: label {pair!r} must be key=value")
            labels[key.strip()] = value.strip()
        specs.append(EndpointSpec(host, int(port_text), labels))
    return specs


class EndpointRegistry:
    """The pool's endpoints by name. Readers get immutable snapshots; writers swap whole entries."""

    def __init__(self) -> None:
        self._endpoints: dict[str, Endpoint] = {}
        self._snapshot: tuple[Endpoint, ...] = ()
        self._listeners: list[EndpointListener] = []
        self._metrics_listeners: list[Callable[[Endpoint], None]] = []
        # Sleep states set by sleep/wake calls, held until a scrape agrees: (sleeping, until monotonic).
        self._expected_sleep: dict[str, tuple[bool, float]] = {}
        self.synced = False

    def snapshot(self) -> tuple[Endpoint, ...]:
        """All endpoints now, each with its latest metrics."""
        return self._snapshot

    def get(self, name: str) -> Endpoint | None:
        return self._endpoints.get(name)

    def __len__(self) -> int:
        return len(self._endpoints)

    def add_listener(self, listener: EndpointListener) -> None:
        """Call `listener(added, removed)` whenever the set of endpoints changes."""
        self._listeners.append(listener)

    def remove_listener(self, listener: EndpointListener) -> None:
        """Stop calling `listener`; unknown listeners are ignored."""
        if listener in self._listeners:
            self._listeners.remove(listener)

    def add_metrics_listener(self, listener: Callable[[Endpoint], None]) -> None:
        """Call `listener(endpoint)` after each swap of an endpoint's metrics or health."""
        self._metrics_listeners.append(listener)

    def set_endpoints(self, specs: Iterable[EndpointSpec]) -> None:
        """Replace the set of endpoints (discovery's full view); metrics of kept ones survive."""
        wanted = {spec.name: spec for spec in specs}
        removed = tuple(ep for name, ep in self._endpoints.items() if name not in wanted)
        added: list[Endpoint] = []
        endpoints: dict[str, Endpoint] = {}
        for name, spec in wanted.items():
            old = self._endpoints.get(name)
            if old is None:
                ep = Endpoint(spec.address, spec.port, MappingProxyType(dict(spec.labels)), EndpointMetrics(),
                              spec.metrics_port)
                added.append(ep)
            elif old.labels == spec.labels and old.metrics_port == spec.metrics_port:
                ep = old  # unchanged: a view of 1,000s of endpoints with one change stays cheap
            else:
                ep = dataclasses.replace(old, labels=MappingProxyType(dict(spec.labels)),
                                         metrics_port=spec.metrics_port)
            endpoints[name] = ep
        self._endpoints = endpoints
        for ep in removed:
            self._expected_sleep.pop(ep.name, None)
        self._rebuild()
        self.synced = True
        if added or removed:
            for listener in self._listeners:
                listener(tuple(added), removed)

    def update(self, name: str, *, metrics: EndpointMetrics | None = None,
               healthy: bool | None = None) -> None:
        """Swap in new metrics and/or health for one endpoint; unknown names are ignored."""
        old = self._endpoints.get(name)
        if old is None:
            return
        changes = {}
        if metrics is not None:
            expected = self._expected_sleep.get(name)
            if expected is not None:
                if metrics.sleeping == expected[0] or time.monotonic() > expected[1]:
                    del self._expected_sleep[name]
                else:  # a page fetched before the sleep/wake call took effect
                    metrics = dataclasses.replace(metrics, sleeping=expected[0])
            changes["metrics"] = metrics
        if healthy is not None:
            changes["healthy"] = healthy
        new = self._endpoints[name] = dataclasses.replace(old, **changes)
        self._rebuild()
        for listener in self._metrics_listeners:
            listener(new)

    def expect_sleeping(self, name: str, sleeping: bool, for_seconds: float) -> None:
        """Set an endpoint's sleep state now and hold it against scrapes that disagree, until one
        agrees or `for_seconds` pass.

        A sleep or wake call changes a replica before its `/metrics` page shows it: without the
        hold, a page fetched just before `/sleep` would flip the replica back to awake, and a
        request routed there in that moment would wait on a sleeping engine.
        """
        old = self._endpoints.get(name)
        if old is None:
            return
        self._expected_sleep[name] = (sleeping, time.monotonic() + for_seconds)
        if old.metrics.sleeping != sleeping:
            self._endpoints[name] = dataclasses.replace(
                old, metrics=dataclasses.replace(old.metrics, sleeping=sleeping))
            self._rebuild()

    def _rebuild(self) -> None:
        self._snapshot = tuple(self._endpoints.values())
