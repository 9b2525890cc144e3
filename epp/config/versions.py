"""The apiVersions an EndpointPickerConfig may have, each converted to llm-d.ai/v1's layout before loading.

llm-d 1.0 (`llm-d.ai/v1`) is the current layout. `llm-d.ai/v1alpha1` and GIE's
`inference.networking.x-k8s.io/v1alpha1` decode the same way and differ from v1 only under
`dataLayer`: the `crossReplica*` fields group into `crossReplica`, and a bare
`discovery.pluginRef` moves to `discovery.endpoints.pluginRef`. Both load with one deprecation
line, as llm-d logs it. Older forms that still appear in configs (`data`, GIE v1.3-v1.4's name of
`dataLayer`; llm-d's earlier `peerDiscovery`; a bare `discovery.pluginRef`) load in every version
with a warning naming their v1 place. Everything else is copied as it is.
"""

from __future__ import annotations

import logging
from typing import Any

from epp.config.schema import API_VERSION, API_VERSIONS, KIND, Document

log = logging.getLogger("epp.config.loader")

# v1alpha1's flat cross-replica fields -> their name under v1's `dataLayer.crossReplica`.
CROSS_REPLICA_V1ALPHA1 = {"crossReplicaSyncerPluginRef": "syncerPluginRef",
                          "crossReplicaSyncInterval": "syncInterval",
                          "crossReplicaPublishTimeout": "publishTimeout"}


def check_version(document: Document, doc: dict[str, Any]) -> str:
    """The document's apiVersion (one of `API_VERSIONS`), its kind checked; a deprecated one logs once."""
    version = doc["apiVersion"]
    if version not in API_VERSIONS:
        raise document.fail("apiVersion", f"unsupported apiVersion {version!r}; allowed: {', '.join(API_VERSIONS)}")
    if doc["kind"] != KIND:
        raise document.fail("kind", f"unsupported kind {doc['kind']!r}; allowed: {KIND}")
    if version != API_VERSION:
        # The line llm-d logs, once per load (without a field path: it is about the whole document).
        line = f"DEPRECATION: apiVersion {version}/{KIND} is deprecated; use {API_VERSION}"
        log.warning("%s: %s", document.source, line)
        document.note("apiVersion", line)
    return str(version)


def to_v1(document: Document, doc: dict[str, Any], version: str) -> dict[str, Any]:
    """`doc` in llm-d.ai/v1's layout (a new top-level mapping; the fields it does not move are shared)."""
    out = dict(doc)
    if "data" in out:
        if out.get("dataLayer") is not None:
            raise document.fail("data", "both `data` and `dataLayer` are set; `data` is GIE's old name of "
                                "`dataLayer`: keep only `dataLayer`")
        document.deprecate("data", "`data` is deprecated (GIE v1.3-v1.4); use `dataLayer`")
        out["dataLayer"] = out.pop("data")
    if isinstance(out.get("dataLayer"), dict):
        out["dataLayer"] = _data_layer_to_v1(document, dict(out["dataLayer"]), version)
    return out


def _data_layer_to_v1(document: Document, layer: dict[str, Any], version: str) -> dict[str, Any]:
    flat = [key for key in CROSS_REPLICA_V1ALPHA1 if key in layer]
    if flat:
        if version == API_VERSION:
            raise document.fail(f"dataLayer.{flat[0]}", f"is llm-d.ai/v1alpha1's field; in {API_VERSION} it is "
                                f"dataLayer.crossReplica.{CROSS_REPLICA_V1ALPHA1[flat[0]]}")
        if layer.get("crossReplica") is not None:
            raise document.fail(f"dataLayer.{flat[0]}", "both the v1alpha1 crossReplica* fields and "
                                "dataLayer.crossReplica are set; keep one")
        layer["crossReplica"] = {CROSS_REPLICA_V1ALPHA1[key]: layer.pop(key) for key in flat}
    if "peerDiscovery" in layer:
        discovery = layer.get("discovery")
        if isinstance(discovery, dict) and discovery.get("peers") is not None:
            raise document.fail("dataLayer.peerDiscovery", "both peerDiscovery and discovery.peers are set; keep "
                                "discovery.peers")
        document.deprecate("dataLayer.peerDiscovery", "dataLayer.peerDiscovery is deprecated; use "
                           "dataLayer.discovery.peers")
        layer["discovery"] = {**(discovery if isinstance(discovery, dict) else {}), "peers": layer.pop("peerDiscovery")}
    discovery = layer.get("discovery")
    if isinstance(discovery, dict) and "pluginRef" in discovery:
        discovery = dict(discovery)
        bare = discovery.pop("pluginRef")
        # llm-d's own words; the new field wins when both are set.
        document.deprecate("dataLayer.discovery.pluginRef", "dataLayer.discovery.pluginRef is deprecated, use "
                           "dataLayer.discovery.endpoints.pluginRef instead. If both are set, the new field is used.")
        if discovery.get("endpoints") is None:
            discovery["endpoints"] = {"pluginRef": bare}
        layer["discovery"] = discovery
    return layer
