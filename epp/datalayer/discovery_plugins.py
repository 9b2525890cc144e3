"""Endpoint discovery as plugins: what feeds the pool's endpoints into the registry.

A config names one with `dataLayer.discovery.endpoints.pluginRef` (llm-d.ai/v1; v1alpha1's bare
`discovery.pluginRef` converts to it). Without one, the command line's discovery flags make the
default plugin, so `--endpoints`, `--endpoints-file`, `--pool-name` and `--endpoint-selector`
work as they always did. An outside package adds a discovery type through the `epp.plugins`
entry-point group like any other plugin: a subclass of `EndpointDiscoveryPlugin` whose
`discovery()` returns a `Discovery` (see `examples/outside_discovery`).
"""

from __future__ import annotations

import abc
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry

from epp.datalayer.discovery import (
    Discovery,
    EndpointFileError,
    FileDiscovery,
    StaticDiscovery,
    parse_endpoint_document,
)
from epp.datalayer.registry import EndpointRegistry, EndpointSpec
from epp.framework.errors import ConfigError
from epp.framework.params import PluginParams
from epp.framework.plugin import Plugin, PluginContext
from epp.framework.registry import PluginRegistry

POOL_GROUP = "inference.networking.k8s.io"


@dataclass(frozen=True)
class DiscoveryEnvironment:
    """What a discovery plugin may use beside its parameters, given by the server at start."""

    metrics_registry: CollectorRegistry | None = None
    objectives: Any = None  # ObjectivePriorities the InferencePool discovery keeps current (None: not watched)
    namespace: str = ""  # the picker's namespace ($NAMESPACE, else `default`) when a plugin names none
    kubeconfig: str | None = None  # --kubeconfig
    api_client: Any = None  # a Kubernetes client made beforehand (tests); None: from the kubeconfig


class EndpointDiscoveryPlugin(Plugin, abc.ABC):
    """A plugin that discovers the pool's endpoints (`dataLayer.discovery.endpoints.pluginRef`)."""

    @abc.abstractmethod
    def discovery(self, endpoints: EndpointRegistry, env: DiscoveryEnvironment) -> Discovery:
        """The discovery that keeps `endpoints` current (started and stopped by the server)."""

    @abc.abstractmethod
    def source(self) -> str:
        """Where the endpoints come from, on one line (`endpoints from FILE`), for logs and check-config."""

    def describe(self) -> str:
        return self.source()


def _default_namespace(env: DiscoveryEnvironment) -> str:
    return env.namespace or os.environ.get("NAMESPACE") or "default"


class StaticDiscoveryPlugin(EndpointDiscoveryPlugin):
    """A fixed list of endpoints (`--endpoints`): `ip:port#k=v;...` strings or `{address, port, labels}` entries."""

    type_name = "static-discovery"

    def __init__(self, name: str, params: PluginParams, context: PluginContext | None = None) -> None:
        super().__init__(name, params, context)
        raw = params.list("endpoints", None)
        if raw is None:
            raise ConfigError(f"plugin {name!r}: parameter 'endpoints' is required (a list of ip:port entries)")
        try:
            self.endpoints: tuple[EndpointSpec, ...] = tuple(parse_endpoint_document(raw))
        except EndpointFileError as exc:
            raise ConfigError(f"plugin {name!r}: parameter 'endpoints': {exc}") from None

    @classmethod
    def of(cls, specs: list[EndpointSpec] | tuple[EndpointSpec, ...]) -> StaticDiscoveryPlugin:
        """The plugin for endpoints the command line gave (`--endpoints`)."""
        entries: list[dict[str, Any]] = []
        for spec in specs:
            entry: dict[str, Any] = {"address": spec.address, "port": spec.port, "labels": dict(spec.labels)}
            if spec.metrics_port is not None:
                entry["metricsPort"] = spec.metrics_port
            entries.append(entry)
        return cls(cls.type_name, PluginParams(cls.type_name, {"endpoints": entries}))

    def discovery(self, endpoints: EndpointRegistry, env: DiscoveryEnvironment) -> Discovery:
        return StaticDiscovery(endpoints, list(self.endpoints))

    def source(self) -> str:
        names = [spec.name for spec in self.endpoints]
        shown = ", ".join(names[:5]) + (f", ... ({len(names) - 5} more)" if len(names) > 5 else "")
        return f"{len(names)} static endpoint(s){': ' + shown if names else ''}"


class FileDiscoveryPlugin(EndpointDiscoveryPlugin):
    """llm-d's `file-discovery`: endpoints from a YAML/JSON file, re-read when it changes (`watchFile`)."""

    type_name = "file-discovery"

    def __init__(self, name: str, params: PluginParams, context: PluginContext | None = None) -> None:
        super().__init__(name, params, context)
        path = params.str("path", None)
        if not path:
            raise ConfigError(f"plugin {name!r}: parameter 'path' is required (the endpoints file)")
        self.path = path
        # llm-d's default is false (read once); the --endpoints-file flag always follows the file.
        self.watch = bool(params.bool("watchFile", False))
        self.poll_interval_s = params.duration("pollInterval", 1.0, minimum=0.05)

    @classmethod
    def of(cls, path: str) -> FileDiscoveryPlugin:
        """The plugin for `--endpoints-file PATH` (watched)."""
        return cls(cls.type_name, PluginParams(cls.type_name, {"path": path, "watchFile": True}))

    def discovery(self, endpoints: EndpointRegistry, env: DiscoveryEnvironment) -> Discovery:
        return FileDiscovery(endpoints, self.path, poll_interval=self.poll_interval_s, watch=self.watch)

    def source(self) -> str:
        how = f"re-read on change (checked every {self.poll_interval_s:g}s)" if self.watch else "read once"
        return f"endpoints from {self.path}, {how}"


class InferencePoolDiscoveryPlugin(EndpointDiscoveryPlugin):
    """The Ready pods of an InferencePool (`--pool-name`), with the pool's InferenceObjectives."""

    type_name = "inference-pool-discovery"

    def __init__(self, name: str, params: PluginParams, context: PluginContext | None = None) -> None:
        super().__init__(name, params, context)
        pool = params.str("poolName", None)
        if not pool:
            raise ConfigError(f"plugin {name!r}: parameter 'poolName' is required (the InferencePool's name)")
        self.pool_name = pool
        self.namespace = params.str("namespace", None)
        self.pool_group = params.str("poolGroup", POOL_GROUP,
                                     choices=(POOL_GROUP, "inference.networking.x-k8s.io"))
        self.kubeconfig = params.str("kubeconfig", None)

    @classmethod
    def of(cls, pool_name: str, namespace: str | None, pool_group: str,
           kubeconfig: str | None) -> InferencePoolDiscoveryPlugin:
        """The plugin for `--pool-name` (and `--pool-namespace`, `--pool-group`, `--kubeconfig`)."""
        raw = {"poolName": pool_name, "namespace": namespace, "poolGroup": pool_group, "kubeconfig": kubeconfig}
        return cls(cls.type_name, PluginParams(cls.type_name, {k: v for k, v in raw.items() if v is not None}))

    def discovery(self, endpoints: EndpointRegistry, env: DiscoveryEnvironment) -> Discovery:
        from epp.datalayer.kubernetes import KubernetesDiscovery

        return KubernetesDiscovery(endpoints, namespace=self.namespace or _default_namespace(env),
                                   pool_name=self.pool_name, pool_group=self.pool_group,
                                   kubeconfig=self.kubeconfig or env.kubeconfig, objectives=env.objectives,
                                   metrics_registry=env.metrics_registry, api_client=env.api_client)

    def source(self) -> str:
        namespace = self.namespace or "$NAMESPACE"
        return f"InferencePool {namespace}/{self.pool_name} ({self.pool_group}): its Ready pods"


class EndpointSelectorDiscoveryPlugin(EndpointDiscoveryPlugin):
    """Standalone mode without CRDs (`--endpoint-selector`): the Ready pods matching labels, on given ports."""

    type_name = "endpoint-selector-discovery"

    def __init__(self, name: str, params: PluginParams, context: PluginContext | None = None) -> None:
        from epp.datalayer.inference_pool import parse_selector, parse_target_ports
        from epp.kube.client import KubernetesError

        super().__init__(name, params, context)
        selector = params.mapping("matchLabels", None)
        ports = params.list("targetPorts", None)
        if not selector:
            raise ConfigError(f"plugin {name!r}: parameter 'matchLabels' is required (the pods' labels)")
        if not ports:
            raise ConfigError(f"plugin {name!r}: parameter 'targetPorts' is required (the pods' serving ports)")
        try:
            self.selector = parse_selector(",".join(f"{k}={v}" for k, v in selector.items()))
            self.target_ports = parse_target_ports(",".join(str(p) for p in ports))
        except KubernetesError as exc:
            message = str(exc).replace("--endpoint-selector", "matchLabels").replace(
                "--endpoint-target-ports", "targetPorts")
            raise ConfigError(f"plugin {name!r}: {message}") from None
        self.namespace = params.str("namespace", None)
        self.kubeconfig = params.str("kubeconfig", None)

    @classmethod
    def of(cls, selector: Mapping[str, str], target_ports: tuple[int, ...], namespace: str | None,
           kubeconfig: str | None) -> EndpointSelectorDiscoveryPlugin:
        """The plugin for `--endpoint-selector` and `--endpoint-target-ports`."""
        raw: dict[str, Any] = {"matchLabels": dict(selector), "targetPorts": list(target_ports)}
        if namespace is not None:
            raw["namespace"] = namespace
        if kubeconfig is not None:
            raw["kubeconfig"] = kubeconfig
        return cls(cls.type_name, PluginParams(cls.type_name, raw))

    def discovery(self, endpoints: EndpointRegistry, env: DiscoveryEnvironment) -> Discovery:
        from epp.datalayer.kubernetes import KubernetesDiscovery

        return KubernetesDiscovery(endpoints, namespace=self.namespace or _default_namespace(env),
                                   selector=self.selector, target_ports=self.target_ports,
                                   kubeconfig=self.kubeconfig or env.kubeconfig,
                                   metrics_registry=env.metrics_registry, api_client=env.api_client)

    def source(self) -> str:
        labels = ",".join(f"{k}={v}" for k, v in self.selector.items())
        ports = ",".join(str(p) for p in self.target_ports)
        return f"pods matching {labels} in {self.namespace or '$NAMESPACE'}, ports {ports}"


DISCOVERY_PLUGINS: tuple[type[EndpointDiscoveryPlugin], ...] = (
    StaticDiscoveryPlugin, FileDiscoveryPlugin, InferencePoolDiscoveryPlugin, EndpointSelectorDiscoveryPlugin)


def register(registry: PluginRegistry) -> None:
    """Entry point of the `epp.plugins` group for the built-in discovery plugins."""
    for cls in DISCOVERY_PLUGINS:
        registry.register_class(cls)


def default_discovery(options: Any) -> EndpointDiscoveryPlugin:
    """The discovery the command line's flags ask for (`epp serve`'s options); none given: no endpoints."""
    if getattr(options, "pool_name", None):
        return InferencePoolDiscoveryPlugin.of(options.pool_name, options.pool_namespace, options.pool_group,
                                               options.kubeconfig)
    if getattr(options, "endpoint_selector", None):
        return EndpointSelectorDiscoveryPlugin.of(options.endpoint_selector, tuple(options.endpoint_target_ports),
                                                  options.pool_namespace, options.kubeconfig)
    if getattr(options, "endpoints_file", None):
        return FileDiscoveryPlugin.of(options.endpoints_file)
    return StaticDiscoveryPlugin.of(list(getattr(options, "endpoints", None) or ()))


def discovery_flags(options: Any) -> list[str]:
    """The command line's discovery flags that were given (they yield to a config's discovery plugin)."""
    flags = [("pool_name", "--pool-name"), ("endpoint_selector", "--endpoint-selector"),
             ("endpoints_file", "--endpoints-file"), ("endpoints", "--endpoints")]
    return [flag for attr, flag in flags if getattr(options, attr, None)]
